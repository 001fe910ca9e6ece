"""The fused layer kernels (model/triton_fused.py) against the torch ops they replace
(model/layer_ops.py `TorchLayerOps`, transformers' math). Without a GPU they run in Triton's
interpreter (`TRITON_INTERPRET=1`), in float32 and float16 (bfloat16 arithmetic is wrong in the
interpreter); with one, compiled, bfloat16 too. Head dims 32 (the demo models) and 128 (Qwen3's);
inputs as the model hands them over: strided views of a fused projection."""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # NOTE: before triton is imported, here or by pdserve

triton = pytest.importorskip("triton")
from pdserve.model import triton_fused as tf  # noqa: E402
from pdserve.model.layer_ops import TORCH_OPS, RopeRows  # noqa: E402
from pdserve.model.rope import RopeConfig  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.float32, torch.float16, *([torch.bfloat16] if CUDA else [])]
# float32: the mean's summation order; 16-bit: a value next to a rounding boundary may land one ulp away
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
EPS = 1e-6


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_kernels_run_in_the_interpreter_without_a_gpu() -> None:
    from triton.runtime.interpreter import InterpretedFunction

    kernels = (tf._add_rms_norm_kernel, tf._qk_norm_rope_kernel, tf._silu_and_mul_kernel)
    assert all(isinstance(k, InterpretedFunction) != CUDA for k in kernels)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 100, 1024])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_torch(dtype: torch.dtype, hidden: int, with_residual: bool) -> None:
    wide = _randn(5, hidden + 8, dtype=dtype, seed=1)
    x = wide[:, 3:3 + hidden]  # a strided view, as an attention output's rows need not be
    residual = _randn(5, hidden, dtype=dtype, seed=2) * 4 if with_residual else None
    weight = (1 + 0.1 * _randn(hidden, dtype=torch.float32, seed=3)).to(dtype)
    out, total = tf.add_rms_norm(x, residual, weight, EPS)
    want_out, want_total = TORCH_OPS.add_rms_norm(x, residual, weight, EPS)
    assert torch.equal(total, want_total)  # the residual stream: the same rounding as torch's add
    _close(out, want_out, dtype)


def _rope_rows(positions: list[int], head_dim: int, dtype: torch.dtype) -> RopeRows:
    cos, sin = RopeConfig("default", 1_000_000.0).tables(head_dim, 4096, 4096)
    index = torch.tensor(positions)
    return RopeRows(cos[index].to(DEVICE, dtype), sin[index].to(DEVICE, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("head_dim", "num_heads", "num_kv_heads"), [(32, 4, 2), (128, 8, 2), (128, 6, 1),
                                                                    (64, 3, 3)])
def test_qk_norm_rope_matches_torch(dtype: torch.dtype, head_dim: int, num_heads: int, num_kv_heads: int) -> None:
    positions = [0, 1, 17, 300, 4095]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = _randn(len(positions), q_size + 2 * kv_size, dtype=dtype, seed=4) * 3
    q_flat, k_flat, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k = q_flat.reshape(-1, num_heads, head_dim), k_flat.reshape(-1, num_kv_heads, head_dim)
    q_weight = (1 + 0.2 * _randn(head_dim, dtype=torch.float32, seed=5)).to(dtype)
    k_weight = (1 + 0.2 * _randn(head_dim, dtype=torch.float32, seed=6)).to(dtype)
    rope = _rope_rows(positions, head_dim, dtype)
    got_q, got_k = tf.qk_norm_rope(q, k, q_weight, k_weight, EPS, rope.cos, rope.sin)
    want_q, want_k = TORCH_OPS.qk_norm_rope(q, k, q_weight, k_weight, EPS, rope)
    assert got_q.is_contiguous() and got_k.is_contiguous()
    _close(got_q, want_q, dtype)
    _close(got_k, want_k, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [128, 3000])  # one program a row; three, the last one partial
def test_silu_and_mul_matches_torch(dtype: torch.dtype, size: int) -> None:
    gate_up = _randn(3, 2 * size, dtype=dtype, seed=7) * 4
    _close(tf.silu_and_mul(gate_up), TORCH_OPS.silu_and_mul(gate_up), dtype)


def test_the_custom_ops_are_the_kernels_and_their_fakes_have_their_shapes() -> None:
    """What torch.compile traces (the ops) computes what eager launches (the kernels)."""
    x, residual = _randn(4, 64, dtype=torch.float32, seed=8), _randn(4, 64, dtype=torch.float32, seed=9)
    weight = torch.ones(64, device=DEVICE)
    q, k = _randn(4, 4, 32, dtype=torch.float32, seed=10), _randn(4, 2, 32, dtype=torch.float32, seed=11)
    rope = _rope_rows([1, 2, 3, 4], 32, torch.float32)
    cases = [(torch.ops.pdserve.add_rms_norm, tf.add_rms_norm, (x, residual, weight, EPS)),
             (torch.ops.pdserve.add_rms_norm, tf.add_rms_norm, (x, None, weight, EPS)),
             (torch.ops.pdserve.qk_norm_rope, tf.qk_norm_rope, (q, k, weight[:32], weight[:32], EPS, rope.cos,
                                                                rope.sin)),
             (torch.ops.pdserve.silu_and_mul, tf.silu_and_mul, (torch.cat([x, residual], 1),))]
    for op, kernel, args in cases:
        got, want = op(*args), kernel(*args)
        for g, w in zip(got if isinstance(got, tuple | list) else [got], want if isinstance(want, tuple) else [want],
                        strict=True):
            assert torch.equal(g, w)
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
