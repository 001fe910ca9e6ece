"""What a server learns about one request besides its outputs, for its metrics.

`RequestTrace`: the TTFT phases of a disaggregated request (the router binds one to the task that
serves a request; the PD client marks it without a handle passed down). `TransferRecord`: one KV
hand-off as a decode worker saw it. Both are plain records: serving/metrics.py turns them into
Prometheus series and needs nothing from `disagg/`, which fills them in.
"""

from __future__ import annotations

import contextvars
import time
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TTFTPhases:
    """The phases the workers measured (each on its own monotonic clock: only durations travel)."""

    prefill_queue_s: float
    prefill_compute_s: float
    first_decode_step_s: float


@dataclass(frozen=True, slots=True)
class TransferRecord:
    """One finished hand-off, as the decode worker saw it."""

    duration_s: float  # first payload received -> KVDone (0 when every block was a prefix hit)
    num_bytes: int


@dataclass(slots=True)
class RequestTrace:
    """Router: when the request's job left the router, and the phases the workers reported."""

    arrival_time: float
    left_router_time: float | None = None  # reserved on decode, the job about to go to prefill
    phases: TTFTPhases | None = None

    def mark_left_router(self) -> None:
        """The job went to a prefill worker (or onto the shared queue, or decode prefills it).
        The first time counts: a later attempt (retry, resume) does not move it."""
        if self.left_router_time is None:
            self.left_router_time = time.monotonic()

    def record(self, phases: TTFTPhases) -> None:
        self.phases = phases


_trace: contextvars.ContextVar[RequestTrace | None] = contextvars.ContextVar("pdserve_trace", default=None)


def start_trace() -> RequestTrace:
    trace = RequestTrace(time.monotonic())
    _trace.set(trace)
    return trace


def current_trace() -> RequestTrace:
    """The trace bound to this task, or a throwaway one (the PD client used without metrics)."""
    return _trace.get() or RequestTrace(time.monotonic())
