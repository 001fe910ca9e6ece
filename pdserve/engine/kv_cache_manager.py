"""Which blocks each request holds, prefix-cache lookups, and the CPU swap area. Ids only."""

from __future__ import annotations

import hashlib
import time
from array import array
from collections import deque
from collections.abc import Callable, Sequence

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.kv_events import lora_int_id
from pdserve.engine.lora_manager import lora_name_of
from pdserve.engine.request import Request


def hash_block(parent: bytes, token_ids: list[int]) -> bytes:
    """Chained block hash: equal iff the whole prefix up to and including this block is equal.
    A cryptographic digest, so it is stable across processes and collisions are not a concern."""
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


def prompt_prefix_digests(root: bytes, token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The chained digests of a prompt's blocks a prefix cache could serve: every full block but
    one holding the prompt's last token (always computed: `find_cached_prefix`), from `root` (b"":
    the base model; a LoRA adapter's: lora_manager.py `hash_root`)."""
    parent, digests = root, []
    for start in range(0, (len(token_ids) - 1) // block_size * block_size, block_size):
        parent = hash_block(parent, list(token_ids[start:start + block_size]))
        digests.append(parent)
    return digests


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """`clock` times the quarantine (`free_after`); tests pass a fake one instead of sleeping."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool, num_swap_blocks: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.block_size = block_size
        self._clock = clock
        self.pool = BlockPool(num_blocks, enable_caching)
        self.swap = SwapSpace(num_swap_blocks)
        self.num_prefix_queries = 0  # prompt tokens looked up
        self.num_prefix_hits = 0  # of which found cached
        # (when, blocks): blocks held back from reuse until `when` (on `clock`); see free_after
        self._quarantine: deque[tuple[float, list[int]]] = deque()
        # (block, hash) of blocks indexed since the last take_newly_cached; collected only when a
        # disk tier wants them (None: not collected)
        self.newly_cached: list[tuple[int, bytes]] | None = None

    def update_block_hashes(self, request: Request, num_tokens: int) -> None:
        """Extend `request.block_hashes` to cover every full block within its first `num_tokens`."""
        bs = self.block_size
        for index in range(len(request.block_hashes), num_tokens // bs):
            parent = request.block_hashes[-1] if request.block_hashes else request.hash_root
            request.block_hashes.append(hash_block(parent, request.all_token_ids[index * bs:(index + 1) * bs]))

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Leading blocks of `request` already in the pool. At least one token is always left to
        compute, because the step that computes it is the one that samples. None for a request
        that wants its prompt's logprobs: every prompt token's logits must be computed."""
        if not self.pool.enable_caching or request.params.prompt_logprobs is not None:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        self.update_block_hashes(request, max_blocks * self.block_size)
        hits: list[int] = []
        for digest in request.block_hashes[:max_blocks]:
            block = self.pool.lookup(digest)
            if block is None:
                break
            hits.append(block)
        return hits

    def record_prefix_query(self, num_queried: int, num_hit: int) -> None:
        self.num_prefix_queries += num_queried
        self.num_prefix_hits += num_hit

    def num_blocks_needed(self, request: Request, num_new_tokens: int, num_hit_blocks: int = 0) -> int:
        held = len(request.block_ids) + num_hit_blocks
        return max(0, cdiv(request.num_computed_tokens + num_new_tokens, self.block_size) - held)

    def allocate(self, request: Request, num_new_tokens: int, hit_blocks: Sequence[int] = ()) -> bool:
        """Give `request` room for `num_new_tokens` more tokens (after taking `hit_blocks`).
        Returns False, changing nothing, when the pool cannot."""
        needed = self.num_blocks_needed(request, num_new_tokens, len(hit_blocks))
        # Reviving a free cached hit block uses up a free block too.
        revived = sum(1 for b in hit_blocks if self.pool.ref_counts[b] == 0)
        if needed + revived > self.pool.num_free_blocks:
            return False
        self.pool.touch(list(hit_blocks))
        request.block_ids.extend(hit_blocks)
        request.block_ids.extend(self.pool.allocate(needed))
        return True

    def cache_computed_blocks(self, request: Request) -> None:
        """Index the full blocks whose KV is now computed, so later requests can share them."""
        if not self.pool.enable_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        if num_full <= request.num_indexed_blocks:
            return  # NOTE: every step of every running request comes here: O(new full blocks), not O(context)
        self.update_block_hashes(request, num_full * self.block_size)
        events = self.pool.events
        indexed: list[int] = []  # with events on: the blocks this call indexed
        for index in range(request.num_indexed_blocks, num_full):
            block, digest = request.block_ids[index], request.block_hashes[index]
            if self.pool.cache_block(block, digest):
                if self.newly_cached is not None:
                    self.newly_cached.append((block, digest))
                if events is not None:
                    indexed.append(index)
        if indexed and events is not None:
            events.stored(request.block_hashes, request.all_token_ids, indexed, lora_name_of(request),
                          lora_int_id(request.hash_root))
        request.num_indexed_blocks = num_full

    def take_newly_cached(self) -> list[tuple[int, bytes]]:
        if self.newly_cached is None:
            return []
        taken, self.newly_cached = self.newly_cached, []
        return taken

    def free(self, request: Request) -> None:
        self.pool.free(request.block_ids[::-1])
        request.block_ids = []
        request.num_indexed_blocks = 0

    def free_after(self, request: Request, delay_s: float) -> None:
        """Free `request`'s blocks, but keep them from reuse (still counted as used) for `delay_s`:
        for blocks a peer may still write into after the request let go of them (a KV transfer
        by one-sided RDMA that was cancelled). Callers pass the same delay every time, so the
        quarantine stays in release order."""
        if delay_s <= 0:
            self.free(request)
            return
        self._quarantine.append((self._clock() + delay_s, request.block_ids[::-1]))
        request.block_ids = []
        request.num_indexed_blocks = 0

    @property
    def num_quarantined_blocks(self) -> int:
        return sum(len(blocks) for _, blocks in self._quarantine)

    def release_quarantined(self) -> float | None:
        """Free every block whose quarantine is over; seconds until the next one ends, or None."""
        now = self._clock()
        while self._quarantine and self._quarantine[0][0] <= now:
            self.pool.free(self._quarantine.popleft()[1])
        return self._quarantine[0][0] - now if self._quarantine else None

    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move `request`'s blocks to CPU swap blocks. Returns (device block, swap block) pairs to
        copy before the device blocks are reused, or None if the swap area is too small."""
        if not self.swap.can_allocate(len(request.block_ids)):
            return None
        swap_blocks = self.swap.allocate(len(request.block_ids))
        mapping = list(zip(request.block_ids, swap_blocks, strict=True))
        self.free(request)
        request.swapped_block_ids = swap_blocks
        return mapping

    def swap_in(self, request: Request) -> list[tuple[int, int]] | None:
        """Bring a swapped request back: (swap block, device block) pairs to copy, or None."""
        count = len(request.swapped_block_ids)
        if count > self.pool.num_free_blocks:
            return None
        device_blocks = self.pool.allocate(count)
        mapping = list(zip(request.swapped_block_ids, device_blocks, strict=True))
        self.swap.free(request.swapped_block_ids)
        request.swapped_block_ids = []
        request.block_ids = device_blocks
        request.num_indexed_blocks = 0  # NOTE: new device blocks: offered to the cache again
        return mapping

    def drop_swapped(self, request: Request) -> None:
        self.swap.free(request.swapped_block_ids)
        request.swapped_block_ids = []

    @property
    def usage(self) -> float:
        return self.pool.num_used_blocks / max(1, self.pool.num_blocks)


class SwapSpace:
    """Free list of CPU swap blocks (`swap_space` GiB worth)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def can_allocate(self, count: int) -> bool:
        return count <= len(self._free)

    def allocate(self, count: int) -> list[int]:
        return [self._free.pop() for _ in range(count)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(blocks)
