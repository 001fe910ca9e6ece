"""All-reduce and all-gather for tensor-parallel ranks on one host (CPU), through a shared-memory file.

gloo moves a CPU all-reduce over loopback TCP: on the 2-core VM one of a 16 x 1024 float32 tensor
between two ranks took ~1.9 ms, against a send/recv round trip of ~0.26 ms. A decode step
all-reduces twice per layer, so a 28-layer model spent ~100 ms of each step there. Here every rank
maps the same file and a collective is: write my part into my slot, publish a sequence number,
wait until every rank published it, read the slots (the sum in rank order, so every rank computes
the same bytes).

    file: [flags: one 64-byte line per rank, an int64 sequence number at its start]
          [slots: 2 halves x size ranks x slot_bytes]

Call k (counted from 1, the same order on every rank: collectives are) uses half k % 2. One wait
per call is enough: a rank that starts call k + 2, overwriting its slot of half k % 2, has seen
every rank publish k + 1, which each did only after it finished reading the slots of call k.

Ordering: the slot's bytes are stored before the flag, and x86's total store order makes them
visible in that order; other CPUs would need a fence Python cannot issue, so `available()` is x86
only, and the rest use gloo. A tensor bigger than a slot (a long prefill chunk, where 2 ms is
noise) goes to gloo too: `fits` decides, the same way on every rank (same shapes).

Waiting: spin briefly (a peer is usually microseconds behind), then nap 50 us at a time, so a
waiting rank does not hold a core its peer needs on a busy machine; every ~20 ms of waiting it
asks `alive()` (rank 0: are the other ranks' processes running; the others: is rank 0) and raises
`PeerGoneError` when not, or after `timeout_s`.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable

import numpy as np
import torch

_LINE = 64  # bytes per rank's flag: its own cache line
_SPINS = 200  # checks before the first nap (~50-100 us of spinning)
_NAP_S = 50e-6
_CHECK_EVERY = 200  # naps between liveness checks (~10-20 ms)


class PeerGoneError(RuntimeError):
    """A rank stopped taking part in collectives (its process exited, or the wait timed out)."""


def available() -> bool:
    """Whether this CPU orders stores the way the protocol needs (x86-64: total store order)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def file_bytes(size: int, slot_bytes: int) -> int:
    return size * _LINE + 2 * size * slot_bytes


class SharedMemoryGroup:
    """This rank's view of the shared collective file (`file_bytes(size, slot_bytes)` bytes, made
    by rank 0, zeroed). Every rank must make the same calls in the same order."""

    def __init__(self, path: str, rank: int, size: int, slot_bytes: int, alive: Callable[[], bool],
                 timeout_s: float) -> None:
        if slot_bytes % _LINE:
            raise ValueError(f"slot_bytes must be a multiple of {_LINE}, got {slot_bytes}")
        self.rank, self.size, self.slot_bytes = rank, size, slot_bytes
        self._alive, self._timeout_s = alive, timeout_s
        self._buffer = torch.from_file(path, shared=True, size=file_bytes(size, slot_bytes), dtype=torch.uint8)
        self._flags = self._buffer[:size * _LINE].numpy().view(np.int64)[::_LINE // 8]
        self._others = [r for r in range(size) if r != rank]
        self._calls = 0
        self._typed: dict[torch.dtype, list[list[torch.Tensor]]] = {}  # [half][rank]: a slot as a flat tensor

    @property
    def calls(self) -> int:
        """Collectives made through this file so far."""
        return self._calls

    def fits(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and tensor.numel() * tensor.element_size() <= self.slot_bytes

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks into `tensor` (in place), in rank order on every rank."""
        half = self._publish(tensor)
        torch.add(self._slot(half, 0, tensor), self._slot(half, 1, tensor), out=tensor)
        for rank in range(2, self.size):
            tensor.add_(self._slot(half, rank, tensor))
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` (same shape on all), concatenated along the last dimension."""
        half = self._publish(tensor)
        return torch.cat([self._slot(half, rank, tensor) for rank in range(self.size)], dim=-1)

    def _publish(self, tensor: torch.Tensor) -> int:
        """Write this rank's part, announce it, wait for every rank's; returns the half used."""
        self._calls += 1
        half = self._calls % 2
        self._slot(half, self.rank, tensor).copy_(tensor)
        self._flags[self.rank] = self._calls  # NOTE: after the bytes (see the module's note on ordering)
        self._wait(self._calls)
        return half

    def _slot(self, half: int, rank: int, like: torch.Tensor) -> torch.Tensor:
        """Rank `rank`'s slot of `half`, shaped like `like`, contiguous. NOTE: speed: flat views per
        dtype are made once, and `as_strided` shapes one in ~3 us (reinterpreting the byte buffer
        took ~17 us, `.view(torch.Size)` ~8 us; a step makes thousands of these)."""
        if (slots := self._typed.get(like.dtype)) is None:
            data = self._buffer[self.size * _LINE:].view(like.dtype).view(2, self.size, -1)
            slots = self._typed[like.dtype] = [[data[h, r] for r in range(self.size)] for h in range(2)]
        shape = tuple(like.shape)
        strides, step = [], 1
        for dim in reversed(shape):
            strides.append(step)
            step *= dim
        return slots[half][rank].as_strided(shape, tuple(reversed(strides)))

    def _wait(self, call: int) -> None:
        flags, others = self._flags, self._others
        spins = naps = 0
        deadline = time.monotonic() + self._timeout_s
        while any(flags[rank] < call for rank in others):
            if spins < _SPINS:
                spins += 1
                continue
            time.sleep(_NAP_S)
            naps += 1
            if naps % _CHECK_EVERY == 0:
                if not self._alive():
                    raise PeerGoneError("a tensor-parallel rank stopped (its process is gone)")
                if time.monotonic() > deadline:
                    raise PeerGoneError(f"a tensor-parallel rank did not reach the collective within "
                                        f"{self._timeout_s:.0f} s")
