"""A prefill worker's keepalives to the decode workers expecting its attempts (POST /pd/alive).

While it holds jobs, every `transfer_timeout_s / 2` it tells each job's decode worker that the
attempt is still being worked on: a KV transfer's time without progress counts compute gaps out,
which on a CPU can exceed the timeout between two layers of a chunk. Each keepalive says how long
the engine's steps take lately, the running one included (`Keepalive.step_s`, transport/cadence.py's
`StepClock`): decode's deadline is a multiple of it, so a long chunk on a busy machine is not taken
for a dead peer, from the first request on. It stops saying so once a step has run for
`StepClock.stuck_s` (a hung engine); an engine that died ends its attempts, and with them the
keepalives. Decode answers with its own step time (`KeepaliveReply.step_s`), the floor of this
worker's waits on it (`floor_s`). An attempt that will not hand off is reported ended (`report_ended`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from pdserve.disagg.auth import ClusterSecret
from pdserve.disagg.client import WorkerClient, WorkerError
from pdserve.disagg.transport.cadence import STEP_HALF_LIFE_S, Cadence, StepClock, deadline_s
from pdserve.engine.async_llm import EngineClient

REPORT_TIMEOUT_S = 10.0  # telling decode an attempt ended (`report_ended`)


class DecodeKeepalives:
    """Event-loop only. `in_flight()`: whether the worker holds any attempt (keepalives go on while
    it does); `targets()` names, by decode URL, the transfer ids to keep alive now; `computing()`
    says whether a step runs (some attempt's first token is not out yet)."""

    def __init__(self, engine: EngineClient, transfer_timeout_s: float, secret: ClusterSecret | None,
                 progress: tuple[Callable[[], bool], Callable[[], dict[str, list[str]]], Callable[[], bool]]) -> None:
        self.engine = engine
        self.period_s = transfer_timeout_s / 2
        self.in_flight, self.targets, self.computing = progress
        self.steps = StepClock()  # the engine's recent step time, which keepalives announce
        # decode URL -> the step time its answers to keepalives announce (KeepaliveReply), decaying
        self.decode_steps: dict[str, Cadence] = {}
        # NOTE: one client for the worker's life, made here: building an httpx client (its TLS
        # context) blocks the event loop for 50-200 ms, which a client per keepalive task cost the
        # first request after every idle spell (its hand-off, hence its TTFT, waited behind it).
        self.workers = WorkerClient(timeout_s=transfer_timeout_s, secret=secret)
        self._loop: asyncio.Task[None] | None = None
        self._reports: set[asyncio.Task[None]] = set()  # attempts' ends being told to decode

    def start(self) -> None:
        """Keepalives go while `in_flight()`; call when an attempt starts."""
        if self._loop is None or self._loop.done():
            self._loop = asyncio.create_task(self._keep_alive())

    def floor_s(self, floor_s: float, decode_url: str | None = None) -> float:
        """The floor of a wait on decode worker `decode_url` (None: whichever places the job, the
        slowest heard of): `floor_s`, or FACTOR times the step time it announced lately, capped."""
        if decode_url is None:
            announced_s = max((steps.longest_gap_s() for steps in self.decode_steps.values()), default=0.0)
        else:
            steps = self.decode_steps.get(decode_url)
            announced_s = 0.0 if steps is None else steps.longest_gap_s()
        return deadline_s(floor_s, announced_s)

    def report_ended(self, decode_url: str, tid: str) -> None:
        """Attempt `tid` will not hand off: its decode worker stops waiting for it (Keepalive.ended).
        Best effort: else its clocks decide. NOTE: not within the transfer timeout (the keepalives'
        client's, 100 ms by default): a busy decode worker is what timed the hand-off out."""
        async def report() -> None:
            with contextlib.suppress(WorkerError):
                await self.workers.alive(decode_url, [], ended=[tid], timeout_s=REPORT_TIMEOUT_S)

        task = asyncio.create_task(report())
        self._reports.add(task)  # NOTE: the loop keeps only a weak reference to a task
        task.add_done_callback(self._reports.discard)

    def close(self) -> None:
        if self._loop is not None:
            self._loop.cancel()

    async def _keep_alive(self) -> None:
        """POST /pd/alive {transfer ids, the engine's step time} to their decode workers. NOTE: on this
        event loop, not the engine's (a thread or a process of its own): they go on while the engine
        computes a long chunk."""
        while self.in_flight():
            await asyncio.sleep(self.period_s)
            self.steps.sample(self.engine.last_step_s, self.computing())
            if self.steps.stuck:
                continue  # a stuck engine must not keep decode waiting forever
            step_s = self.steps.step_s()
            for url, tids in self.targets().items():
                # NOTE: best effort: a decode worker that does not hear it times the transfer out
                with contextlib.suppress(WorkerError):
                    reply = await self.workers.alive(url, tids, step_s=step_s)
                    if reply.step_s is not None:
                        self.decode_steps.setdefault(url, Cadence(half_life_s=STEP_HALF_LIFE_S)).saw(reply.step_s)
