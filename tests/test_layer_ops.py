"""The CPU path's layer math (model/layer_ops.py `TORCH_OPS`) gives bit for bit what transformers'
Qwen3 modules compute (Qwen3RMSNorm, rotate_half's rotary embedding, Qwen3MLP's silu(gate) * up),
in every float dtype and with norm weights of another dtype than the activations: what the greedy
tokens' equality with transformers rests on. Any rewrite (fused, in place) must not move a bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, rotate_half

from pdserve.model.layer_ops import TORCH_OPS, RopeRows, rms_norm

EPS = 1e-6
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    module = Qwen3RMSNorm(x.shape[-1], EPS)
    module.weight.data = weight
    with torch.no_grad():
        return module(x)


def _identical(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_dtype", ["same", torch.float32])
def test_rms_norm_and_add_rms_norm_are_transformers(dtype: torch.dtype, weight_dtype: object) -> None:
    torch.manual_seed(0)
    x, residual = torch.randn(9, 96, dtype=dtype), torch.randn(9, 96, dtype=dtype)
    weight = torch.randn(96, dtype=dtype if weight_dtype == "same" else weight_dtype)  # type: ignore[arg-type]
    _identical(rms_norm(x, weight, EPS), _norm(x, weight))
    out, total = TORCH_OPS.add_rms_norm(x, residual, weight, EPS)
    _identical(total, residual + x)
    _identical(out, _norm(residual + x, weight))


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_is_transformers(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    q, k = torch.randn(9, 4, 64, dtype=dtype), torch.randn(9, 2, 64, dtype=dtype)
    q_weight, k_weight = torch.randn(64, dtype=dtype), torch.randn(64, dtype=dtype)
    cos, sin = torch.randn(9, 64, dtype=dtype), torch.randn(9, 64, dtype=dtype)
    got_q, got_k = TORCH_OPS.qk_norm_rope(q, k, q_weight, k_weight, EPS, RopeRows(cos, sin))
    for got, x, weight in ((got_q, q, q_weight), (got_k, k, k_weight)):
        normed = _norm(x, weight)  # transformers: q_norm / k_norm, then apply_rotary_pos_emb
        _identical(got, normed * cos[:, None] + rotate_half(normed) * sin[:, None])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_is_transformers(dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    gate_up = torch.randn(9, 2 * 80, dtype=dtype)
    gate, up = gate_up[:, :80], gate_up[:, 80:]
    _identical(TORCH_OPS.silu_and_mul(gate_up), F.silu(gate) * up)
