"""Compiles the Triton kernels (model/triton_attention.py) for Hopper (sm_90) without a GPU, in
bfloat16 and float32, at the engine's launch configurations: what Triton's interpreter does not
check (types, layouts, shared memory). Run by tests/test_triton_attention.py in a process without
TRITON_INTERPRET; prints one line per kernel."""

from __future__ import annotations

import os
from typing import Any

assert os.environ.get("TRITON_INTERPRET") != "1", "compiles real kernels: run without TRITON_INTERPRET"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from pdserve.model import triton_attention as ta  # noqa: E402


def compile_for_hopper(fn: Any, signature: dict[str, str], constants: dict[str, Any]) -> None:
    signature = {**signature, **dict.fromkeys(constants, "constexpr")}
    source = ASTSource(fn=fn, signature=signature,
                       constexprs={(fn.arg_names.index(name),): value for name, value in constants.items()})
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    print(f"{fn.__name__} {constants.get('PRECISION', '')} shared {kernel.metadata.shared} bytes")


def main() -> None:
    qwen3_8b = {"BLOCK_SIZE": 16, "GROUP": 4, "HEAD_DIM": 128, "BLOCK_D": 128}
    ints = dict.fromkeys(("stride_qt", "stride_qh", "stride_slot", "stride_head", "stride_table"), "i32")
    for dtype, precision in (("bf16", "tf32"), ("fp32", "ieee")):
        compile_for_hopper(ta._decode_split_kernel, {
            "q_ptr": f"*{dtype}", "cache_ptr": f"*{dtype}", "tables_ptr": "*i32", "lens_ptr": "*i32",
            "rows_ptr": "*i32", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "scale": "fp32", "stride_kv": "i64",
            **ints},
            {**qwen3_8b, "BLOCK_G": 16, "BLOCK_N": ta.DECODE_BLOCK_N, "NUM_SPLITS": 4, "PRECISION": precision})
        compile_for_hopper(ta._prefix_kernel, {
            "q_ptr": f"*{dtype}", "cache_ptr": f"*{dtype}", "tables_ptr": "*i32", "lens_ptr": "*i32",
            "starts_ptr": "*i32", "ends_ptr": "*i32", "out_ptr": f"*{dtype}", "scale": "fp32", "stride_ot": "i32",
            "stride_oh": "i32", "stride_kv": "i64", **ints},
            {**qwen3_8b, "BLOCK_M": ta.PREFIX_BLOCK_M, "BLOCK_N": ta.PREFIX_BLOCK_N, "PRECISION": precision})
    compile_for_hopper(ta._merge_splits_kernel, {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "rows_ptr": "*i32",
                                                 "out_ptr": "*bf16", "stride_ot": "i32", "stride_oh": "i32"},
                       {"HEAD_DIM": 128, "BLOCK_D": 128, "NUM_SPLITS": 1})
    compile_for_hopper(ta._store_kv_kernel, {
        "k_ptr": "*bf16", "v_ptr": "*bf16", "cache_ptr": "*bf16", "slot_ptr": "*i32", "stride_kt": "i32",
        "stride_kh": "i32", "stride_vt": "i32", "stride_vh": "i32", "stride_kv": "i64", "stride_slot": "i32",
        "stride_head": "i32"}, {"NUM_KV_HEADS": 8, "HEAD_DIM": 128, "BLOCK_H": 8, "BLOCK_D": 128})


if __name__ == "__main__":
    main()
