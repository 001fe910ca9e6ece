"""The router's workers: who they are (membership), whether they answer and are ready (GET /pd/info,
polled: the heartbeat), and their load (what they advertise, plus what this router has on them).

Membership changes only through `WorkerPool.set_members`, which membership.py calls with the union
of its sources (static URLs, DNS names, registrations) before each poll.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from pdserve.disagg.client import WorkerClient, WorkerUnreachable
from pdserve.disagg.control import WorkerInfo
from pdserve.disagg.router.stats import WorkerLoad, WorkerRole, WorkerView

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(slots=True)
class Worker:
    """One worker as the router sees it. `info` is its last GET /pd/info answer (None while it
    does not answer); the in-flight counts are this router's own work on it, kept by whoever
    sends the work (router: decode requests; memory queue: prefill jobs)."""

    url: str
    role: WorkerRole
    info: WorkerInfo | None = None
    in_flight: int = 0
    in_flight_tokens: int = 0  # prefill: prompt tokens of the jobs pushed to it and not yet handed off
    member: bool = True  # False once no membership source lists it: it finishes this router's work, gets no more
    was_ready: bool = False  # it has been ready since it joined: while listed, it is expected back
    router_stopping: bool = False  # this router is shutting down (`WorkerPool.stopping`)

    @property
    def ready(self) -> bool:
        return self.member and self.info is not None and self.info.ready

    @property
    def busy(self) -> bool:
        return self.in_flight > 0 or self.in_flight_tokens > 0

    @property
    def going(self) -> bool:
        """It said it is leaving (deregistered or out of the membership, or draining), or this router
        is stopping (`up`'s Ctrl-C stops every process at once): losing it now is expected, not a fault."""
        return self.router_stopping or not self.member or (self.info is not None and self.info.draining)

    def mark_draining(self) -> None:
        """It answered 503, draining (a prefill worker to a job, a decode worker to a reservation): no
        new work for it from now on, not from its next /pd/info answer (which says the same); losing
        it later is expected (`going`)."""
        if self.info is not None:
            if self.info.ready:
                logger.info("%s worker %s left the pool: draining", self.role, self.url)
            self.info = self.info.model_copy(update={"ready": False, "draining": True})

    def mark_unreachable(self, exc: WorkerUnreachable) -> None:
        """A call to it failed: it leaves the pool until its next /pd/info answer. One that said it
        was leaving (`going`) is gone on purpose: said as INFO."""
        (logger.info if self.going else logger.warning)("%s worker %s unreachable: %r", self.role, self.url, exc.cause)
        self.info = None

    def view(self) -> WorkerView:
        info = self.info
        load = None if info is None else WorkerLoad(info.num_running, info.num_waiting, info.num_free_kv_blocks,
                                                     info.num_kv_blocks, int(info.kv_layout.get("block_size", 0)),
                                                     info.max_lora, tuple(info.running_lora_adapters),
                                                     tuple(info.waiting_lora_adapters))
        return WorkerView(self.role, self.url, self.ready, self.in_flight, bool(info and info.draining), load)


async def reach(worker: Worker, call: Awaitable[T]) -> T | None:
    """`call` (a WorkerClient call to `worker`), or None when the worker cannot be reached, which
    takes it out of the pool at once rather than at the next poll."""
    try:
        return await call
    except WorkerUnreachable as exc:
        worker.mark_unreachable(exc)
        return None


class WorkerPool:
    """Prefill and decode workers by role. Single-threaded (the router's event loop)."""

    def __init__(self, client: WorkerClient, prefill: Iterable[str] = (), decode: Iterable[str] = ()) -> None:
        self._client = client
        self._members: dict[WorkerRole, list[Worker]] = {"prefill": [], "decode": []}
        self._stopping = False  # see `stopping`
        self._starting_until = float("-inf")  # see expect_first_workers
        self._ever_ready: set[WorkerRole] = set()  # roles that have had a ready worker
        self.set_members("prefill", prefill)
        self.set_members("decode", decode)

    @property
    def stopping(self) -> bool:
        """The router is shutting down: every worker going away from now on is expected (`Worker.going`)."""
        return self._stopping

    @stopping.setter
    def stopping(self, value: bool) -> None:
        self._stopping = value
        for worker in self._members["prefill"] + self._members["decode"]:
            worker.router_stopping = value

    def set_members(self, role: WorkerRole, urls: Iterable[str]) -> None:
        """The workers of `role` are now these. A worker already known keeps its state (readiness,
        in-flight counts); a new one is not ready until it answers a poll; one left out gets no
        new work and is forgotten once this router has nothing left on it (a decode worker's
        streams, a prefill worker's jobs), so that work can still reach it until it ends."""
        known = {w.url: w for w in self._members[role]}
        listed = list(dict.fromkeys(url.rstrip("/") for url in urls))  # NOTE: a worker listed twice is one
        members = [known.pop(url) if url in known else Worker(url, role, router_stopping=self._stopping)
                   for url in listed]
        for worker in members:
            worker.member = True
        leaving = [w for w in known.values() if w.busy]
        for worker in leaving:
            if worker.member:
                logger.info("%s worker %s left the membership; finishing its work", role, worker.url)
            worker.member = False
        self._members[role] = members + leaving

    def leaving(self, url: str) -> None:
        """The worker at `url` deregistered: no new work for it from now on, not from the next
        membership update (`set_members`, before each poll); what this router has on it finishes."""
        for role in ("prefill", "decode"):
            if (worker := self.find(role, url.rstrip("/"))) is not None:
                worker.member = False

    def members(self, role: WorkerRole) -> list[Worker]:
        return list(self._members[role])

    def ready(self, role: WorkerRole) -> list[Worker]:
        return [w for w in self._members[role] if w.ready]

    def any_ready(self, role: WorkerRole) -> bool:
        return any(w.ready for w in self._members[role])

    def expect_first_workers(self, window_s: float) -> None:
        """A fresh router: for `window_s` from now (`startup_window_s`), a role that has had no ready
        worker yet has one on its way (loading, or not registered yet), as a restarting one is."""
        self._starting_until = time.monotonic() + window_s

    @property
    def starting(self) -> bool:
        """Within the window `expect_first_workers` opened."""
        return time.monotonic() < self._starting_until

    def expected_back(self, role: WorkerRole) -> bool:
        """No worker of `role` is ready, but one that was is still listed (restarting, draining
        before a restart, or gone and not yet out of its membership source), or this fresh router
        has not seen the role's first one yet (`expect_first_workers`)."""
        if self.any_ready(role):
            return False
        return any(w.member and w.was_ready for w in self._members[role]) or \
            (role not in self._ever_ready and self.starting)

    def find(self, role: WorkerRole, url: str) -> Worker | None:
        return next((w for w in self._members[role] if w.url == url), None)

    def views(self) -> list[WorkerView]:
        return [w.view() for w in self._members["prefill"] + self._members["decode"]]

    async def refresh(self) -> None:
        """Poll every worker's /pd/info (role, layout, readiness, load). A worker that does not
        answer within 2 s leaves the pool until it answers again."""
        await asyncio.gather(*(self._poll(w) for w in self._members["prefill"] + self._members["decode"]))

    async def _poll(self, worker: Worker) -> None:
        try:
            info = await self._client.info(worker.url)
        except WorkerUnreachable as exc:
            if worker.info is not None:
                # NOTE: one that deregistered or was draining is gone on purpose (a scale-in, a stop), and
                # so is every worker once this router stops (`up`'s Ctrl-C stops them all at once)
                expected = worker.going
                (logger.info if expected else logger.warning)("%s worker %s left the pool: %s", worker.role,
                                                              worker.url, exc.reason)
            worker.info = None
            return
        if info.role != worker.role:
            logger.error("worker %s is a %s worker, listed as %s", worker.url, info.role, worker.role)
            info = info.model_copy(update={"ready": False})
        if worker.info is not None and info.instance_id != worker.info.instance_id:
            logger.info("%s worker %s restarted (instance %s)", worker.role, worker.url, info.instance_id)
        worker.was_ready = worker.was_ready or info.ready
        if info.ready:
            self._ever_ready.add(worker.role)
        if info.ready and not worker.ready:
            logger.info("%s worker %s is in the pool", worker.role, worker.url)
        elif worker.ready and not info.ready:
            logger.info("%s worker %s left the pool: %s", worker.role, worker.url,
                        "draining" if info.draining else "not ready")
        worker.info = info
