"""Attention backends, chosen by device: one interface, two implementations.

Contract of an `AttentionBackend`:
- `forward(q, k, v, layer_cache, meta, scale)`: q [num_tokens, num_heads, head_dim], k and v
  [num_tokens, num_kv_heads, head_dim] (the step's new tokens, any row stride); writes k/v into
  `layer_cache` (the layer's pool, [2, num_blocks, block_size, num_kv_heads, head_dim] in the pool's
  dtype) at `meta`'s slots, then returns the attention output [num_tokens, num_heads, head_dim] in
  q's dtype. Each row attends to its sequence's context through the paged pool, causally.
- `meta` is built once per step by the model runner (engine/model_runner.py, engine/step_buffers.py)
  in the backend's own metadata type; the model passes it through to every layer untouched.
- `graph_safe`: whether `forward` may be captured in a CUDA graph (no host syncs, no Python
  decisions on tensor values, fixed shapes for a given batch size; rows with slot -1 write nothing).

    TorchAttention   CPU (and CUDA without triton): model/attention.py as it always was:
                     `AttentionMetadata`; decode reads runs of adjacent blocks in place on CPU
    TritonAttention  CUDA: `PagedMetadata`, Triton kernels (model/triton_attention.py) reading the
                     block tables inside the kernel, every prompt chunk in one prefix-kernel launch;
                     fresh prompts (no cached context) of 1,024 tokens or more, and every fresh prompt
                     on a pool of another dtype than the model's (FP8), use torch's fused attention
                     (flash on CUDA) over their own new K/V, as on CPU (engine/step_buffers.py)

`attend` dispatches on the metadata's type, so the model (qwen3.py) needs no backend of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from importlib.util import find_spec
from typing import Protocol

import torch

from pdserve.model.attention import (
    UNSCALED,
    AttentionMetadata,
    KVQuant,
    PrefillSpan,
    _fresh_prefill_attention,
    paged_attention,
)


@dataclass(frozen=True, slots=True)
class PagedMetadata:
    """One step for `TritonAttention`: every tensor a view of the runner's persistent step buffers
    (engine/step_buffers.py), int32 on the device. Decodes are sequences 0..num_decodes-1 of
    `block_tables`/`context_lens`; prompt chunks follow them (but the fresh prompts that attend
    apart, `fresh_prefills`: engine/step_buffers.py)."""

    slot_mapping: torch.Tensor  # [num_tokens]: -1 writes nothing (a CUDA graph's padded rows)
    decode_rows: torch.Tensor  # [num_decodes]: each decode's row in the flattened batch
    decode_tables: torch.Tensor  # [num_decodes, max_blocks_per_seq]
    decode_lens: torch.Tensor  # [num_decodes]: tokens of context after this step
    num_splits: int  # split-KV parts per decode (a power of two; fixed per batch size)
    prefix_starts: torch.Tensor  # [num_prefix]: first row of each prompt chunk the prefix kernel attends
    prefix_ends: torch.Tensor  # [num_prefix]
    prefix_tables: torch.Tensor  # [num_prefix, max_blocks_per_seq]
    prefix_lens: torch.Tensor  # [num_prefix]
    max_prefix_query_len: int
    fresh_prefills: tuple[tuple[int, int], ...] = ()  # (start, end) rows of fresh prompts that attend apart (SDPA)
    kv_quant: KVQuant | None = None  # an FP8 pool's per-layer scales, read by the kernels; None: a float pool


StepMetadata = AttentionMetadata | PagedMetadata


class AttentionBackend(Protocol):
    name: str
    graph_safe: bool

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_cache: torch.Tensor,
                meta: StepMetadata, scale: float) -> torch.Tensor: ...


class TorchAttention:
    name = "torch"
    graph_safe = False

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_cache: torch.Tensor,
                meta: StepMetadata, scale: float) -> torch.Tensor:
        assert isinstance(meta, AttentionMetadata)
        return paged_attention(q, k, v, layer_cache, meta, scale)


class TritonAttention:
    name = "triton"
    graph_safe = True

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_cache: torch.Tensor,
                meta: StepMetadata, scale: float) -> torch.Tensor:
        from pdserve.model import triton_attention as kernels

        assert isinstance(meta, PagedMetadata)
        # NOTE: a CUDA graph records the layer's scales as kernel arguments (they never change)
        kv_scale = UNSCALED if meta.kv_quant is None else kernels.layer_scale(meta.kv_quant, layer_cache)
        kernels.store_kv(k, v, layer_cache, meta.slot_mapping, kv_scale=kv_scale)
        out = torch.empty_like(q)
        kernels.decode_attention(q, layer_cache, meta.decode_tables, meta.decode_lens, meta.decode_rows, out,
                                 scale=scale, num_splits=meta.num_splits, kv_scale=kv_scale)
        kernels.prefix_attention(q, layer_cache, meta.prefix_tables, meta.prefix_lens, meta.prefix_starts,
                                 meta.prefix_ends, out, max_query_len=meta.max_prefix_query_len, scale=scale,
                                 kv_scale=kv_scale)
        for start, end in meta.fresh_prefills:  # NOTE: the whole context is new: no pool read (flash on CUDA)
            out[start:end] = _fresh_prefill_attention(q, k, v, PrefillSpan(start, end, end - start, _NO_TABLE),
                                                      scale)  # NOTE: unquantized K/V, as the torch backend's
        return out


_NO_TABLE = torch.empty(0, dtype=torch.long)
TORCH = TorchAttention()
TRITON = TritonAttention()


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_cache: torch.Tensor,
           meta: StepMetadata, scale: float) -> torch.Tensor:
    """The backend whose metadata this step carries."""
    backend: AttentionBackend = TRITON if isinstance(meta, PagedMetadata) else TORCH
    return backend.forward(q, k, v, layer_cache, meta, scale)


@cache
def triton_available() -> bool:
    return find_spec("triton") is not None


def select_backend(device: torch.device) -> AttentionBackend:
    """Triton on CUDA when it is installed, for every pool type (an FP8 pool's per-layer scales are
    applied inside the kernels); torch (model/attention.py) everywhere else."""
    return TRITON if device.type == "cuda" and triton_available() else TORCH


def decode_splits(num_decodes: int, num_kv_heads: int, num_sms: int) -> int:
    """Split-KV parts for a decode batch: enough (kernel) programs to fill the GPU twice over, a
    power of two, at most 16; 1 once the batch fills it alone. A function of the batch size only,
    so a graph captured for a batch size replays with the same split as an eager step of it."""
    programs = max(1, num_decodes * num_kv_heads)
    splits = 1
    while splits < 16 and programs * splits * 2 <= 2 * num_sms:
        splits *= 2
    return splits
