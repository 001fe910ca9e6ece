"""What a disaggregated worker's service has done, as plain records: `DecodeService.stats()` and
`PrefillService.stats()` return them; worker/metrics.py reads them by attribute at scrape time and
`GET /pd/stats` shows them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar


class Counts:
    """Base of the stats records below (and the queue consumer's): every field but `in_flight` is
    a count since start."""

    __slots__ = ()
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]  # subclasses are dataclasses

    def counters(self) -> dict[str, int]:
        """The counts, by name: the `/pd/stats` body."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "in_flight"}


@dataclass(frozen=True, slots=True)
class DecodeStats(Counts):
    """Counts since start, plus `in_flight` (now)."""

    completed: int = 0  # hand-offs whose KV arrived whole
    timeouts: int = 0  # timeout windows without progress (`KV cache transfer timed out` lines)
    retried: int = 0  # hand-offs waited on once more, as a new prefill attempt, after a timeout
    recomputed: int = 0  # prompts recomputed here after a failed hand-off (policy "recompute")
    failed: int = 0  # requests ended with an error (policy "fail", or a dead-lettered job)
    rejected: int = 0  # hand-offs whose payload the KV receiver refused
    prefilled_locally: int = 0  # short uncached prompts prefilled here (conditional disaggregation)
    lease_expired: int = 0  # reservations ended because no KV (nor keepalive) came within the lease
    kv_dtype_conversions: int = 0  # hand-offs whose KV came in another dtype (or FP8 scales), converted on arrival
    in_flight: int = 0  # requests reserved and not yet finished



@dataclass(frozen=True, slots=True)
class PrefillStats(Counts):
    """Counts since start, plus `in_flight` (now)."""

    handed_off: int = 0  # attempts whose KV decode acknowledged
    failed: int = 0  # attempts whose transfer failed (rejected, timed out, connection lost)
    aborted: int = 0  # attempts cut short (the router or the queue gave up on them)
    duplicates: int = 0  # jobs of an attempt that ran or runs here, delivered again: not run twice
    timed_out: int = 0  # of the failed: decode did not acknowledge in time (`KV cache transfer timed out`)
    in_flight: int = 0  # attempts taken and not yet handed off



ServiceStats = DecodeStats | PrefillStats
