"""The attention kernels alone, as the GPU check times them first: the split-KV decode kernel in
GB/s of KV read (bf16, head_dim 128, GQA 4, block size 16; an FP8 pool too where the device has
float8), and the prefix kernel (a query chunk over a cached context, and a fresh prompt, which it
attends too) in TFLOPS against SDPA on the same K/V gathered (masked; causal, flash, for the fresh
prompt); each checked against SDPA before it is timed. One table; `--save` writes it as JSON.

    python -m pdserve.bench.gpu_kernels [--decode 1x4096,64x4096,1x32768,64x32768] [--prefix 2048x16384,2048x2048]
    python -m pdserve.bench.gpu_kernels --smoke    # tiny shapes on CPU (Triton's interpreter): the code runs
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from pdserve.bench.common import hardware_line, print_table
from pdserve.model import triton_attention as kernels

_BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class KernelResult:
    kernel: str
    shape: str
    ms: float
    rate: float  # GB/s (decode) or TFLOPS (prefix)
    unit: str
    max_error: float  # against SDPA


@dataclass(frozen=True, slots=True)
class Shape:
    num_kv_heads: int = 8
    group: int = 4  # query heads per KV head
    head_dim: int = 128
    dtype: torch.dtype = torch.bfloat16


def _timed(fn: Callable[[], None], device: torch.device, repeats: int) -> float:
    """Mean ms of `fn` after one warm-up (the compile)."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / repeats
    began = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - began) * 1e3 / repeats


def _pool(num_blocks: int, s: Shape, device: torch.device, pool_dtype: torch.dtype) -> torch.Tensor:
    pool = torch.randn(2, num_blocks, _BLOCK_SIZE, s.num_kv_heads, s.head_dim, device=device, dtype=s.dtype)
    return pool.to(pool_dtype)


def _gather(pool: torch.Tensor, table: torch.Tensor, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """K, V of one sequence as [kv_heads, length, dim]."""
    k, v = (pool[i][table].reshape(-1, *pool.shape[3:])[:length].to(dtype).transpose(0, 1) for i in (0, 1))
    return k, v


def decode(batch: int, context: int, s: Shape, device: torch.device, repeats: int,
           pool_dtype: torch.dtype | None = None) -> KernelResult:
    pool_dtype = pool_dtype or s.dtype
    blocks_per_seq = -(-context // _BLOCK_SIZE)
    pool = _pool(batch * blocks_per_seq + 1, s, device, pool_dtype)
    tables = (torch.randperm(batch * blocks_per_seq, device=device) + 1).view(batch, blocks_per_seq).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    rows = torch.arange(batch, dtype=torch.int32, device=device)
    q = torch.randn(batch, s.num_kv_heads * s.group, s.head_dim, device=device, dtype=s.dtype)
    out = torch.empty_like(q)
    scale = s.head_dim ** -0.5
    splits = 1 if batch * s.num_kv_heads >= 256 else 8

    def run() -> None:
        kernels.decode_attention(q, pool, tables, lens, rows, out, scale=scale, num_splits=splits)

    run()
    k, v = _gather(pool, tables[0].long(), context, s.dtype)
    expected = F.scaled_dot_product_attention(q[0][:, None].float(), k.float(), v.float(), scale=scale,
                                              enable_gqa=True)[:, 0]
    error = float((out[0].float() - expected).abs().max())
    ms = _timed(run, device, repeats)
    kv_bytes = batch * context * 2 * s.num_kv_heads * s.head_dim * pool.element_size()
    name = "decode" if pool_dtype == s.dtype else f"decode {str(pool_dtype).removeprefix('torch.')}"
    return KernelResult(name, f"{batch}x{context}", ms, kv_bytes / ms / 1e6, "GB/s", error)


def prefix(query_len: int, context: int, s: Shape, device: torch.device, repeats: int) -> list[KernelResult]:
    """One sequence's last `query_len` tokens over its `context` (their K/V already in the pool)."""
    blocks = -(-context // _BLOCK_SIZE)
    pool = _pool(blocks + 1, s, device, s.dtype)
    table = (torch.arange(blocks, device=device) + 1).to(torch.int32)[None]
    lens = torch.tensor([context], dtype=torch.int32, device=device)
    starts = torch.tensor([0], dtype=torch.int32, device=device)
    ends = torch.tensor([query_len], dtype=torch.int32, device=device)
    q = torch.randn(query_len, s.num_kv_heads * s.group, s.head_dim, device=device, dtype=s.dtype)
    out = torch.empty_like(q)
    scale = s.head_dim ** -0.5
    k, v = _gather(pool, table[0].long(), context, s.dtype)
    # query i sits at position context - query_len + i: it sees keys up to there
    mask = (torch.arange(context, device=device)[None, :]
            <= torch.arange(context - query_len, context, device=device)[:, None])

    def run() -> None:
        kernels.prefix_attention(q, pool, table, lens, starts, ends, out, max_query_len=query_len, scale=scale)

    fresh = query_len == context  # a fresh prompt: what SDPA's flash path took before the prefix kernel did

    def reference() -> torch.Tensor:
        return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=None if fresh else mask,
                                              is_causal=fresh, scale=scale, enable_gqa=True).transpose(0, 1)

    run()
    error = float((out.float() - reference().float()).abs().max())
    flops = 4.0 * query_len * (context - query_len / 2) * s.num_kv_heads * s.group * s.head_dim
    def run_reference() -> None:
        reference()

    ms, ref_ms = _timed(run, device, repeats), _timed(run_reference, device, repeats)
    shape = f"{query_len}x{context}"
    return [KernelResult("prefix", shape, ms, flops / ms / 1e9, "TFLOPS", error),
            KernelResult("sdpa (causal)" if fresh else "sdpa (masked)", shape, ref_ms, flops / ref_ms / 1e9, "TFLOPS",
                         0.0)]


def _fp8_dtype(device: torch.device) -> torch.dtype | None:
    """float8 where the GPU computes with it (sm_89+); the kernels read FP8 pools."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        return None
    return getattr(torch, "float8_e4m3fn", None)


def _pairs(text: str) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in (p.split("x") for p in text.split(",") if p)]


def main(argv: list[str] | None = None) -> list[KernelResult]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decode", default="1x4096,64x4096,1x32768,64x32768", help="batch x context, comma-separated")
    parser.add_argument("--prefix", default="2048x16384,2048x2048",
                        help="query chunk x context, comma-separated (equal: a fresh prompt, against causal SDPA)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (Triton's interpreter)")
    parser.add_argument("--save", default=None, help="write the table as JSON here")
    args = parser.parse_args(argv)
    if args.smoke:
        device, shape = torch.device("cpu"), Shape(num_kv_heads=2, group=2, head_dim=32, dtype=torch.float32)
        decodes, prefixes, repeats = [(2, 40)], [(8, 24), (8, 8)], 1
    else:
        device, shape = torch.device("cuda"), Shape()
        decodes, prefixes, repeats = _pairs(args.decode), _pairs(args.prefix), args.repeats
    torch.manual_seed(0)
    results = [decode(b, c, shape, device, repeats) for b, c in decodes]
    fp8 = _fp8_dtype(device)
    if fp8 is not None:  # the FP8 pool, read in the kernel, at the batch-64 shapes
        results += [decode(b, c, shape, device, repeats, fp8) for b, c in decodes if b >= 64]
    for query_len, context in prefixes:
        results += prefix(query_len, context, shape, device, repeats)
    print(hardware_line())
    print(f"kv heads {shape.num_kv_heads}, GQA {shape.group}, head_dim {shape.head_dim}, {shape.dtype}, "
          f"block size {_BLOCK_SIZE}; max error against SDPA in float32")
    print_table(["kernel", "shape", "ms", "rate", "max error"],
                [[r.kernel, r.shape, f"{r.ms:.3f}", f"{r.rate:.1f} {r.unit}", f"{r.max_error:.2e}"] for r in results])
    if args.save:
        with open(args.save, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)
    return results


if __name__ == "__main__":
    main()
