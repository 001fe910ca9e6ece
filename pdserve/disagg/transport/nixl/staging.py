"""Decode side of nixl: where the WRITEs of payloads in another element type land before they are
cast into the pool (a prefill worker whose `--kv-cache-dtype` differs from decode's).

RDMA cannot convert: the bytes must land somewhere shaped like the sender's pool. `Staging` is one
buffer next to the pool, allocated on the first converting peer's handshake and split into one
range per grant. Like the pool (grants.py), it is never registered whole: each grant
registers its own range, its GRANT carries that registration's metadata, and the range is
deregistered when it frees:

    claim (dtype bfloat16, n blocks)  -> range of n * sender's block bytes, registered, granted as
                                         its regions {addrs, the range's metadata}
    WRITTEN                           -> cast range -> pool blocks (`KVReceiver._copy_into_pool`),
                                         range deregistered and free again
    cancel before WRITTEN             -> range held `hold_s` (a granted WRITE may still land), then
                                         deregistered and free

Size: one layer of the whole pool in float32, so any admissible payload (at most one layer of the
pool, in a type of at most 4 bytes) fits; a claim that does not fit now waits (`waiting`) until a
range frees, which takes one WRITE and one cast. NOTE: the sender never writes on a grant that
comes more than `GRANT_MAX_AGE_S` (2 s) after its claim (nixl.py, Late writes), so a burst of
claims larger than the staging, on a decode worker whose casts are slow, can fail its last layers'
hand-off (then: retry, failure policy). I/O thread only, like every NIXL call.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pdserve.disagg.kv_layout import KVLayout
from pdserve.disagg.transport.messages import Claim, LayerHeader
from pdserve.disagg.transport.nixl.agent import Registration, memory_kind, register

GrantKey = tuple[str, int]  # (peer agent, claim id)
_MAX_ELEMENT_BYTES = 4  # float32: the widest type a receiver converts from


@dataclass(frozen=True, slots=True)
class StagedGrant:
    """Where a converted payload lands: its regions' addresses (payload order), their size, and
    the metadata of the range's registration (what the peer loads to write there)."""

    addrs: np.ndarray
    region_bytes: int
    metadata: bytes
    device_id: int


class Staging:
    def __init__(self, kv_cache: torch.Tensor, layout: KVLayout, agent: Any) -> None:
        elements_per_layer = kv_cache.shape[2] * layout.block_bytes_per_layer // layout.element_bytes
        self.num_bytes = elements_per_layer * _MAX_ELEMENT_BYTES
        self.device = kv_cache.device
        self.buffer: torch.Tensor | None = None
        self.waiting: deque[tuple[str, Claim]] = deque()  # claims granted once a range frees
        self._agent = agent
        self._kind = memory_kind(kv_cache)
        # granted or held: key -> (offset, bytes, the range's registration)
        self._ranges: dict[GrantKey, tuple[int, int, Registration]] = {}
        self._held: dict[GrantKey, float] = {}  # cancelled grants' ranges -> when they free (monotonic)

    @property
    def num_bytes_in_use(self) -> int:
        return sum(size for _, size, _ in self._ranges.values())

    @property
    def num_registrations(self) -> int:
        return len(self._ranges)

    def allocate(self) -> None:
        """The buffer, once (nothing of it is registered until a grant)."""
        if self.buffer is None:
            self.buffer = torch.empty(self.num_bytes, dtype=torch.uint8, device=self.device)

    def grant(self, key: GrantKey, header: LayerHeader) -> StagedGrant | None:
        """A range for this payload, registered; None when no range is free now. The buffer must
        be allocated."""
        offset = self._free_offset(header.num_bytes)
        if offset is None or self.buffer is None:
            return None
        base = self.buffer.data_ptr() + offset
        registration = register(self._agent, np.array([base]), np.array([header.num_bytes]), self._kind)
        self._ranges[key] = (offset, header.num_bytes, registration)
        num_regions = 2 * len(header.dst_block_ids)
        region_bytes = header.num_bytes // num_regions
        addrs = base + np.arange(num_regions, dtype=np.int64) * region_bytes
        return StagedGrant(addrs, region_bytes, registration.metadata, registration.device_id)

    def payload(self, key: GrantKey) -> torch.Tensor:
        """The bytes that landed for this grant (uint8, on the pool's device)."""
        assert self.buffer is not None
        offset, size, _ = self._ranges[key]
        return self.buffer[offset:offset + size]

    def release(self, key: GrantKey) -> bool:
        """Deregister and free the grant's range; True if it had one."""
        taken = self._ranges.pop(key, None)
        if taken is not None:
            self._agent.deregister_memory(taken[2].descs)
        return taken is not None

    def hold(self, key: GrantKey, hold_s: float) -> None:
        """A cancelled grant: its range stays taken `hold_s` (a WRITE granted earlier may land)."""
        if key in self._ranges:
            self._held[key] = time.monotonic() + hold_s

    def expire(self) -> bool:
        """Free held ranges whose time is up; True if any was."""
        now = time.monotonic()
        due = [key for key, until in self._held.items() if until <= now]
        for key in due:
            del self._held[key]
            self.release(key)
        return bool(due)

    def close(self) -> None:
        for key in list(self._ranges):
            self.release(key)
        self._held.clear()

    def _free_offset(self, size: int) -> int | None:
        """First fit over the taken ranges, in address order."""
        at = 0
        for offset, taken, _ in sorted(self._ranges.values(), key=lambda r: r[0]):
            if offset - at >= size:
                return at
            at = max(at, offset + taken)
        return at if self.num_bytes - at >= size else None
