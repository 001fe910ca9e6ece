"""The TTFT phase breakdown of a disaggregated request, carried back to the router on the messages
that already flow:

    router       arrival ──(router queue: reservation on decode, the router's FIFO)──► job sent to prefill
    prefill      job in ──(prefill queue)──► first scheduled ──(prefill compute)──► first token sampled
                 └─ queue and compute durations ride in the final KV message's `extra` (`pack_done_extra`)
    decode       KVDone received ──(first decode step)──► first token emitted
                 └─ all three ride in the request's first output frame (`OutputFrame.phases`)
    router       transfer = TTFT − the four phases above: the part of the KV hand-off not hidden
                 behind compute, plus the control-plane hops

Only durations travel, each measured on one host's monotonic clock: workers' clocks never need to agree.

Also here: `TransferMeter`, the decode side's per-transfer duration and byte count.
"""

from __future__ import annotations

import contextvars
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.disagg.control import OutputFrame, PhaseDurations
from pdserve.disagg.kv_layout import KVLayout
from pdserve.disagg.transport.messages import KVDone, KVProgress
from pdserve.engine.output import RequestMetrics

# NOTE: `extra` was the bare generator state before; the magic tells the two apart, so a worker
# without phases (older, or none measured) still interoperates.
_MAGIC = b"PDP1"
_PHASES = struct.Struct("<dd")  # prefill queue s, prefill compute s


def pack_done_extra(generator_state: bytes | None, metrics: RequestMetrics | None) -> bytes:
    """Prefill: the final KV message's `extra` = phases (when measured) + the seeded generator's state."""
    state = generator_state or b""
    if metrics is None or metrics.first_scheduled_time is None or metrics.first_token_time is None:
        return state
    queue_s = metrics.first_scheduled_time - metrics.arrival_time
    compute_s = metrics.first_token_time - metrics.first_scheduled_time
    return _MAGIC + _PHASES.pack(queue_s, compute_s) + state


def unpack_done_extra(extra: bytes) -> tuple[bytes | None, tuple[float, float] | None]:
    """Decode: (generator state or None, (prefill queue s, prefill compute s) or None)."""
    if not extra.startswith(_MAGIC):
        return extra or None, None
    queue_s, compute_s = _PHASES.unpack_from(extra, len(_MAGIC))
    return extra[len(_MAGIC) + _PHASES.size:] or None, (queue_s, compute_s)


def generator_state_of(extra: bytes) -> bytes | None:
    return unpack_done_extra(extra)[0]


@dataclass(frozen=True, slots=True)
class TransferRecord:
    """One finished hand-off, as the decode worker saw it."""

    duration_s: float  # first payload received -> KVDone (0 when every block was a prefix hit)
    num_bytes: int


@dataclass(slots=True)
class _Transfer:
    first_payload_time: float | None = None
    num_bytes: int = 0
    done_time: float | None = None
    prefill: tuple[float, float] | None = None  # (queue s, compute s) from prefill's final message


@dataclass(slots=True)
class TransferMeter:
    """Decode role: watches each request's KV events; each finished transfer goes to `listener` (the
    metrics, when installed), the phases to the request's first output frame (`annotate`).
    Event-loop only (DecodeService's watcher and stream)."""

    layout: KVLayout
    listener: Callable[[TransferRecord], None] | None = None
    _transfers: dict[str, _Transfer] = field(default_factory=dict)

    def on_event(self, rid: str, event: object) -> None:
        now = time.monotonic()
        transfer = self._transfers.setdefault(rid, _Transfer())
        if isinstance(event, KVProgress):
            if transfer.first_payload_time is None:
                transfer.first_payload_time = now
            transfer.num_bytes += len(event.block_ids) * self.layout.block_bytes_per_layer
        elif isinstance(event, KVDone):
            transfer.done_time = now
            transfer.prefill = unpack_done_extra(event.extra)[1]
            start = transfer.first_payload_time if transfer.first_payload_time is not None else now
            if self.listener is not None:
                self.listener(TransferRecord(now - start, transfer.num_bytes))

    def annotate(self, rid: str, frame: OutputFrame) -> OutputFrame:
        """Attach the phases to the first frame that carries tokens (once): the first decode step
        ends now, as the first token leaves this worker."""
        transfer = self._transfers.get(rid)
        if transfer is None or transfer.done_time is None or transfer.prefill is None or not frame.token_ids:
            return frame
        queue_s, compute_s = transfer.prefill
        frame.phases = PhaseDurations(prefill_queue_s=queue_s, prefill_compute_s=compute_s,
                                      first_decode_step_s=time.monotonic() - transfer.done_time)
        transfer.prefill = None
        return frame

    def forget(self, rid: str) -> None:
        self._transfers.pop(rid, None)


@dataclass(slots=True)
class RequestTrace:
    """Router: what it learns about one request besides its outputs. Bound to the task serving the
    request (`start_trace`), so PDClient marks it without a handle passed down."""

    arrival_time: float
    left_router_time: float | None = None  # reserved on decode, the job about to go to prefill
    phases: PhaseDurations | None = None

    def mark_left_router(self) -> None:
        """The job went to a prefill worker (or onto the shared queue, or decode prefills it).
        The first time counts: a later attempt (retry, resume) does not move it."""
        if self.left_router_time is None:
            self.left_router_time = time.monotonic()

    def record(self, phases: PhaseDurations) -> None:
        self.phases = phases


_trace: contextvars.ContextVar[RequestTrace | None] = contextvars.ContextVar("pdserve_trace", default=None)


def start_trace() -> RequestTrace:
    trace = RequestTrace(time.monotonic())
    _trace.set(trace)
    return trace


def current_trace() -> RequestTrace:
    """The trace bound to this task, or a throwaway one (PDClient used without metrics)."""
    return _trace.get() or RequestTrace(time.monotonic())
