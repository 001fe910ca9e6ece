"""BlockPool and KVCacheManager, integer-only: ref counts, eviction order, prefix lookups, failed
allocations, swap space."""

from __future__ import annotations

import pytest
from helpers import assert_kv_clean, make_request

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.kv_cache_manager import KVCacheManager, hash_block
from pdserve.engine.request import Request


def digest(n: int) -> bytes:
    return hash_block(b"", [n])


def cached_pool(num_blocks: int, num_cached: int) -> tuple[BlockPool, list[int]]:
    """A pool whose first `num_cached` blocks were used, indexed by hash, and freed in order."""
    pool = BlockPool(num_blocks, enable_caching=True)
    blocks = pool.allocate(num_cached)
    for n, block in enumerate(blocks):
        pool.cache_block(block, digest(n))
    pool.free(blocks)
    return pool, blocks


# -- BlockPool -------------------------------------------------------------------------------------
def test_allocate_and_free_ref_counts() -> None:
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.allocate(3)
    assert len(set(blocks)) == 3 and pool.num_free_blocks == 1 and pool.num_used_blocks == 3
    assert [pool.ref_counts[b] for b in blocks] == [1, 1, 1]
    pool.touch(blocks[:1])  # a second holder of the first block
    pool.free(blocks)
    assert pool.ref_counts[blocks[0]] == 1 and pool.num_free_blocks == 3
    pool.free(blocks[:1])
    assert pool.num_free_blocks == 4 and not any(pool.ref_counts)


def test_free_twice_is_caught() -> None:
    pool = BlockPool(2, enable_caching=False)
    block = pool.allocate(1)
    pool.free(block)
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free(block)


def test_allocate_more_than_free_raises_without_side_effects() -> None:
    pool, _ = cached_pool(4, num_cached=2)
    held = pool.allocate(1)  # an uncached block
    before = (list(pool.ref_counts), pool.num_free_blocks, dict(pool.hash_to_block), pool.num_evictions)
    with pytest.raises(RuntimeError, match="No available block"):
        pool.allocate(4)
    assert (list(pool.ref_counts), pool.num_free_blocks, dict(pool.hash_to_block), pool.num_evictions) == before
    pool.free(held)
    assert pool.num_free_blocks == 4


def test_uncached_free_blocks_are_used_before_evicting_cached_ones() -> None:
    pool, cached = cached_pool(6, num_cached=2)
    fresh = pool.allocate(4)
    assert not set(fresh) & set(cached)
    assert pool.num_evictions == 0 and [pool.lookup(digest(n)) for n in range(2)] == cached
    # Only cached blocks are left: the next allocation evicts the least recently freed one.
    assert pool.allocate(1) == [cached[0]]
    assert pool.num_evictions == 1 and pool.lookup(digest(0)) is None and pool.lookup(digest(1)) == cached[1]


def test_cached_blocks_are_evicted_least_recently_freed_first() -> None:
    pool = BlockPool(4, enable_caching=True)
    a, b, c, d = pool.allocate(4)
    for n, block in enumerate((a, b, c, d)):
        pool.cache_block(block, digest(n))
    pool.free([c, a, d, b])  # LRU order: c, a, d, b
    pool.touch([a])  # a prefix hit revives a ...
    pool.free([a])  # ... and freeing it again makes it the most recently freed
    assert [pool.allocate(1)[0] for _ in range(4)] == [c, d, b, a]
    assert pool.num_evictions == 4 and not pool.hash_to_block


def test_first_writer_wins_and_duplicates_stay_uncached() -> None:
    pool = BlockPool(3, enable_caching=True)
    a, b = pool.allocate(2)
    pool.cache_block(a, digest(0))
    pool.cache_block(b, digest(0))  # same content computed twice (e.g. two requests in one step)
    pool.cache_block(a, digest(1))  # a block keeps the hash it was first indexed under
    assert pool.lookup(digest(0)) == a and pool.lookup(digest(1)) is None
    assert pool.block_hash[b] is None
    pool.free([a, b])
    # b holds nothing reusable, so it goes back with the uncached blocks and is reused first.
    assert sorted(pool.allocate(2)) == sorted([b, 2])
    assert pool.lookup(digest(0)) == a


def test_caching_disabled_never_indexes() -> None:
    pool = BlockPool(2, enable_caching=False)
    blocks = pool.allocate(2)
    pool.cache_block(blocks[0], digest(0))
    assert pool.lookup(digest(0)) is None and pool.block_hash[blocks[0]] is None
    pool.free(blocks)
    assert pool.num_free_blocks == 2


def test_reset_prefix_cache_forgets_free_blocks_only() -> None:
    pool, cached = cached_pool(4, num_cached=3)
    pool.touch([cached[2]])  # in use: keeps its hash
    pool.reset_prefix_cache()
    assert pool.lookup(digest(0)) is None and pool.lookup(digest(1)) is None
    assert pool.lookup(digest(2)) == cached[2]
    assert pool.num_free_blocks == 3
    pool.free([cached[2]])
    assert pool.num_free_blocks == 4


# -- KVCacheManager --------------------------------------------------------------------------------
def computed(kv: KVCacheManager, request_id: str, prompt: list[int]) -> Request:
    """A request whose whole prompt was computed and cached."""
    request = make_request(request_id, prompt)
    assert kv.allocate(request, len(prompt))
    request.num_computed_tokens = len(prompt)
    kv.cache_computed_blocks(request)
    return request


def test_prefix_hit_leaves_at_least_one_token_to_compute() -> None:
    kv = KVCacheManager(16, block_size=4, enable_caching=True)
    prompt = list(range(12))
    first = computed(kv, "a", prompt)
    assert kv.find_cached_prefix(make_request("b", prompt)) == first.block_ids[:2]  # not all 3: 12 - 8 = 4 left
    assert kv.find_cached_prefix(make_request("c", prompt + [99])) == first.block_ids[:3]
    assert kv.find_cached_prefix(make_request("d", prompt[:4])) == []  # a single block prompt
    assert kv.find_cached_prefix(make_request("e", prompt[:5])) == first.block_ids[:1]
    kv.free(first)
    assert_kv_clean(kv)


def test_prefix_hash_is_chained() -> None:
    kv = KVCacheManager(16, block_size=4, enable_caching=True)
    first = computed(kv, "a", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    # Same second block, different first block: no hit at all, not even for the second block.
    assert kv.find_cached_prefix(make_request("b", [9, 2, 3, 4, 5, 6, 7, 8, 0])) == []
    assert kv.find_cached_prefix(make_request("c", [1, 2, 3, 4, 9, 6, 7, 8, 0])) == first.block_ids[:1]
    kv.free(first)
    assert_kv_clean(kv)


def test_allocate_shares_hit_blocks_and_fails_without_side_effects() -> None:
    kv = KVCacheManager(6, block_size=4, enable_caching=True)
    prompt = list(range(16))
    first = computed(kv, "a", prompt)  # 4 blocks, all cached
    first_blocks = list(first.block_ids)
    kv.free(first)  # now cached free blocks
    second = make_request("b", prompt + list(range(100, 106)))  # 22 tokens: 6 blocks, 4 of them hits
    hits = kv.find_cached_prefix(second)
    assert hits == first_blocks
    second.num_computed_tokens = 16
    # 2 new blocks + 4 revived = 6 free blocks: fits exactly. Ask for one token more than fits first.
    blocker = make_request("blocker", 4)
    assert kv.allocate(blocker, 4)
    before = (list(kv.pool.ref_counts), kv.pool.num_free_blocks, list(second.block_ids))
    assert not kv.allocate(second, 6, hits)
    assert (list(kv.pool.ref_counts), kv.pool.num_free_blocks, list(second.block_ids)) == before
    kv.free(blocker)
    assert kv.allocate(second, 6, hits)
    assert second.block_ids[:4] == hits and kv.pool.num_free_blocks == 0
    assert all(kv.pool.ref_counts[b] == 1 for b in second.block_ids)
    kv.free(second)
    assert_kv_clean(kv)


def test_shared_blocks_are_freed_when_the_last_holder_leaves() -> None:
    kv = KVCacheManager(8, block_size=4, enable_caching=True)
    prompt = list(range(9))
    first = computed(kv, "a", prompt)
    second = make_request("b", prompt)
    hits = kv.find_cached_prefix(second)
    second.num_computed_tokens = len(hits) * 4
    assert kv.allocate(second, 1, hits)
    assert [kv.pool.ref_counts[b] for b in hits] == [2, 2]
    kv.free(first)
    assert [kv.pool.ref_counts[b] for b in hits] == [1, 1] and kv.pool.num_free_blocks == 8 - 3
    kv.free(second)
    assert_kv_clean(kv)


def test_request_blocks_are_freed_tail_first() -> None:
    """The tail of a sequence is less shareable than its head, so it is evicted first."""
    kv = KVCacheManager(3, block_size=2, enable_caching=True)
    request = computed(kv, "a", [1, 2, 3, 4, 5, 6])
    head, middle, tail = request.block_ids
    kv.free(request)
    assert [kv.pool.allocate(1)[0] for _ in range(3)] == [tail, middle, head]


def test_one_allocation_is_in_ascending_order() -> None:
    """Which blocks are taken follows eviction order; the order handed out is ascending, so a
    recycled run of adjacent blocks stays a run (one region for the KV transfer)."""
    kv = KVCacheManager(6, block_size=2, enable_caching=True)
    request = computed(kv, "a", list(range(1, 13)))  # all 6 blocks, cached
    held = list(request.block_ids)
    kv.free(request)  # tail first: the cached-free LRU order is descending
    assert kv.pool.allocate(6) == sorted(held) == list(range(6))


def test_swap_out_and_in_move_blocks() -> None:
    kv = KVCacheManager(4, block_size=4, enable_caching=False, num_swap_blocks=3)
    request = make_request("a", 10)
    assert kv.allocate(request, 10)
    device_blocks = list(request.block_ids)
    out = kv.swap_out(request)
    assert out is not None and [d for d, _ in out] == device_blocks
    assert request.block_ids == [] and request.swapped_block_ids == [s for _, s in out]
    assert kv.pool.num_free_blocks == 4 and kv.swap.num_free_blocks == 0
    back = kv.swap_in(request)
    assert back is not None and [s for s, _ in back] == [s for _, s in out]
    assert request.block_ids == [d for _, d in back] and request.swapped_block_ids == []
    assert kv.swap.num_free_blocks == 3
    kv.free(request)
    assert_kv_clean(kv)


def test_swap_out_fails_without_side_effects_when_swap_is_full() -> None:
    kv = KVCacheManager(4, block_size=4, enable_caching=False, num_swap_blocks=2)
    request = make_request("a", 10)  # 3 blocks, 2 swap blocks
    assert kv.allocate(request, 10)
    blocks = list(request.block_ids)
    assert kv.swap_out(request) is None
    assert request.block_ids == blocks and kv.swap.num_free_blocks == 2 and kv.pool.num_free_blocks == 1
    kv.free(request)
    assert_kv_clean(kv)


def test_swap_in_fails_without_side_effects_when_pool_is_full() -> None:
    kv = KVCacheManager(4, block_size=4, enable_caching=False, num_swap_blocks=4)
    request = make_request("a", 10)
    assert kv.allocate(request, 10)
    assert kv.swap_out(request) is not None
    other = make_request("b", 8)
    assert kv.allocate(other, 8)  # 2 of 4 device blocks: no room for 3
    swapped = list(request.swapped_block_ids)
    assert kv.swap_in(request) is None
    assert request.swapped_block_ids == swapped and request.block_ids == [] and kv.pool.num_free_blocks == 2
    kv.drop_swapped(request)
    kv.free(other)
    assert_kv_clean(kv)
