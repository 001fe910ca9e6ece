"""A gateway request's prefill on the worker its endpoint picker named (worker/gateway.py), and what
happens when that worker does not do it.

    decode (gateway)                                     prefill worker (header x-prefiller-host-port)
      reserve here ── job (placed, signed) ─ POST /pd/prefill ──▶  computes, streams the KV into the
                                                                    reservation, keepalives to decode
      stream frames ◀─────────── KV over tcp / nixl ──────────────
      no answer, refused, failed, or a stalled transfer (decode's own transfer deadline: a `kv_retry`
      frame): `fall_back` prefills here instead (DecodeService.prefill_here), the attempt is aborted
      there, best effort

Every fallback is counted by reason (`PrefillPeers`, pdserve:gateway_prefill_fallbacks_total; the
gateway adds `not_allowed`, a worker outside --gateway-prefill-allow, never contacted) and logged
once per peer until that peer takes a job again, so a dead prefill worker the picker keeps naming
does not log a line per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from pdserve.disagg.client import WorkerClient, WorkerError, WorkerRefused, WorkerUnreachable
from pdserve.disagg.control import HandOff, PrefillJob
from pdserve.disagg.worker.decode_service import DecodeService
from pdserve.serving.metrics import OneSample

logger = logging.getLogger(__name__)

FallbackReason = Literal["unreachable", "refused", "timeout", "failed", "not_allowed"]
FALLBACK_REASONS: tuple[FallbackReason, ...] = ("unreachable", "refused", "timeout", "failed", "not_allowed")
_ABORT_TIMEOUT_S = 2.0


@dataclass(slots=True)
class PrefillPeers:
    """What a gateway counts of the prefill workers headers named: jobs sent, prompts prefilled here
    (no header), fallbacks by reason; and which peers failed since they last took a job (logged once)."""

    directed: int = 0
    local: int = 0
    fallbacks: dict[FallbackReason, int] = field(default_factory=lambda: dict.fromkeys(FALLBACK_REASONS, 0))
    failing: set[str] = field(default_factory=set)  # prefill URLs whose last job fell back

    def fell_back(self, url: str, reason: FallbackReason, detail: str) -> None:
        self.fallbacks[reason] += 1
        if url in self.failing:
            logger.debug("prefill worker %s: %s (%s); prefilled here", url, reason, detail)
            return
        self.failing.add(url)
        logger.warning("prefill worker %s named by x-prefiller-host-port: %s (%s); prefilling here instead "
                       "(logged once until it takes a job again)", url, reason, detail)

    def took_job(self, url: str) -> None:
        if url in self.failing:
            self.failing.discard(url)
            logger.info("prefill worker %s takes jobs again", url)


class PeersCollector(Collector):
    """Scrape-time series of `PrefillPeers` on the decode worker's /metrics."""

    def __init__(self, labels: dict[str, str], peers: PrefillPeers) -> None:
        self.labels, self.peers = labels, peers

    def collect(self) -> Iterator[CounterMetricFamily]:
        counter = OneSample(self.labels).counter
        yield counter("pdserve:gateway_directed_prefills", "Gateway requests whose prefill job went to the worker "
                      "their x-prefiller-host-port header named", self.peers.directed)
        yield counter("pdserve:gateway_local_prefills", "Gateway requests without x-prefiller-host-port, "
                      "prefilled on this decode worker", self.peers.local)
        fallbacks = CounterMetricFamily("pdserve:gateway_prefill_fallbacks", "Gateway requests prefilled here "
                                        "after the named prefill worker did not do it, by reason",
                                        labels=[*self.labels, "reason"])
        for reason, count in self.peers.fallbacks.items():
            fallbacks.add_metric([*self.labels.values(), reason], count)
        yield fallbacks


@dataclass(frozen=True, slots=True)
class DirectedSetup:
    """What every directed prefill of one gateway shares."""

    service: DecodeService
    client: WorkerClient  # signs its calls with the cluster secret
    peers: PrefillPeers
    accept_timeout_s: float  # the named worker must take the job within this (--gateway-prefill-timeout-s)


@dataclass(slots=True)
class DirectedPrefill:
    """One request's job on the prefill worker at `url` (module docstring). `start` sends it; the
    request's stream calls `fall_back` on a stalled transfer; `close` ends whatever is still running."""

    setup: DirectedSetup
    url: str
    job: PrefillJob
    task: asyncio.Task[None] | None = None
    ended: bool = False  # fallen back, or the request ended: nothing more to do for it

    def start(self) -> None:
        self.setup.peers.directed += 1
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        accepted = asyncio.Event()
        call = asyncio.create_task(self.setup.client.prefill(self.url, self.job, on_accepted=accepted.set))
        taken = asyncio.create_task(accepted.wait())
        try:
            await asyncio.wait((call, taken), timeout=self.setup.accept_timeout_s,
                               return_when=asyncio.FIRST_COMPLETED)
            if not call.done() and not accepted.is_set():
                call.cancel()
                await self.fall_back("timeout", f"did not take the job within {self.setup.accept_timeout_s:g} s")
                return
            await self._outcome(call)
        finally:
            taken.cancel()
            if not call.done():
                call.cancel()

    async def _outcome(self, call: asyncio.Task[HandOff | None]) -> None:
        try:
            hand_off = await call
        except WorkerUnreachable as exc:
            await self.fall_back("unreachable", exc.reason)
            return
        except WorkerRefused as exc:
            await self.fall_back("refused", f"HTTP {exc.status}: {exc.message}")
            return
        if hand_off is None:
            await self.fall_back("refused", "draining")
            return
        if hand_off.status == "handed_off":
            self.setup.peers.took_job(self.url)
        else:  # NOTE: counted only if the request still waits for its KV (not one that ended meanwhile)
            await self.fall_back("failed", f"hand-off {hand_off.status}: {hand_off.reason}")

    async def fall_back(self, reason: FallbackReason, detail: str) -> None:
        """Prefill here what the named worker did not (counted and logged if the request still
        waited for its KV); the attempt there is aborted, in the background."""
        if self.ended:
            return
        self.ended = True
        if self.task is not None and self.task is not asyncio.current_task():
            self.task.cancel()
        if await self.setup.service.prefill_here(self.job.request_id):
            self.setup.peers.fell_back(self.url, reason, detail)
        self._abort_there()

    async def close(self, abort: bool) -> None:
        """The request ended: stop waiting on the prefill worker; with `abort` (it ended early: client
        gone, an error), an attempt still running there is aborted."""
        task, running = self.task, self.task is not None and not self.task.done()
        self.ended = True
        if task is not None and running:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            if abort:
                self._abort_there()

    def _abort_there(self) -> None:
        client, url, tid = self.setup.client, self.url, self.job.transfer_id

        async def abort() -> None:
            with contextlib.suppress(WorkerError, TimeoutError):
                await asyncio.wait_for(client.abort(url, tid), _ABORT_TIMEOUT_S)

        _background(abort())


_TASKS: set[asyncio.Task[None]] = set()  # NOTE: the loop keeps only a weak reference to a task


def _background(work: Coroutine[Any, Any, None]) -> None:
    task = asyncio.create_task(work)
    _TASKS.add(task)
    task.add_done_callback(_TASKS.discard)
