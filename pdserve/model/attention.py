"""Attention over the paged KV cache.

Cache layout, one tensor per layer: ``[2 (k|v), num_blocks, block_size, num_kv_heads, head_dim]``.
A *slot* is one token's place in the pool: ``slot = block_id * block_size + offset``.

    block table of one sequence  [7, 2, 9]        (block_size 4)
    token position               0 1 2 3 | 4 5 6 7 | 8 9
    slot                         28..31  | 8..11   | 36 37

The runner computes slots and block tables (ids -> tensors); this module only writes the new
tokens' K/V at their slots and reads back each sequence's whole context.

Decode (one query token) on CPU in float32 reads most of its context in place: the longest run
of adjacent blocks of its table is one strided view of the pool, attended without a copy
(`DecodeRun`); the other blocks are gathered, with those of other decodes, into a padded batch
(`DecodeBatch`), and the two partial results are joined by their log-sum-exp (split-KV, as in
flash-decoding):

    table [7, 8, 9, 2, 12]   run 7..9 -> view of slots 28..39 (no copy)   rest [2, 12] -> gathered
    out = (o_run * exp(lse_run) + o_rest * exp(lse_rest)) / (exp(lse_run) + exp(lse_rest))

Gathering copied the whole context each layer (a decode step's KV can be as large as the model's
weights), then attention read it again: in place, it is read once (`can_attend_in_place`).

The pool's element type (`--kv-cache-dtype`) may differ from the model's (`--dtype`): new K/V are
cast to the pool's type when written, and what is read from the pool is cast to the query's type
before any math, so attention always computes in the model's dtype. A prompt's first chunk attends
to its own fresh K/V (never read back from the pool), as with an equal pool type. An FP8 pool
(`KVQuant`) stores K/V divided by its layer's scale and is read back times it (model/kv_scales.py):
the same two calls, with scale 1.0, make the plain casts of a float pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.model.kv_scales import dequantize, is_fp8, quantize


@dataclass(frozen=True, slots=True)
class PrefillSpan:
    """One sequence contributing more than one query token (a prompt chunk)."""

    start: int  # first row of this sequence in the flattened batch
    end: int  # one past its last row
    context_len: int  # tokens of KV after this step, including the new ones
    block_table: torch.Tensor  # [num_blocks_of_sequence] int64


@dataclass(frozen=True, slots=True)
class DecodeRun:
    """The part of one decode's context that lies in adjacent blocks: slots
    [first_slot, first_slot + num_tokens) of the pool, attended in place."""

    row: int  # its row in the flattened batch
    first_slot: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class DecodeBatch:
    """Single-token queries attended together over their gathered blocks: their whole context, or
    (with `AttentionMetadata.decode_runs`) what their run leaves out."""

    rows: torch.Tensor  # [num_decodes] int64: their rows in the flattened batch
    block_ids: torch.Tensor  # [num_decodes * max_blocks] int64: block tables padded with block 0, flattened
    mask: torch.Tensor  # [num_decodes, 1, 1, max_blocks * block_size] additive: 0 in context, -inf past it
    # Gather workspace [num_decodes * max_blocks, block_size, num_kv_heads, head_dim], reused by every
    # layer. NOTE: gathering into a preallocated buffer is ~3x faster on CPU than fresh allocations.
    k_buf: torch.Tensor
    v_buf: torch.Tensor


KVScale = tuple[float, float]  # (k_scale, v_scale) of one layer
UNSCALED: KVScale = (1.0, 1.0)


@dataclass(frozen=True, slots=True)
class KVQuant:
    """An FP8 pool's (k_scale, v_scale) per layer, found by the address of the layer's cache tensor.
    NOTE: the model hands attention each layer's cache tensor and nothing else (model/qwen3.py), so
    its code is the same for every pool type; the runner, which owns the pool, builds this once."""

    scales: dict[int, KVScale]  # layer_cache.data_ptr() -> (k_scale, v_scale)

    def of(self, layer_cache: torch.Tensor) -> KVScale:
        return self.scales[layer_cache.data_ptr()]


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Everything attention needs for one step; built by the model runner."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V is written
    decodes: tuple[DecodeBatch, ...]  # single-token queries, bucketed by (gathered) context length
    prefills: tuple[PrefillSpan, ...]
    # NOTE: when not empty, every decode's context is its run (if any) plus its blocks in `decodes`
    # (if any), joined by log-sum-exp; empty: `decodes` hold whole contexts
    decode_runs: tuple[DecodeRun, ...] = ()
    kv_quant: KVQuant | None = None  # an FP8 pool's scales; None: a float pool (scale 1.0)


def write_kv(layer_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             kv_scale: KVScale = UNSCALED) -> None:
    num_kv_heads, head_dim = k.shape[-2:]
    for index, (values, scale) in enumerate(((k, kv_scale[0]), (v, kv_scale[1]))):
        stored = quantize(values, layer_cache.dtype, scale)
        dst = layer_cache[index].view(-1, num_kv_heads, head_dim)
        if is_fp8(layer_cache.dtype):  # NOTE: torch's CPU index_copy_ has no float8 kernel; bytes are bytes
            dst, stored = dst.view(torch.uint8), stored.view(torch.uint8)
        dst.index_copy_(0, slot_mapping, stored)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim] (new tokens).

    Writes k/v into the cache, then returns [num_tokens, num_heads, head_dim].
    """
    kv_scale = UNSCALED if meta.kv_quant is None else meta.kv_quant.of(layer_cache)
    write_kv(layer_cache, k, v, meta.slot_mapping, kv_scale)
    out = torch.empty_like(q)
    if meta.decode_runs:
        _split_decode_attention(q, layer_cache, meta, scale, out)
    else:
        for batch in meta.decodes:
            out[batch.rows] = _decode_attention(q[batch.rows], layer_cache, batch, scale, kv_scale)
    for span in meta.prefills:
        if span.context_len == span.end - span.start:
            out[span.start:span.end] = _fresh_prefill_attention(q, k, v, span, scale)
        else:
            out[span.start:span.end] = _cached_prefill_attention(q, layer_cache, span, scale, kv_scale)
    return out


_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def can_attend_in_place(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
    """Whether decode may read runs in place (`DecodeRun`): on CPU, with torch's CPU flash kernel
    (it returns the log-sum-exp), and in float32 only, model and pool. NOTE: another pool type is
    cast when read, a copy anyway; and in bfloat16 the join's rounding would differ from one pass
    over the whole context, so a bfloat16 model's tokens would depend on its pool's type."""
    return device.type == "cpu" and dtype == kv_dtype == torch.float32 and _FLASH_CPU is not None


def _split_decode_attention(q: torch.Tensor, layer_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                            out: torch.Tensor) -> None:
    """Each decode's run in place, then the gathered rest of those that have one, joined by
    log-sum-exp. GQA without copies: the query heads sharing a KV head act as its query rows."""
    assert _FLASH_CPU is not None
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = layer_cache.shape[3]
    grouped = q.view(-1, num_kv_heads, num_heads // num_kv_heads, head_dim)
    keys = layer_cache[0].view(-1, num_kv_heads, head_dim)  # [slot, kv_head, dim]
    values = layer_cache[1].view(-1, num_kv_heads, head_dim)
    lse = torch.empty(grouped.shape[:3], dtype=torch.float32)  # the kernel returns it in float32
    keys_by_head, values_by_head = keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
    outs, lses = [], []
    for run in meta.decode_runs:
        end = run.first_slot + run.num_tokens
        run_out, run_lse = _FLASH_CPU(grouped[run.row:run.row + 1], keys_by_head[:, :, run.first_slot:end],
                                      values_by_head[:, :, run.first_slot:end], 0.0, False, scale=scale)
        outs.append(run_out)
        lses.append(run_lse)
    rows = torch.tensor([run.row for run in meta.decode_runs])
    out.index_copy_(0, rows, torch.cat(outs).view(-1, num_heads, head_dim))
    lse.index_copy_(0, rows, torch.cat(lses))
    for batch in meta.decodes:
        keys_rest, values_rest = _gather(layer_cache, batch, q.dtype)
        rest_out, rest_lse = _FLASH_CPU(grouped[batch.rows], keys_rest, values_rest, 0.0, False,
                                        attn_mask=batch.mask, scale=scale)
        run_lse = lse[batch.rows]
        top = torch.maximum(run_lse, rest_lse)
        run_weight, rest_weight = (run_lse - top).exp_()[..., None], (rest_lse - top).exp_()[..., None]
        run_out = out[batch.rows].view(rest_out.shape)
        joined = (run_out * run_weight + rest_out * rest_weight) / (run_weight + rest_weight)
        out[batch.rows] = joined.reshape(-1, num_heads, head_dim)


def _gather(layer_cache: torch.Tensor, batch: DecodeBatch, dtype: torch.dtype,
            kv_scale: KVScale = UNSCALED) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's blocks, copied: keys and values [num_decodes, num_kv_heads, kv_len, head_dim]."""
    num_kv_heads, head_dim = layer_cache.shape[3:]
    num_seqs, kv_len = batch.mask.shape[0], batch.mask.shape[-1]
    torch.index_select(layer_cache[0], 0, batch.block_ids, out=batch.k_buf)
    torch.index_select(layer_cache[1], 0, batch.block_ids, out=batch.v_buf)
    keys = dequantize(batch.k_buf, dtype, kv_scale[0]).view(num_seqs, kv_len, num_kv_heads, head_dim).transpose(1, 2)
    values = dequantize(batch.v_buf, dtype, kv_scale[1]).view(num_seqs, kv_len, num_kv_heads, head_dim).transpose(1, 2)
    return keys, values


def _decode_attention(q: torch.Tensor, layer_cache: torch.Tensor, batch: DecodeBatch, scale: float,
                      kv_scale: KVScale) -> torch.Tensor:
    """q: [num_decodes, num_heads, head_dim]. Gathers each sequence's blocks (padded), masks the
    padding. GQA without copies: the query heads sharing a KV head act as that head's query rows."""
    num_seqs, num_heads, head_dim = q.shape
    keys, values = _gather(layer_cache, batch, q.dtype, kv_scale)
    grouped = q.view(num_seqs, keys.shape[1], num_heads // keys.shape[1], head_dim)
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=batch.mask, scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim)


def _fresh_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, span: PrefillSpan,
                             scale: float) -> torch.Tensor:
    """A prefill with no earlier context: the new K/V are the whole context, no need to read the pool."""
    query = q[span.start:span.end].transpose(0, 1).unsqueeze(0)
    keys = k[span.start:span.end].transpose(0, 1).unsqueeze(0)
    values = v[span.start:span.end].transpose(0, 1).unsqueeze(0)
    out = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


def _cached_prefill_attention(q: torch.Tensor, layer_cache: torch.Tensor, span: PrefillSpan, scale: float,
                              kv_scale: KVScale) -> torch.Tensor:
    """A prefill chunk after earlier context: its keys and values read from the pool (written first)."""
    num_new = span.end - span.start
    query = q[span.start:span.end].transpose(0, 1).unsqueeze(0)
    num_kv_heads, head_dim = layer_cache.shape[3:]
    keys = dequantize(layer_cache[0][span.block_table].view(-1, num_kv_heads, head_dim)[:span.context_len], q.dtype,
                      kv_scale[0])
    values = dequantize(layer_cache[1][span.block_table].view(-1, num_kv_heads, head_dim)[:span.context_len],
                        q.dtype, kv_scale[1])
    # Query i sits at absolute position (context_len - num_new + i) and sees keys up to it.
    offset = span.context_len - num_new
    rows = torch.arange(num_new, device=q.device)[:, None] + offset
    cols = torch.arange(span.context_len, device=q.device)[None, :]
    out = F.scaled_dot_product_attention(query, keys.transpose(0, 1).unsqueeze(0),
                                         values.transpose(0, 1).unsqueeze(0), attn_mask=cols <= rows,
                                         scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)
