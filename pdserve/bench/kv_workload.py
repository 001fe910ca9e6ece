"""The KV transport benchmark's workload (kv_transport.py): the KV shape of one prompt, pools
allocated as the engine allocates its own, and the three block placements."""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass

import torch

from pdserve.disagg.kv_layout import KVLayout
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.host_memory import zeroed_pages

SEED = 0
PLACEMENTS = ("served", "scattered", "contiguous")


@dataclass(frozen=True, slots=True)
class KVWorkload:
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int
    num_tokens: int

    @property
    def num_blocks(self) -> int:
        return -(-self.num_tokens // self.block_size)

    @property
    def pool_blocks(self) -> int:
        return 2 * self.num_blocks

    @property
    def payload_bytes(self) -> int:
        return self.num_blocks * self.num_layers * self.layout().block_bytes_per_layer

    def describe(self) -> str:
        return (f"{self.name}: {self.num_tokens} tokens, {self.num_layers} layers, {self.num_kv_heads} KV heads, "
                f"head_dim {self.head_dim}, {self.dtype}, block {self.block_size} -> "
                f"{self.payload_bytes / 2**20:.0f} MiB in {self.num_layers} payloads of {self.num_blocks} blocks")

    def layout(self) -> KVLayout:
        return KVLayout("bench", self.dtype, self.dtype, self.block_size, self.num_layers, self.num_kv_heads,
                        self.head_dim)

    @property
    def pool_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.pool_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def pool(self, seed: int | None) -> torch.Tensor:
        """A pool allocated as the engine allocates its own (huge pages), shaped like it; random bits
        (every page touched) or, with no seed, zeros (every page touched as well)."""
        pool = buffer(math.prod(self.pool_shape) * self.layout().element_bytes)
        if seed is None:
            pool.fill_(0)
        else:
            pool.view(torch.int32).random_(generator=torch.Generator().manual_seed(seed))
        return pool.view(getattr(torch, self.dtype)).view(self.pool_shape)

    def placement(self, kind: str) -> tuple[list[int], list[int]]:
        """(source blocks, destination blocks) for placement `kind` (see kv_transport.py's docstring)."""
        if kind == "contiguous":
            return list(range(self.num_blocks)), list(range(self.num_blocks, 2 * self.num_blocks))
        rng = random.Random(SEED)
        if kind == "scattered":
            blocks = range(self.pool_blocks)
            return rng.sample(blocks, self.num_blocks), rng.sample(blocks, self.num_blocks)
        return self._served_blocks(rng), self._served_blocks(rng)

    def _served_blocks(self, rng: random.Random, num_requests: int = 400) -> list[int]:
        """The blocks the engine's allocator gives this request after `num_requests` others of 16 to
        1024 tokens came and went (a third of the pool held by the latest of them)."""
        pool = BlockPool(self.pool_blocks, enable_caching=True)
        live: list[list[int]] = []
        for n in range(num_requests):
            need = rng.randint(1, min(1024 // self.block_size, self.pool_blocks // 3))
            while live and (pool.num_free_blocks < need or pool.num_used_blocks > self.pool_blocks // 3):
                blocks = live.pop(rng.randrange(len(live)))
                pool.free(blocks[::-1])  # tail first, as the engine frees
            blocks = pool.allocate(need)
            for i, block in enumerate(blocks):
                pool.cache_block(block, f"{n}:{i}".encode())
            live.append(blocks)
        for blocks in live:
            pool.free(blocks[::-1])
        return pool.allocate(self.num_blocks)


WORKLOADS = {
    # the `small` demo preset's KV shape, for a 4K-token prompt
    "small": KVWorkload("small", num_layers=4, num_kv_heads=2, head_dim=64, dtype="float32", block_size=16,
                        num_tokens=4096),
    # 16 layers of a Qwen3-8B-like KV shape (8 KV heads x 128, bf16), 4K tokens
    "large": KVWorkload("large", num_layers=16, num_kv_heads=8, head_dim=128, dtype="bfloat16", block_size=16,
                        num_tokens=4096),
}


def buffer(num_bytes: int) -> torch.Tensor:
    """Every buffer of this benchmark, baselines included, is host memory of the kind the engine's
    pool is (`zeroed_pages`), so the ratios compare transports, not allocators."""
    return zeroed_pages(num_bytes)


def random_bytes(num_bytes: int) -> torch.Tensor:
    data = buffer(num_bytes)
    data.view(torch.int32).random_(generator=torch.Generator().manual_seed(SEED))
    return data


def digest(pool: torch.Tensor, block_ids: list[int]) -> str:
    blocks = pool[:, :, torch.tensor(block_ids)].contiguous()
    return hashlib.blake2b(blocks.view(-1).view(torch.uint8).numpy().data).hexdigest()
