"""The CUDA backend's Triton kernels (model/triton_attention.py) against a torch reference. Without
a GPU, Triton's interpreter runs them on CPU tensors (`TRITON_INTERPRET=1`, set before triton is
imported; the first test checks that it is really the interpreter), in float32 and float16:
bfloat16 arithmetic is wrong in the interpreter. With one (scripts/device_check.sh, stage
`floor`), compiled on CUDA tensors, bfloat16 too.

Cases: block tables of many shapes (adjacent, scattered, reversed, one block), block sizes 1 to
16, GQA ratios 1/2/4/8, contexts ending mid-block, split-KV with 1 and several splits (more
splits than a short context has tiles too), prefill over a cached prefix with and without one;
head dims 32 and 128 (Qwen3's), a 32K context at 16 splits, a pool of more than 2**31 elements
(GPU only: 4.3 GB); FP8 pools (float8_e4m3fn and float8_e5m2, per-layer scales) read
and written by the kernels against torch's quantize/dequantize (model/kv_scales.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # NOTE: before triton is imported, here or by pdserve

triton = pytest.importorskip("triton")
from pdserve.model import triton_attention as ta  # noqa: E402
from pdserve.model.kv_scales import dequantize, quantize  # noqa: E402

HEAD_DIM = 32
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.float32, torch.float16, *([torch.bfloat16] if CUDA else [])]
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
if CUDA:
    TOLERANCE[torch.float32] = 2e-4  # NOTE: torch's reference on CUDA may multiply in TF32


def test_kernels_run_in_the_interpreter_without_a_gpu() -> None:
    from triton.runtime.interpreter import InterpretedFunction

    kernels = (ta._decode_split_kernel, ta._merge_splits_kernel, ta._prefix_kernel, ta._store_kv_kernel)
    assert all(isinstance(k, InterpretedFunction) != CUDA for k in kernels)


def _ints(values: list[int] | list[list[int]]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
KV_SCALE = (0.5, 3.0)  # an FP8 pool's (k_scale, v_scale): neither 1.0, and not the same


def _pool(num_blocks: int, block_size: int, num_kv_heads: int, dtype: torch.dtype, seed: int = 0,
          head_dim: int = HEAD_DIM, kv_scale: ta.KVScale = ta.UNSCALED) -> torch.Tensor:
    """Random K/V; an FP8 pool holds them quantized with `kv_scale`, as the engine's writes do."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn((2, num_blocks, block_size, num_kv_heads, head_dim), generator=gen).to(DEVICE)
    return torch.stack([quantize(values[i], dtype, kv_scale[i]) for i in (0, 1)])


def _context(pool: torch.Tensor, table: list[int], context_len: int, kv_scale: ta.KVScale = ta.UNSCALED
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """keys, values [kv_heads, context_len, dim] in float32, read through the table (and dequantized)."""
    num_kv_heads, head_dim = pool.shape[3:]
    ids = torch.tensor(table, device=DEVICE)
    keys = dequantize(pool[0][ids], torch.float32, kv_scale[0]).reshape(-1, num_kv_heads, head_dim)[:context_len]
    values = dequantize(pool[1][ids], torch.float32, kv_scale[1]).reshape(-1, num_kv_heads, head_dim)[:context_len]
    return keys.transpose(0, 1), values.transpose(0, 1)


def _reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
               scale: float) -> torch.Tensor:
    """q [n, heads, dim] at absolute positions; causal over keys [kv_heads, ctx, dim]."""
    mask = torch.arange(keys.shape[1], device=DEVICE)[None, :] <= positions.to(DEVICE)[:, None]
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1), keys, values, attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out.transpose(0, 1)


def _tables(block_size: int, lens: list[int], shapes: str, num_blocks: int) -> list[list[int]]:
    """Disjoint tables of each context's block count: 'adjacent', 'scattered' or 'reversed'."""
    counts = [-(-n // block_size) for n in lens]
    ids = list(range(num_blocks))
    if shapes == "scattered":
        gen = torch.Generator().manual_seed(sum(lens))
        ids = torch.randperm(num_blocks, generator=gen).tolist()
    elif shapes == "reversed":
        ids = ids[::-1]
    tables, at = [], 0
    for count in counts:
        tables.append(ids[at:at + count])
        at += count
    assert at <= num_blocks
    return tables


# (block size, kv heads, GQA ratio, context lengths, table shapes, splits)
DECODE_CASES = [
    (16, 2, 1, [1, 16, 17, 100], "adjacent", 1),
    (16, 2, 2, [5, 33, 130], "scattered", 4),
    (4, 1, 4, [3, 4, 9, 70, 200], "reversed", 2),
    (8, 2, 8, [8, 61, 129], "scattered", 8),
    (1, 2, 4, [1, 2, 40], "scattered", 2),  # one token a block
    (16, 1, 2, [300], "scattered", 16),  # one long context, many splits
    (16, 4, 1, [2], "adjacent", 4),  # more splits than tiles: empty splits merge to nothing
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("block_size", "num_kv_heads", "group", "lens", "shapes", "splits"), DECODE_CASES)
def test_decode_matches_reference(dtype: torch.dtype, block_size: int, num_kv_heads: int, group: int,
                                  lens: list[int], shapes: str, splits: int) -> None:
    _check_decode(dtype, block_size, num_kv_heads, group, lens, shapes, splits)


# at Qwen3's head dim: a 4K context at 16 splits (Qwen3-8B's batch-1 split count), GQA 4, one split
DECODE_CASES_128 = [(16, 1, 4, [4000], "scattered", 16), (16, 2, 4, [1, 77, 130], "adjacent", 1)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("block_size", "num_kv_heads", "group", "lens", "shapes", "splits"), DECODE_CASES_128)
def test_decode_at_head_dim_128(dtype: torch.dtype, block_size: int, num_kv_heads: int, group: int,
                                lens: list[int], shapes: str, splits: int) -> None:
    _check_decode(dtype, block_size, num_kv_heads, group, lens, shapes, splits, head_dim=128)


def test_decode_of_a_32k_context_at_16_splits() -> None:
    """Qwen3-8B's batch-1 decode at 32K: 16 splits of 2K tokens, each many tiles."""
    _check_decode(torch.float16, 16, 1, 4, [32760], "scattered", 16, head_dim=128)


@pytest.mark.skipif(not CUDA, reason="a 4.3 GB pool")
def test_decode_and_prefix_read_blocks_past_2_to_the_31_elements_of_the_pool() -> None:
    """One layer's pool of more than 2**31 elements, the context in its last blocks: every slot
    offset is computed in 64 bits."""
    block_size, num_kv_heads, head_dim = 16, 8, 128
    num_blocks = 2**31 // (2 * block_size * num_kv_heads * head_dim) + 8
    pool = torch.empty((2, num_blocks, block_size, num_kv_heads, head_dim), dtype=torch.bfloat16, device=DEVICE)
    assert pool.numel() > 2**31
    table = list(range(num_blocks - 6, num_blocks))
    pool[:, table] = torch.randn((2, 6, block_size, num_kv_heads, head_dim), device=DEVICE).to(torch.bfloat16)
    context_len, num_new = 90, 10
    q = torch.randn((num_new, num_kv_heads * 4, head_dim), device=DEVICE).to(torch.bfloat16)
    keys, values = _context(pool, table, context_len)
    lens = _ints([context_len])
    decode_out, prefix_out = torch.empty_like(q), torch.empty_like(q)
    ta.decode_attention(q, pool, _ints([table]), lens, _ints([num_new - 1]), decode_out, scale=0.1, num_splits=4)
    ta.prefix_attention(q, pool, _ints([table]), lens, _ints([0]), _ints([num_new]), prefix_out,
                        max_query_len=num_new, scale=0.1)
    expected = _reference(q, keys, values, torch.arange(context_len - num_new, context_len), 0.1)
    tol = TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(prefix_out.float(), expected, atol=tol, rtol=tol)
    torch.testing.assert_close(decode_out[-1:].float(), expected[-1:], atol=tol, rtol=tol)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize(("head_dim", "dtype", "splits"), [(32, torch.float32, 1), (32, torch.float16, 4),
                                                           (128, torch.float32, 2)])
def test_decode_reads_an_fp8_pool_with_its_layer_scales(fp8: torch.dtype, head_dim: int, dtype: torch.dtype,
                                                        splits: int) -> None:
    _check_decode(dtype, 16, 2, 2, [5, 33, 130], "scattered", splits, head_dim=head_dim, pool_dtype=fp8,
                  kv_scale=KV_SCALE)


def _check_decode(dtype: torch.dtype, block_size: int, num_kv_heads: int, group: int, lens: list[int], shapes: str,
                  splits: int, head_dim: int = HEAD_DIM, pool_dtype: torch.dtype | None = None,
                  kv_scale: ta.KVScale = ta.UNSCALED) -> None:
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    pool = _pool(num_blocks, block_size, num_kv_heads, pool_dtype or dtype, head_dim=head_dim, kv_scale=kv_scale)
    tables = _tables(block_size, lens, shapes, num_blocks)
    width = max(len(t) for t in tables) + 2  # wider than any table: the kernel reads only what the length covers
    padded = torch.tensor([t + [num_blocks + 99] * (width - len(t)) for t in tables], dtype=torch.int32,
                          device=DEVICE)
    num_heads, num_rows = num_kv_heads * group, 2 * len(lens) + 1
    rows = torch.tensor([2 * i + 1 for i in range(len(lens))], dtype=torch.int32, device=DEVICE)  # rows in between
    gen = torch.Generator().manual_seed(1)
    q = torch.randn((num_rows, num_heads, head_dim), generator=gen).to(DEVICE, dtype)
    out = torch.full_like(q, 7.0)
    scale = head_dim**-0.5
    ta.decode_attention(q, pool, padded, _ints(lens), rows, out, scale=scale, num_splits=splits, kv_scale=kv_scale)
    for i, (table, n) in enumerate(zip(tables, lens, strict=True)):
        keys, values = _context(pool, table, n, kv_scale)
        row = int(rows[i])
        expected = _reference(q[row:row + 1], keys, values, torch.tensor([n - 1]), scale)
        torch.testing.assert_close(out[row:row + 1].float(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    untouched = [r for r in range(num_rows) if r not in rows.tolist()]
    assert (out[untouched] == 7.0).all()


def test_decode_splits_agree() -> None:
    """1 split and 8 splits give the same output (log-sum-exp merge), up to float rounding."""
    pool = _pool(40, 8, 2, torch.float32)
    tables = _ints([list(range(0, 20)), list(range(39, 19, -1))])
    lens, rows = _ints([155, 97]), _ints([0, 1])
    q = torch.randn((2, 8, HEAD_DIM), device=DEVICE)
    one, eight = torch.empty_like(q), torch.empty_like(q)
    ta.decode_attention(q, pool, tables, lens, rows, one, scale=0.2, num_splits=1)
    ta.decode_attention(q, pool, tables, lens, rows, eight, scale=0.2, num_splits=8)
    torch.testing.assert_close(one, eight, atol=1e-5, rtol=1e-5)


# (block size, kv heads, GQA ratio, [(cached tokens, new tokens)], table shapes)
PREFIX_CASES = [
    (16, 2, 2, [(16, 5), (0, 40), (33, 1)], "scattered"),  # a block-aligned prefix, none, a decode-like row
    (4, 1, 4, [(7, 13), (30, 36)], "reversed"),  # prefixes ending mid-block; a span over several query tiles
    (8, 2, 8, [(50, 9)], "scattered"),
    (16, 4, 1, [(100, 70), (3, 2)], "adjacent"),
    # a tile's rows are its tokens x a KV head's query heads: 5 heads pad to 8 (Qwen3-14B's 40 over 8)
    (16, 2, 5, [(20, 40), (0, 3)], "scattered"),
    (8, 1, 1, [(10, 300)], "reversed"),  # one head a KV head: tiles of 128 tokens (3; float32: 64, 5)
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("block_size", "num_kv_heads", "group", "spans", "shapes"), PREFIX_CASES)
def test_prefix_prefill_matches_reference(dtype: torch.dtype, block_size: int, num_kv_heads: int, group: int,
                                          spans: list[tuple[int, int]], shapes: str) -> None:
    _check_prefix(dtype, block_size, num_kv_heads, group, spans, shapes)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefix_prefill_at_head_dim_128(dtype: torch.dtype) -> None:
    _check_prefix(dtype, 16, 2, 4, [(70, 40), (0, 9)], "scattered", head_dim=128)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize(("head_dim", "dtype"), [(32, torch.float32), (32, torch.float16), (128, torch.float32)])
def test_prefix_prefill_reads_an_fp8_pool_with_its_layer_scales(fp8: torch.dtype, head_dim: int,
                                                                dtype: torch.dtype) -> None:
    _check_prefix(dtype, 4, 1, 4, [(7, 13), (30, 36)], "reversed", head_dim=head_dim, pool_dtype=fp8,
                  kv_scale=KV_SCALE)


def _check_prefix(dtype: torch.dtype, block_size: int, num_kv_heads: int, group: int, spans: list[tuple[int, int]],
                  shapes: str, head_dim: int = HEAD_DIM, pool_dtype: torch.dtype | None = None,
                  kv_scale: ta.KVScale = ta.UNSCALED) -> None:
    lens = [cached + new for cached, new in spans]
    num_blocks = sum(-(-n // block_size) for n in lens) + 2
    pool = _pool(num_blocks, block_size, num_kv_heads, pool_dtype or dtype, seed=2, head_dim=head_dim,
                 kv_scale=kv_scale)
    tables = _tables(block_size, lens, shapes, num_blocks)
    width = max(len(t) for t in tables)
    padded = _ints([t + [0] * (width - len(t)) for t in tables])
    starts, ends, at = [], [], 3  # three rows before the first span (decodes in a mixed step)
    for _, new in spans:
        starts.append(at)
        ends.append(at + new)
        at += new
    num_heads = num_kv_heads * group
    q = torch.randn((at + 1, num_heads, head_dim), generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
    out = torch.full_like(q, 7.0)
    scale = 0.3
    ta.prefix_attention(q, pool, padded, _ints(lens), _ints(starts), _ints(ends), out,
                        max_query_len=max(new for _, new in spans), scale=scale, kv_scale=kv_scale)
    for table, n, (cached, new), start in zip(tables, lens, spans, starts, strict=True):
        keys, values = _context(pool, table, n, kv_scale)
        expected = _reference(q[start:start + new], keys, values, torch.arange(cached, n), scale)
        torch.testing.assert_close(out[start:start + new].float(), expected, atol=TOLERANCE[dtype],
                                   rtol=TOLERANCE[dtype])
    assert (out[:3] == 7.0).all() and (out[at:] == 7.0).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_writes_real_slots_only(dtype: torch.dtype) -> None:
    """Each row's K/V lands at its slot, cast to the pool's type; a -1 slot (padding) writes nothing.
    K/V come as views of a fused projection (row stride wider than the heads)."""
    pool = torch.zeros((2, 6, 4, 2, HEAD_DIM), dtype=dtype, device=DEVICE)
    fused = torch.randn((5, 3, 2, HEAD_DIM), device=DEVICE)  # q|k|v per row
    k, v = fused[:, 1], fused[:, 2]
    slots = _ints([9, -1, 0, 23, -1])
    ta.store_kv(k, v, pool, slots)
    flat = pool.view(2, -1, 2, HEAD_DIM)
    written = [0, 9, 23]
    for row, slot in ((0, 9), (2, 0), (3, 23)):
        assert torch.equal(flat[0, slot], k[row].to(dtype)) and torch.equal(flat[1, slot], v[row].to(dtype))
    others = [s for s in range(24) if s not in written]
    assert (flat[:, others] == 0).all()


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("head_dim", [32, 128])
def test_store_kv_quantizes_into_an_fp8_pool_as_torch_does(fp8: torch.dtype, head_dim: int) -> None:
    """The bytes torch's quantize (the CPU path, a hand-off's receiver) stores: every rounding case,
    subnormals, values past the format's range (clamped), zeros of both signs."""
    pool = torch.zeros((2, 6, 4, 2, head_dim), dtype=fp8, device=DEVICE)
    gen = torch.Generator().manual_seed(5)
    magnitudes = 10.0 ** torch.randint(-7, 6, (5, 3, 2, head_dim), generator=gen).float()
    fused = (torch.randn((5, 3, 2, head_dim), generator=gen) * magnitudes).to(DEVICE)
    fused[0, 1, 0, :4] = torch.tensor([0.0, -0.0, 1e9, -1e9])
    k, v = fused[:, 1], fused[:, 2]
    slots = _ints([9, -1, 0, 23, -1])
    ta.store_kv(k, v, pool, slots, kv_scale=KV_SCALE)
    flat = pool.view(2, -1, 2, head_dim).view(torch.uint8)
    for row, slot in ((0, 9), (2, 0), (3, 23)):
        assert torch.equal(flat[0, slot], quantize(k[row], fp8, KV_SCALE[0]).view(torch.uint8))
        assert torch.equal(flat[1, slot], quantize(v[row], fp8, KV_SCALE[1]).view(torch.uint8))
    others = [s for s in range(24) if s not in (0, 9, 23)]
    assert (flat[:, others] == 0).all()


@pytest.mark.skipif(CUDA, reason="with a GPU the tests above compile the kernels for it")
def test_kernels_compile_for_hopper(tmp_path: Path) -> None:
    """The interpreter checks no types or layouts: compile each kernel for sm_90 (no GPU needed)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    script = Path(__file__).with_name("triton_hopper_compile.py")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("shared") == 12, done.stdout
    # the variants a launch compiles (16-byte aligned pointers and strides): within sm_90's 227 KiB a block
    lines = [line for line in done.stdout.splitlines() if "shared" in line]
    shared = [int(line.split("shared ")[1].split()[0]) for line in lines]
    assert max(shared) <= 227 * 1024, done.stdout
    # ptxas for sm_90a: no kernel spills registers to local memory (a prefix tile too large for float32 did)
    assert all(" spilled 0 bytes" in line for line in lines), done.stdout
    # a 16-bit prefix kernel multiplies bfloat16 on Hopper's warpgroup MMA (not TF32 mma.sync on up-cast tiles)
    prefix = [line for line in lines if line.startswith("_prefix_kernel") and "*bf16" in line]
    assert len(prefix) == 2 and all(line.endswith("mma wgmma.bf16") for line in prefix), done.stdout
