"""Decode side of nixl: where the WRITEs of payloads in another element type land before they are
cast into the pool (a prefill worker whose `--kv-cache-dtype` differs from decode's).

RDMA cannot convert: the bytes must land somewhere shaped like the sender's pool. `Staging` is one
buffer next to the pool, registered with decode's NIXL agent on the first converting peer's
handshake (so its keys travel in that WELCOME's agent metadata), and split into one range per
grant:

    claim (dtype bfloat16, n blocks)  -> range of n * sender's block bytes, granted as its regions
    WRITTEN                           -> cast range -> pool blocks (`KVReceiver._copy_into_pool`),
                                         range free again
    cancel before WRITTEN             -> range held `hold_s` (a granted WRITE may still land), then free

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
from typing import Any

import numpy as np
import torch

from pdserve.disagg.kv_layout import KVLayout
from pdserve.disagg.transport.messages import Claim, LayerHeader

GrantKey = tuple[str, int]  # (peer agent, claim id)
_MAX_ELEMENT_BYTES = 4  # float32: the widest type a receiver converts from


class Staging:
    def __init__(self, kv_cache: torch.Tensor, layout: KVLayout) -> None:
        elements_per_layer = kv_cache.shape[2] * layout.block_bytes_per_layer // layout.element_bytes
        self.num_bytes = elements_per_layer * _MAX_ELEMENT_BYTES
        self.device = kv_cache.device
        self.buffer: torch.Tensor | None = None
        self.registration: Any = None
        self.waiting: deque[tuple[str, Claim]] = deque()  # claims granted once a range frees
        self._ranges: dict[GrantKey, tuple[int, int]] = {}  # granted or held: key -> (offset, bytes)
        self._held: dict[GrantKey, float] = {}  # cancelled grants' ranges -> when they free (monotonic)

    @property
    def num_bytes_in_use(self) -> int:
        return sum(size for _, size in self._ranges.values())

    def register(self, agent: Any) -> bool:
        """Allocate and register the buffer once; True when this call did (the agent's metadata changed)."""
        if self.buffer is not None:
            return False
        self.buffer = torch.empty(self.num_bytes, dtype=torch.uint8, device=self.device)
        self.registration = agent.register_memory(self.buffer)
        return True

    def grant(self, key: GrantKey, header: LayerHeader) -> tuple[np.ndarray, int] | None:
        """A range for this payload: its regions' addresses (payload order) and region bytes; None
        when no range is free now. The buffer must be registered."""
        offset = self._free_offset(header.num_bytes)
        if offset is None or self.buffer is None:
            return None
        self._ranges[key] = (offset, header.num_bytes)
        num_regions = 2 * len(header.dst_block_ids)
        region_bytes = header.num_bytes // num_regions
        base = self.buffer.data_ptr() + offset
        return base + np.arange(num_regions, dtype=np.int64) * region_bytes, region_bytes

    def payload(self, key: GrantKey) -> torch.Tensor:
        """The bytes that landed for this grant (uint8, on the pool's device)."""
        assert self.buffer is not None
        offset, size = self._ranges[key]
        return self.buffer[offset:offset + size]

    def release(self, key: GrantKey) -> bool:
        """Free the grant's range; True if it had one."""
        return self._ranges.pop(key, None) is not None

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
            self._ranges.pop(key, None)
        return bool(due)

    def close(self, agent: Any) -> None:
        if self.registration is not None:
            agent.deregister_memory(self.registration)
            self.registration = None

    def _free_offset(self, size: int) -> int | None:
        """First fit over the taken ranges, in address order."""
        at = 0
        for offset, taken in sorted(self._ranges.values()):
            if offset - at >= size:
                return at
            at = max(at, offset + taken)
        return at if self.num_bytes - at >= size else None
