"""Tensor parallelism: which slice of each weight a rank holds, and the collectives that join them.

N ranks, rank r (Megatron/vLLM layout):

    qkv_proj, gate_up_proj   column-parallel: rank r holds heads [r*H/N, (r+1)*H/N) of q, its KV
                             heads, and intermediate rows [r*I/N, (r+1)*I/N) (each MoE expert's
                             rows of its own moe_intermediate_size likewise; routers replicated)
    o_proj, down_proj        row-parallel: the matching input columns; the partial sums of every
                             rank are added by one all-reduce each
    embed_tokens, lm_head    vocabulary-parallel: token rows [r*V/N, (r+1)*V/N); the embedding
                             all-reduces (each token's row lives on one rank, the others add 0),
                             the head all-gathers the logit slices
    norms, RoPE              replicated

KV heads: with K >= N each rank holds K/N of them; with K < N (N a multiple of K) each KV head is
replicated on N/K ranks and rank r holds head r // (N/K), the one its query heads read (vLLM does
the same). Each rank's KV pool holds only its heads; block ids are the same on every rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch

from pdserve.model.qwen3_config import Qwen3ModelConfig


class ParallelGroup(Protocol):
    """The collectives the model calls; every rank calls them in the same order."""

    rank: int
    size: int

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; returns it."""
        ...

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `tensor` (same shape on all) along the last dimension."""
        ...


@dataclass(frozen=True, slots=True)
class TPShard:
    """Rank `rank` of `size`: the index ranges of the model it holds."""

    rank: int
    size: int

    def local_config(self, cfg: Qwen3ModelConfig) -> Qwen3ModelConfig:
        """The shapes of this rank's modules: a Qwen3 with fewer heads, rows and tokens."""
        moe = None if cfg.moe is None else dataclasses.replace(
            cfg.moe, moe_intermediate_size=cfg.moe.moe_intermediate_size // self.size)
        return dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // self.size,
                                   num_key_value_heads=self.num_local_kv_heads(cfg),
                                   intermediate_size=cfg.intermediate_size // self.size,
                                   vocab_size=cfg.vocab_size // self.size, moe=moe)

    def num_local_kv_heads(self, cfg: Qwen3ModelConfig) -> int:
        return max(1, cfg.num_key_value_heads // self.size)

    def kv_head_range(self, cfg: Qwen3ModelConfig) -> tuple[int, int]:
        """[first, end) of the model's KV heads in this rank's pool."""
        return kv_head_range(self.rank, self.size, cfg.num_key_value_heads)


    def vocab_start(self, cfg: Qwen3ModelConfig) -> int:
        return self.rank * (cfg.vocab_size // self.size)

    def checkpoint_slice(self, cfg: Qwen3ModelConfig, module: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a checkpoint tensor; `module` is its name without `.weight`/`.bias`."""
        if self.size == 1:
            return tensor
        head_dim, n = cfg.head_dim, self.size
        kind = module.rsplit(".", 1)[-1]
        # per-expert tensors: model.layers.L.mlp.experts.E.{gate,up,down}_proj
        intermediate = cfg.moe.moe_intermediate_size if cfg.moe is not None and ".experts." in module \
            else cfg.intermediate_size
        if kind == "q_proj":
            rows = cfg.num_attention_heads // n * head_dim
            return tensor.narrow(0, self.rank * rows, rows)
        if kind in ("k_proj", "v_proj"):
            first, end = self.kv_head_range(cfg)
            return tensor.narrow(0, first * head_dim, (end - first) * head_dim)
        if kind in ("gate_proj", "up_proj"):
            rows = intermediate // n
            return tensor.narrow(0, self.rank * rows, rows)
        if kind == "o_proj":
            cols = cfg.num_attention_heads // n * head_dim
            return tensor.narrow(1, self.rank * cols, cols)
        if kind == "down_proj":
            cols = intermediate // n
            return tensor.narrow(1, self.rank * cols, cols)
        if kind in ("embed_tokens", "lm_head"):
            return tensor.narrow(0, self.vocab_start(cfg), cfg.vocab_size // n)
        return tensor  # norms, MoE routers: replicated


def check_tp_size(cfg: Qwen3ModelConfig, size: int) -> None:
    """Raises ValueError when this model cannot be split over `size` ranks."""
    k = cfg.num_key_value_heads
    checks = [
        (size >= 1, "tensor_parallel_size must be >= 1"),
        (cfg.num_attention_heads % size == 0,
         f"tensor_parallel_size {size} must divide num_attention_heads ({cfg.num_attention_heads})"),
        (k % size == 0 or size % k == 0,
         f"tensor_parallel_size {size} must divide num_key_value_heads ({k}) or be a multiple of it"),
        (cfg.intermediate_size % size == 0,
         f"tensor_parallel_size {size} must divide intermediate_size ({cfg.intermediate_size})"),
        (cfg.vocab_size % size == 0, f"tensor_parallel_size {size} must divide vocab_size ({cfg.vocab_size})"),
        (cfg.moe is None or cfg.moe.moe_intermediate_size % size == 0,
         f"tensor_parallel_size {size} must divide moe_intermediate_size "
         f"({cfg.moe.moe_intermediate_size if cfg.moe else 0})"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


def kv_head_range(rank: int, size: int, num_kv_heads: int) -> tuple[int, int]:
    """[first, end) of a model's `num_kv_heads` KV heads that rank `rank` of `size` holds: an equal
    share, or one head replicated on `size / num_kv_heads` consecutive ranks."""
    if num_kv_heads >= size:
        num = num_kv_heads // size
        return rank * num, (rank + 1) * num
    first = rank // (size // num_kv_heads)
    return first, first + 1
