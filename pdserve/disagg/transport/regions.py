"""Where one layer payload lives in a pool, as byte ranges.

In the engine's pool [layer, k|v, block, slot, head, dim], kv_cache[l, kv, b] is one contiguous
region of `layout.region_bytes`. A payload for blocks (b0, b1, ...) of layer l is, in order:

    K of b0 | K of b1 | ... | V of b0 | V of b1 | ...      (shape [k|v, block, slot, head, dim])

    offset(l, kv, b) = ((l * 2 + kv) * num_pool_blocks + b) * region_bytes

Consecutive block ids are adjacent in memory, so their regions merge into one range: fewer
syscall buffers (tcp) and fewer descriptors (nixl, where each costs ~3 us on loopback).
"""

from __future__ import annotations

import torch

from pdserve.disagg.kv_layout import KVLayout


def pool_bytes(kv_cache: torch.Tensor) -> memoryview:
    """The whole (CPU, contiguous) pool as one flat byte view; numpy has no bfloat16, hence uint8."""
    return kv_cache.view(-1).view(torch.uint8).numpy().data


def payload_views(layout: KVLayout, kv_cache: torch.Tensor, flat: memoryview, layer: int,
                  block_ids: tuple[int, ...] | list[int]) -> list[memoryview]:
    """Views of a CPU pool's payload regions for these blocks, in payload order, adjacent ones merged."""
    offsets = payload_offsets(layout, kv_cache.shape[2], layer, block_ids)
    return [flat[start:start + length] for start, length in coalesce(offsets, layout.region_bytes)]


def payload_offsets(layout: KVLayout, num_pool_blocks: int, layer: int,
                    block_ids: tuple[int, ...] | list[int]) -> list[int]:
    """Byte offset of each region of the payload, in payload order."""
    size = layout.region_bytes
    return [((layer * 2 + kv) * num_pool_blocks + b) * size for kv in (0, 1) for b in block_ids]


def coalesce(offsets: list[int], size: int) -> list[tuple[int, int]]:
    """Regions of `size` bytes at `offsets` (in order) -> (start, length) ranges, adjacent ones merged."""
    spans: list[tuple[int, int]] = []
    for offset in offsets:
        if spans and spans[-1][0] + spans[-1][1] == offset:
            spans[-1] = (spans[-1][0], spans[-1][1] + size)
        else:
            spans.append((offset, size))
    return spans


def coalesce_pairs(local: list[int], remote: list[int], size: int) -> list[tuple[int, int, int]]:
    """Paired regions (local[i] -> remote[i]) -> (local start, remote start, length), merging a pair
    into the previous one when both sides continue it."""
    spans: list[tuple[int, int, int]] = []
    for src, dst in zip(local, remote, strict=True):
        if spans and spans[-1][0] + spans[-1][2] == src and spans[-1][1] + spans[-1][2] == dst:
            spans[-1] = (spans[-1][0], spans[-1][1], spans[-1][2] + size)
        else:
            spans.append((src, dst, size))
    return spans
