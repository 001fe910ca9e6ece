"""The TTFT phase breakdown of a disaggregated request, carried back to the router on the messages
that already flow:

    router       arrival ──(router queue: reservation on decode, the router's FIFO)──► job sent to prefill
    prefill      job in ──(prefill queue)──► first scheduled ──(prefill compute)──► first token sampled
                 └─ queue and compute durations ride in the hand-off record (HandOffDone.prefill_phases)
    decode       KVDone received ──(first decode step)──► first token emitted
                 └─ all three ride in the request's first output frame (`OutputFrame.phases`)
    router       transfer = TTFT − the four phases above: the part of the KV hand-off not hidden
                 behind compute, plus the control-plane hops

A first token prefill sends the router itself (router/outputs.py) carries prefill's two phases
(`FirstToken`); its first decode step is 0, and its transfer the way of that message back.

Only durations travel, each measured on one host's monotonic clock: workers' clocks never need to agree.

Also here: `TransferMeter`, the decode side's per-transfer duration and byte count.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.disagg.control import OutputFrame
from pdserve.disagg.kv_layout import KVLayout
from pdserve.disagg.transport.messages import KVProgress
from pdserve.engine.output import RequestMetrics
from pdserve.serving.trace import TransferRecord, TTFTPhases


@dataclass(frozen=True, slots=True)
class PrefillPhases:
    """Prefill: how long a prompt waited to be scheduled, then took until its first token."""

    queue_s: float
    compute_s: float

    @classmethod
    def of(cls, metrics: RequestMetrics | None) -> PrefillPhases | None:
        """None when not measured."""
        if metrics is None or metrics.first_scheduled_time is None or metrics.first_token_time is None:
            return None
        return cls(metrics.first_scheduled_time - metrics.arrival_time,
                   metrics.first_token_time - metrics.first_scheduled_time)


@dataclass(slots=True)
class _Transfer:
    first_payload_time: float | None = None
    num_bytes: int = 0
    done_time: float | None = None
    prefill: PrefillPhases | None = None  # from prefill's final message


@dataclass(slots=True)
class TransferMeter:
    """Decode role: watches each request's KV events; each finished transfer goes to `listener` (the
    worker's metrics), the phases to the request's first output frame (`annotate`).
    Event-loop only (DecodeService's watcher and stream)."""

    layout: KVLayout
    listener: Callable[[TransferRecord], None] | None = None
    _transfers: dict[str, _Transfer] = field(default_factory=dict)

    def on_event(self, rid: str, event: object) -> None:
        """A KV event of the request's transfer (KVProgress counts; the others end nothing here)."""
        now = time.monotonic()
        transfer = self._transfers.setdefault(rid, _Transfer())
        if isinstance(event, KVProgress):
            if transfer.first_payload_time is None:
                transfer.first_payload_time = now
            transfer.num_bytes += len(event.block_ids) * self.layout.block_bytes_per_layer

    def on_done(self, rid: str, prefill: PrefillPhases | None) -> None:
        """The transfer's KVDone arrived, with the phases prefill sent in its hand-off record."""
        now = time.monotonic()
        transfer = self._transfers.setdefault(rid, _Transfer())
        transfer.done_time = now
        transfer.prefill = prefill
        start = transfer.first_payload_time if transfer.first_payload_time is not None else now
        if self.listener is not None:
            self.listener(TransferRecord(now - start, transfer.num_bytes))

    def annotate(self, rid: str, frame: OutputFrame) -> OutputFrame:
        """Attach the phases to the first frame that carries tokens (once): the first decode step
        ends now, as the first token leaves this worker."""
        transfer = self._transfers.get(rid)
        if transfer is None or transfer.done_time is None or transfer.prefill is None or not frame.token_ids:
            return frame
        frame.phases = TTFTPhases(transfer.prefill.queue_s, transfer.prefill.compute_s,
                                  first_decode_step_s=time.monotonic() - transfer.done_time)
        transfer.prefill = None
        return frame

    def forget(self, rid: str) -> None:
        self._transfers.pop(rid, None)
