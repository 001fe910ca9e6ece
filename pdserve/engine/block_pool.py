"""The KV block pool: ref counts, free blocks in eviction order, and the prefix-cache index.

Integer bookkeeping only; the tensors live in the model runner, laid out as `POOL_LAYOUT` says.

Free blocks come in two kinds. *Uncached* free blocks hold nothing reusable. *Cached* free blocks
(ref count 0, but their content is still indexed by hash) can be revived by a prefix hit; they are
evicted least-recently-freed first, and only when no uncached block is left.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from pdserve.engine.kv_events import KVEventLog

# kv_cache[layer, k|v, block, slot, kv_head, head_dim]: the model runner's pool, and what the KV
# layout descriptors (the transports' and the disk tier's) name, so a pool laid out otherwise can
# never read these bytes
POOL_LAYOUT = "layer,kv,block,slot,head,dim"


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.hash_to_block: dict[bytes, int] = {}
        self._uncached_free: deque[int] = deque(range(num_blocks))
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # LRU first
        self.num_evictions = 0
        self.events: KVEventLog | None = None  # --kv-events-config: what the index gains and loses (kv_events.py)

    @property
    def num_free_blocks(self) -> int:
        return len(self._uncached_free) + len(self._cached_free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def allocate(self, count: int) -> list[int]:
        """`count` blocks, uncached free ones first, then evicting the least recently freed. They
        are returned in ascending id order: which blocks are taken does not change, but a request
        then holds runs of adjacent blocks wherever the pool has them (freeing is tail first, so
        eviction order alone would hand a recycled run out backwards), and a KV transfer moves an
        adjacent run as one region (one iovec, one NIXL descriptor) instead of one per block."""
        if count > self.num_free_blocks:
            raise RuntimeError(f"No available block: asked for {count}, {self.num_free_blocks} free")
        blocks = []
        for _ in range(count):
            if self._uncached_free:
                block = self._uncached_free.popleft()
            else:
                block, _ = self._cached_free.popitem(last=False)
                self._evict(block)
            self.ref_counts[block] = 1
            blocks.append(block)
        blocks.sort()
        return blocks

    def _evict(self, block: int) -> None:
        digest = self.block_hash[block]
        if digest is not None:
            self.block_hash[block] = None
            if self.hash_to_block.get(digest) == block:
                del self.hash_to_block[digest]
            self.num_evictions += 1
            if self.events is not None:
                self.events.removed(digest)

    def lookup(self, digest: bytes) -> int | None:
        return self.hash_to_block.get(digest) if self.enable_caching else None

    def touch(self, blocks: list[int]) -> None:
        """Take a reference on prefix-hit blocks, reviving them if they were free."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self._cached_free[block]
            self.ref_counts[block] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference on each block. Pass a sequence's blocks tail first so that its tail
        is evicted before its (more shareable) head."""
        for block in blocks:
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} freed twice"
            if self.ref_counts[block] == 0:
                if self.block_hash[block] is not None:
                    self._cached_free[block] = None
                else:
                    self._uncached_free.append(block)

    def cache_block(self, block: int, digest: bytes) -> bool:
        """Index a full, computed block by its chained hash (first writer wins). True when this
        call indexed it."""
        if not self.enable_caching or self.block_hash[block] is not None:
            return False
        if digest in self.hash_to_block:
            return False
        self.hash_to_block[digest] = block
        self.block_hash[block] = digest
        return True

    def reset_prefix_cache(self) -> None:
        """Forget every free cached block (blocks in use stay indexed). Events: each block that left,
        then `AllBlocksCleared` when the index is empty."""
        for block in list(self._cached_free):
            self._evict(block)
            self._uncached_free.append(block)
        self._cached_free.clear()
        if self.events is not None and not self.hash_to_block:
            self.events.cleared()
