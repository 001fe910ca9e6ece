"""Load or recompute: the disk tier's measured cost model.

A prefix on disk is loaded instead of recomputed when reading it is expected to take less time
than computing it:

    load_s(n blocks)    = n * load_s_per_block          (seeded by a cold read of a probe file at
                                                          startup, then an EWMA of real loads)
    compute_s(n blocks) = n * block_size * compute_s_per_token   (an EWMA of this engine's steps
                                                          that computed prefill tokens: step
                                                          time / tokens in the step)

Both sides are per block, so the decision does not depend on n. Until the first prefill step has
been measured the compute side is unknown and a load is taken: reading a block costs one pass over
its bytes, computing it a forward pass over every weight per token, which on every model and
device measured here was orders of magnitude dearer (see docs/BENCHMARKS.md, "KV disk tier").
"""

from __future__ import annotations

import threading

_EWMA_WEIGHT = 0.2  # weight of the newest observation


class LoadCostModel:
    """Thread-safe: the engine thread observes steps and asks; the tier's loader observes loads."""

    def __init__(self, load_s_per_block: float) -> None:
        self._lock = threading.Lock()
        self.load_s_per_block = load_s_per_block
        self.compute_s_per_token: float | None = None

    def observe_load(self, num_blocks: int, duration_s: float) -> None:
        if num_blocks > 0:
            with self._lock:
                self.load_s_per_block = _ewma(self.load_s_per_block, duration_s / num_blocks)

    def observe_compute(self, num_tokens: int, duration_s: float) -> None:
        if num_tokens > 0 and duration_s > 0:
            with self._lock:
                self.compute_s_per_token = _ewma(self.compute_s_per_token, duration_s / num_tokens)

    def prefers_load(self, block_size: int) -> bool:
        """Whether loading a block from disk is expected to beat computing its `block_size` tokens."""
        with self._lock:
            if self.compute_s_per_token is None:
                return True
            return self.load_s_per_block < block_size * self.compute_s_per_token


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else (1 - _EWMA_WEIGHT) * old + _EWMA_WEIGHT * new
