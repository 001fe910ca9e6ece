"""Paged attention in Triton: the CUDA backend's kernels (model/attention_backend.py).

Pool layout, one tensor per layer (model/attention.py): ``[2 (k|v), num_blocks, block_size,
num_kv_heads, head_dim]``; a token's KV lives at slot ``block_table[pos // block_size] *
block_size + pos % block_size``. The kernels read the block table themselves (no gather copy):

    store_kv            each new token's K/V to its slot; slot -1 (a padded row) writes nothing
    decode_attention    one query token per sequence, split-KV: program (seq, kv_head, split)
                        attends its query heads (GQA: the group shares each K/V load) to one
                        contiguous part of the context; `_merge_splits` joins the parts by their
                        log-sum-exp (at one split the decode kernel writes the output itself).
                        The split count is a launch constant and each sequence's split
                        length comes from its context length (a tensor), so a CUDA graph captured
                        for a batch size replays for any context lengths.
    prefix_attention    varlen queries over a cached prefix: program (query tile, seq, kv_head)
                        attends its rows to the sequence's paged context, a row being one of the
                        tile's query tokens at one of the KV head's query heads (GQA packed: each
                        K/V tile is loaded once for the whole group, not once per query head);
                        query i of a span of q_len new tokens sits at position
                        context_len - q_len + i and sees the keys up to it (the new tokens' K/V are
                        in the pool by then).

An FP8 pool (float8_e4m3fn or float8_e5m2, model/kv_scales.py) is read and written by the same
kernels: `store_kv` divides by the layer's K or V scale and rounds to the format in the kernel
(integer bit arithmetic, bit-identical to torch's cast in `kv_scales.quantize`: the same bytes as
the CPU path and a PD hand-off's receiver); attention loads the FP8 elements, and folds the K scale
into the softmax scale and the V scale into the output: no dequantized copy of the context, the
kernels read 1 byte per element. A float pool runs them with scales 1.0.

Decode casts every load to float32 at once (it is bound by reading the context, not by its
math): `tl.dot` multiplies float32 in IEEE precision for a float32 model and in TF32 otherwise (a
bfloat16/float16 pool's K/V are exact in TF32). The prefix kernel, whose long chunks over long
contexts are bound by their math, multiplies in the model's dtype as flash attention does (K/V,
an FP8 pool's too, cast to it; the probabilities rounded to it before P·V; float32 accumulators):
for bfloat16 that compiles to Hopper's warpgroup MMA, TF32 `mma.sync` on up-cast tiles before
(tests/triton_hopper_compile.py prints which, and each kernel's registers and spills). Softmax
state and outputs are float32 everywhere; only the output is cast back. Triton's interpreter
(`TRITON_INTERPRET=1`, the tests on CPU) runs float32 and float16 (its bfloat16 arithmetic is
wrong). Fixed launch configurations, no autotuning (a CUDA graph captures one launch; autotuning
would time kernels at capture).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.model.attention import UNSCALED, KVQuant, KVScale
from pdserve.model.kv_scales import is_fp8

DECODE_BLOCK_N = 64  # context tokens per tile
# prefix programs: (query rows, context tokens a tile) for 16-bit and for float32 operands, whose
# rows are query tokens x a KV group's heads; at these, 8 warps, Qwen3-8B's shapes compile for sm_90
# with no spill (tests/triton_hopper_compile.py: 215 and 158 registers); float32 at 16-bit's tiles spills
PREFIX_TILES = {2: (128, 64), 4: (64, 32)}
PREFIX_WARPS = 8
_MIN_DOT = 16  # tl.dot's smallest M, N and K


def _dim(n: int) -> int:
    return max(_MIN_DOT, triton.next_power_of_2(n))


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


@torch.compiler.assume_constant_result
def layer_scale(kv_quant: KVQuant, layer_cache: torch.Tensor) -> KVScale:
    """The layer's FP8 scales (`KVQuant.of`). torch.compile calls it while tracing and keeps the
    result as a constant: it reads the cache tensor's address, which Dynamo cannot trace, and a
    layer's scales never change (a CUDA graph records them as kernel arguments likewise)."""
    return kv_quant.of(layer_cache)


@triton.jit
def _fp8_bits(x, scale, MANT: tl.constexpr, BIAS: tl.constexpr, MAX: tl.constexpr, SUB_SCALE: tl.constexpr,
              MIN_NORMAL: tl.constexpr):
    """float32 values -> the bytes of float8(clamp(x / scale, +-MAX)), rounded to nearest even as
    torch's cast (MANT mantissa bits, exponent BIAS: e4m3fn 3 and 7, e5m2 2 and 15). Integer
    arithmetic on float32's bits: NOTE Triton's interpreter rounds float8 casts wrongly (it drops
    the carry into the exponent), and this is the same code compiled for the GPU."""
    y = tl.div_rn(x, scale)  # NOTE: IEEE division, as torch's (Triton's `/` may approximate on CUDA)
    y = tl.minimum(tl.maximum(y, -MAX), MAX)
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    magnitude = mag.to(tl.float32, bitcast=True)
    # a normal float8: round float32's mantissa to MANT bits (a carry moves into the exponent), re-bias
    normal = ((mag + ((1 << (22 - MANT)) - 1) + ((mag >> (23 - MANT)) & 1)) >> (23 - MANT)) - ((127 - BIAS) << MANT)
    # a subnormal one: the value in units of the smallest subnormal, rounded to an integer by adding 2**23
    subnormal = (magnitude * SUB_SCALE + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
    return (tl.where(magnitude < MIN_NORMAL, subnormal, normal) | sign).to(tl.uint8)


def _fp8_format(dtype: torch.dtype) -> dict[str, float | int]:
    """`_fp8_bits`' constants for a pool's float8 type."""
    mant, bias = {torch.float8_e4m3fn: (3, 7), torch.float8_e5m2: (2, 15)}[dtype]
    return {"MANT": mant, "BIAS": bias, "MAX": torch.finfo(dtype).max, "SUB_SCALE": 2.0 ** (bias + mant - 1),
            "MIN_NORMAL": 2.0 ** (1 - bias)}


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr, k_scale, v_scale, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kv, stride_slot, stride_head, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr, MANT: tl.constexpr,
                     BIAS: tl.constexpr, MAX: tl.constexpr, SUB_SCALE: tl.constexpr, MIN_NORMAL: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    slots = tl.zeros([BLOCK_H, BLOCK_D], tl.int64) + slot
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM) & (slots >= 0)
    safe_slot = tl.maximum(slots, 0)
    dst = cache_ptr + safe_slot * stride_slot + heads * stride_head + dims
    k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask, other=0.0).to(tl.float32)
    if FP8:  # the pool as bytes
        tl.store(dst, _fp8_bits(k, k_scale, MANT, BIAS, MAX, SUB_SCALE, MIN_NORMAL), mask=mask)
        tl.store(dst + stride_kv, _fp8_bits(v, v_scale, MANT, BIAS, MAX, SUB_SCALE, MIN_NORMAL), mask=mask)
    else:
        tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + stride_kv, v.to(cache_ptr.dtype.element_ty), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, layer_cache: torch.Tensor, slot_mapping: torch.Tensor,
             kv_scale: KVScale = UNSCALED) -> None:
    """k, v: [num_tokens, num_kv_heads, head_dim] (any row and head strides); slot_mapping:
    [num_tokens], -1 for a row that writes nothing (a CUDA graph's padding). An FP8 pool stores
    k / k_scale and v / v_scale (`kv_scale`), as kv_scales.quantize does."""
    num_tokens, num_kv_heads, head_dim = k.shape
    _check_pool(layer_cache)
    assert k.stride(2) == 1 and v.stride(2) == 1
    if num_tokens == 0:
        return
    fp8 = is_fp8(layer_cache.dtype)
    fmt = _fp8_format(layer_cache.dtype) if fp8 else _fp8_format(torch.float8_e4m3fn)  # unused without FP8
    pool = layer_cache.view(torch.uint8) if fp8 else layer_cache
    _store_kv_kernel[(num_tokens,)](
        k, v, pool, slot_mapping, kv_scale[0], kv_scale[1], k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        layer_cache.stride(0), layer_cache.stride(2), layer_cache.stride(3), NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        FP8=fp8, **fmt)


def _shapes(q: torch.Tensor, layer_cache: torch.Tensor, block_tables: torch.Tensor, out: torch.Tensor
            ) -> tuple[int, int, int, int]:
    """num_heads, head_dim, num_kv_heads, block_size, once the layouts the kernels assume are checked."""
    _check_pool(layer_cache)
    num_heads, head_dim = q.shape[1:]
    num_kv_heads, block_size = layer_cache.shape[3], layer_cache.shape[2]
    assert num_heads % num_kv_heads == 0 and q.stride(2) == 1 and out.stride(2) == 1 and block_tables.stride(1) == 1
    return num_heads, head_dim, num_kv_heads, block_size


def _check_pool(layer_cache: torch.Tensor) -> None:
    """[2, blocks, block_size, kv_heads, head_dim], blocks and slots dense: one stride per slot."""
    assert layer_cache.dim() == 5 and layer_cache.stride(4) == 1
    assert layer_cache.stride(1) == layer_cache.shape[2] * layer_cache.stride(2), "slots of a block must be dense"


@triton.jit
def _decode_split_kernel(q_ptr, cache_ptr, tables_ptr, lens_ptr, rows_ptr, part_out_ptr, part_lse_ptr, out_ptr, scale,
                         v_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_kv, stride_slot, stride_head,
                         stride_table, BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                         NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(lens_ptr + seq)
    row = tl.load(rows_ptr + seq).to(tl.int64)
    # each split gets whole tiles: the last splits of a short context are empty
    split_len = tl.cdiv(tl.cdiv(context_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, context_len)
    groups = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + groups
    q_mask = (groups < GROUP)[:, None] & (dims < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + dims[None, :], mask=q_mask,
                other=0.0).to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = tables_ptr + seq.to(tl.int64) * stride_table
    head_base = cache_ptr + kv_head * stride_head
    for first in range(start, end, BLOCK_N):
        tokens = first + tl.arange(0, BLOCK_N)
        inside = tokens < end
        blocks = tl.load(table + tokens // BLOCK_SIZE, mask=inside, other=0).to(tl.int64)
        slots = blocks * BLOCK_SIZE + tokens % BLOCK_SIZE
        kv_mask = inside[None, :] & (dims < HEAD_DIM)[:, None]
        keys = tl.load(head_base + slots[None, :] * stride_slot + dims[:, None], mask=kv_mask,
                       other=0.0).to(tl.float32)  # [D, N]
        scores = tl.dot(q, keys, input_precision=PRECISION) * scale
        scores = tl.where(inside[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        values = tl.load(head_base + stride_kv + slots[:, None] * stride_slot + dims[None, :],
                         mask=inside[:, None] & (dims < HEAD_DIM)[None, :], other=0.0).to(tl.float32)  # [N, D]
        acc = acc * alpha[:, None] + tl.dot(p, values, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    if NUM_SPLITS == 1:  # the whole context: the output itself, no merge
        out = acc * v_scale / l_i[:, None]
        tl.store(out_ptr + row * stride_ot + heads[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        part = (seq.to(tl.int64) * (GROUP * tl.num_programs(1)) + heads) * NUM_SPLITS + split
        _store_partial(part_out_ptr, part_lse_ptr, part, acc * v_scale, m_i, l_i, groups < GROUP, BLOCK_D)


@triton.jit
def _store_partial(part_out_ptr, part_lse_ptr, part, acc, m_i, l_i, valid, BLOCK_D: tl.constexpr):
    """One split's normalised output and log-sum-exp: out [seq, head, split, dim], lse [seq, head,
    split]; an empty split (no tokens) has lse -inf and weighs nothing in the merge."""
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    tl.store(part_out_ptr + part[:, None] * BLOCK_D + tl.arange(0, BLOCK_D)[None, :], out, mask=valid[:, None])
    tl.store(part_lse_ptr + part, lse, mask=valid)


@triton.jit
def _merge_splits_kernel(part_out_ptr, part_lse_ptr, rows_ptr, out_ptr, stride_ot, stride_oh,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.load(rows_ptr + seq).to(tl.int64)
    part = (seq.to(tl.int64) * tl.num_programs(1) + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, BLOCK_D)
    lse = tl.load(part_lse_ptr + part)
    top = tl.max(lse, 0)
    weight = tl.exp(lse - top)  # an empty split: exp(-inf) = 0
    parts = tl.load(part_out_ptr + part[:, None] * BLOCK_D + dims[None, :])
    out = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


def decode_attention(q: torch.Tensor, layer_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, *, scale: float,
                     num_splits: int, kv_scale: KVScale = UNSCALED) -> None:
    """For each sequence s: out[rows[s]] = attention of q[rows[s]] over its context_lens[s] tokens
    read through block_tables[s]. q, out: [num_tokens, num_heads, head_dim]; block_tables
    [num_seqs, width] (any width covering the contexts); num_splits a power of two (1: one kernel,
    no merge). An FP8 pool's elements are worth `kv_scale` times themselves."""
    num_seqs = rows.shape[0]
    if num_seqs == 0:
        return
    num_heads, head_dim, num_kv_heads, block_size = _shapes(q, layer_cache, block_tables, out)
    assert num_splits >= 1 and num_splits & (num_splits - 1) == 0
    group = num_heads // num_kv_heads
    block_d = _dim(head_dim)
    parts = (num_seqs, num_heads, num_splits) if num_splits > 1 else (0, 0, 0)  # 1 split writes `out`
    part_out = torch.empty((*parts, block_d), dtype=torch.float32, device=q.device)
    part_lse = torch.empty(parts, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, layer_cache, block_tables, context_lens, rows, part_out, part_lse, out, scale * kv_scale[0], kv_scale[1],
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), layer_cache.stride(0), layer_cache.stride(2),
        layer_cache.stride(3), block_tables.stride(0), BLOCK_SIZE=block_size, GROUP=group, BLOCK_G=_dim(group),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=DECODE_BLOCK_N, NUM_SPLITS=num_splits,
        PRECISION=_precision(q.dtype), num_warps=4)
    if num_splits == 1:
        return
    _merge_splits_kernel[(num_seqs, num_heads)](
        part_out, part_lse, rows, out, out.stride(0), out.stride(1), HEAD_DIM=head_dim, BLOCK_D=block_d,
        NUM_SPLITS=num_splits, num_warps=4)


@triton.jit
def _prefix_kernel(q_ptr, cache_ptr, tables_ptr, lens_ptr, starts_ptr, ends_ptr, out_ptr, scale, v_scale,
                   stride_qt, stride_qh, stride_ot, stride_oh, stride_kv, stride_slot, stride_head, stride_table,
                   BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    # rows: BLOCK_M // BLOCK_G query tokens x the KV head's BLOCK_G query heads (past GROUP: padding)
    tile, seq, kv_head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    tokens_per_tile: tl.constexpr = BLOCK_M // BLOCK_G
    q_start = tl.load(starts_ptr + seq).to(tl.int64)
    q_len = tl.load(ends_ptr + seq).to(tl.int64) - q_start
    context_len = tl.load(lens_ptr + seq).to(tl.int64)
    first_query = tile * tokens_per_tile
    rows = tl.arange(0, BLOCK_M)
    offsets = first_query + rows // BLOCK_G  # each row's query token in the span
    heads = kv_head * GROUP + rows % BLOCK_G
    valid = (offsets < q_len) & (rows % BLOCK_G < GROUP)
    positions = context_len - q_len + offsets  # each row's absolute position
    dims = tl.arange(0, BLOCK_D)
    d_mask = dims < HEAD_DIM
    q = tl.load(q_ptr + (q_start + offsets)[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=valid[:, None] & d_mask[None, :], other=0.0)  # the model's dtype
    # keys up to this tile's last query; none for a tile past the span's end
    kv_end = tl.where(first_query < q_len,
                      tl.minimum(context_len, context_len - q_len + first_query + tokens_per_tile), 0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = tables_ptr + seq.to(tl.int64) * stride_table
    head_base = cache_ptr + kv_head * stride_head
    for first in range(0, kv_end, BLOCK_N):
        tokens = first + tl.arange(0, BLOCK_N)
        inside = tokens < kv_end
        blocks = tl.load(table + tokens // BLOCK_SIZE, mask=inside, other=0).to(tl.int64)
        slots = blocks * BLOCK_SIZE + tokens % BLOCK_SIZE
        keys = tl.load(head_base + slots[None, :] * stride_slot + dims[:, None],
                       mask=inside[None, :] & d_mask[:, None], other=0.0).to(q.dtype)  # an FP8 pool's too
        scores = tl.dot(q, keys, input_precision=PRECISION) * scale
        seen = inside[None, :] & (tokens[None, :] <= positions[:, None])
        scores = tl.where(seen, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        values = tl.load(head_base + stride_kv + slots[:, None] * stride_slot + dims[None, :],
                         mask=inside[:, None] & d_mask[None, :], other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), values, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    out = acc * v_scale / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + (q_start + offsets)[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=valid[:, None] & d_mask[None, :])


def prefix_attention(q: torch.Tensor, layer_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor, out: torch.Tensor, *,
                     max_query_len: int, scale: float, kv_scale: KVScale = UNSCALED) -> None:
    """Sequence s's queries are rows [starts[s], ends[s]) of q (its newest tokens, their K/V
    already in the pool); they attend causally to its context_lens[s] tokens through
    block_tables[s]. Writes those rows of out. max_query_len: the longest span (the grid)."""
    num_seqs = starts.shape[0]
    if num_seqs == 0:
        return
    num_heads, head_dim, num_kv_heads, block_size = _shapes(q, layer_cache, block_tables, out)
    group = num_heads // num_kv_heads
    block_g, (block_m, block_n) = triton.next_power_of_2(group), PREFIX_TILES[q.dtype.itemsize]
    assert block_g <= block_m, f"{group} query heads a KV head: more than a tile's {block_m} rows"
    grid = (triton.cdiv(max_query_len, block_m // block_g), num_seqs, num_kv_heads)
    _prefix_kernel[grid](
        q, layer_cache, block_tables, context_lens, starts, ends, out, scale * kv_scale[0], kv_scale[1], q.stride(0),
        q.stride(1), out.stride(0), out.stride(1), layer_cache.stride(0), layer_cache.stride(2), layer_cache.stride(3),
        block_tables.stride(0), BLOCK_SIZE=block_size, GROUP=group, BLOCK_G=block_g, HEAD_DIM=head_dim,
        BLOCK_D=_dim(head_dim), BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=_precision(q.dtype),
        num_warps=PREFIX_WARPS)
