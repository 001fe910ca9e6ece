"""Compiles the Triton kernels (model/triton_attention.py, model/triton_fused.py) for Hopper (sm_90) without a GPU, in
bfloat16 and float32, at the engine's launch configurations: what Triton's interpreter does not
check (types, layouts, shared memory). Run by tests/test_triton_attention.py in a process without
TRITON_INTERPRET; prints one line per kernel."""

from __future__ import annotations

import os
from typing import Any

assert os.environ.get("TRITON_INTERPRET") != "1", "compiles real kernels: run without TRITON_INTERPRET"

import re  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from pdserve.model import triton_attention as ta  # noqa: E402
from pdserve.model import triton_fused as tf  # noqa: E402

# Strides that are multiples of 16 elements at the engine's shapes (Qwen3-8B: heads x 128, kv heads x 128,
# the pool's k|v stride); a launch marks them, and every 16-byte aligned pointer, `tt.divisibility` 16, and
# compiles the variant that vectorizes on them: so does this check. NOT the block tables' row stride (a
# multiple of 4) nor a store's k/v head strides (a prefill's k and v are views of the fused QKV output).
# NOTE: the ptxas that reads the PTX version this Triton writes (its CUDA 13 one, for every arch)
_PTXAS = next(p for p in (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
                          for name in ("ptxas-blackwell", "ptxas")) if p.exists())
_DIVISIBLE = {"stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_kv", "stride_slot", "stride_head",
              "stride_x", "stride_r", "stride_o", "stride_s"}


def compile_for_hopper(fn: Any, signature: dict[str, str], constants: dict[str, Any], num_warps: int = 4) -> None:
    divisible = [name for name, kind in signature.items() if kind.startswith("*") or name in _DIVISIBLE]
    signature = {**signature, **dict.fromkeys(constants, "constexpr")}
    source = ASTSource(fn=fn, signature=signature,
                       constexprs={(fn.arg_names.index(name),): value for name, value in constants.items()},
                       attrs={(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in divisible})
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    registers, spilled = _registers(kernel.asm["ptx"])
    print(f"{fn.__name__} {constants.get('PRECISION', '')} {signature.get('q_ptr', '')} "
          f"shared {kernel.metadata.shared} bytes registers {registers} spilled {spilled} bytes "
          f"mma {_mma(kernel.asm['ptx'])}")


def _mma(ptx: str) -> str:
    """The tensor-core instructions a kernel's dots became, with their operand type, every kind
    found ('-': none), e.g. 'wgmma.bf16' (Hopper's warpgroup MMA: every dot) or 'mma.sync.tf32'."""
    found = re.findall(r"\b(wgmma\.mma_async|mma)\.sync\.aligned\.\S*?\.f32\.(\w+)\.", ptx)
    kinds = {f"{'wgmma' if op.startswith('wgmma') else 'mma.sync'}.{operand}" for op, operand in found}
    return ",".join(sorted(kinds)) or "-"


def _registers(ptx: str) -> tuple[int, int]:
    """(registers a thread, bytes spilled to local memory) as ptxas reports them for sm_90a."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.ptx"
        path.write_text(ptx)
        done = subprocess.run([_PTXAS, "-arch=sm_90a", "-v", str(path), "-o", str(path.with_suffix(".cubin"))],
                              capture_output=True, text=True, check=True)
    report = done.stdout + done.stderr
    registers = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert registers is not None and spills is not None, report
    return int(registers.group(1)), int(spills.group(1)) + int(spills.group(2))


def main() -> None:
    qwen3_8b = {"BLOCK_SIZE": 16, "GROUP": 4, "HEAD_DIM": 128, "BLOCK_D": 128}
    ints = dict.fromkeys(("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_slot", "stride_head",
                          "stride_table"), "i32")
    # (model dtype, pool dtype, precision, decode splits): a float pool, an FP8 one at 1 split (no merge)
    for dtype, pool, precision, splits in (("bf16", "bf16", "tf32", 4), ("fp32", "fp32", "ieee", 4),
                                           ("bf16", "fp8e4nv", "tf32", 1)):
        compile_for_hopper(ta._decode_split_kernel, {
            "q_ptr": f"*{dtype}", "cache_ptr": f"*{pool}", "tables_ptr": "*i32", "lens_ptr": "*i32",
            "rows_ptr": "*i32", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": f"*{dtype}",
            "scale": "fp32", "v_scale": "fp32", "stride_kv": "i64", **ints},
            {**qwen3_8b, "BLOCK_G": 16, "BLOCK_N": ta.DECODE_BLOCK_N, "NUM_SPLITS": splits, "PRECISION": precision})
        block_m, block_n = ta.PREFIX_TILES[4 if dtype == "fp32" else 2]
        compile_for_hopper(ta._prefix_kernel, {
            "q_ptr": f"*{dtype}", "cache_ptr": f"*{pool}", "tables_ptr": "*i32", "lens_ptr": "*i32",
            "starts_ptr": "*i32", "ends_ptr": "*i32", "out_ptr": f"*{dtype}", "scale": "fp32", "v_scale": "fp32",
            "stride_kv": "i64", **ints},
            {**qwen3_8b, "BLOCK_G": 4, "BLOCK_M": block_m, "BLOCK_N": block_n, "PRECISION": precision},
            num_warps=ta.PREFIX_WARPS)
    compile_for_hopper(ta._merge_splits_kernel, {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "rows_ptr": "*i32",
                                                 "out_ptr": "*bf16", "stride_ot": "i32", "stride_oh": "i32"},
                       {"HEAD_DIM": 128, "BLOCK_D": 128, "NUM_SPLITS": 4})
    for pool, fp8 in (("bf16", False), ("u8", True)):  # an FP8 pool is written as bytes
        compile_for_hopper(ta._store_kv_kernel, {
            "k_ptr": "*bf16", "v_ptr": "*bf16", "cache_ptr": f"*{pool}", "slot_ptr": "*i32", "k_scale": "fp32",
            "v_scale": "fp32", "stride_kt": "i32", "stride_kh": "i32", "stride_vt": "i32", "stride_vh": "i32",
            "stride_kv": "i64", "stride_slot": "i32", "stride_head": "i32"},
            {"NUM_KV_HEADS": 8, "HEAD_DIM": 128, "BLOCK_H": 8, "BLOCK_D": 128, "FP8": fp8,
             **ta._fp8_format(torch.float8_e4m3fn)})
    # the fused layer kernels at Qwen3-8B's shapes
    compile_for_hopper(tf._add_rms_norm_kernel, {
        "x_ptr": "*bf16", "residual_ptr": "*bf16", "weight_ptr": "*bf16", "out_ptr": "*bf16", "sum_ptr": "*bf16",
        "eps": "fp32", "stride_x": "i32", "stride_r": "i32", "stride_o": "i32", "stride_s": "i32"},
        {"HIDDEN": 4096, "BLOCK": 4096, "HAS_RESIDUAL": True})
    compile_for_hopper(tf._qk_norm_rope_kernel, {
        "q_ptr": "*bf16", "k_ptr": "*bf16", "q_weight_ptr": "*bf16", "k_weight_ptr": "*bf16", "cos_ptr": "*bf16",
        "sin_ptr": "*bf16", "q_out_ptr": "*bf16", "k_out_ptr": "*bf16", "eps": "fp32", "stride_qt": "i32",
        "stride_qh": "i32", "stride_kt": "i32", "stride_kh": "i32", "stride_cos": "i32"},
        {"NUM_HEADS": 32, "NUM_KV_HEADS": 8, "BLOCK_H": 32, "BLOCK_KV": 8, "HALF": 64, "BLOCK_HALF": 64})
    compile_for_hopper(tf._silu_and_mul_kernel, {"x_ptr": "*bf16", "out_ptr": "*bf16", "stride_x": "i32",
                                                 "stride_o": "i32"}, {"SIZE": 12288, "BLOCK": tf.SILU_BLOCK})


if __name__ == "__main__":
    main()
