"""A decoder layer's math besides its GEMMs and attention: the residual add and RMSNorm, Qwen3's
QK-norm and rotary embedding, SiLU-and-mul. Two implementations, chosen like attention backends by
the step's metadata type (model/attention_backend.py), so the model (qwen3.py) has one code path:

    TorchLayerOps   CPU (torch's attention backend): torch ops in transformers' order and dtypes, so
                    greedy tokens equal transformers' on the same weights
    TritonLayerOps  the Triton backend (CUDA): one fused kernel each (model/triton_fused.py), about
                    a fifth of the kernels in a decode layer (tests/test_kernel_count.py)

`RopeRows` is the step's cos/sin rows, gathered once a step (not once a layer) by the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from pdserve.model.attention_backend import PagedMetadata, StepMetadata


@dataclass(frozen=True, slots=True)
class RopeRows:
    """cos and sin [num_tokens, head_dim] in the model's dtype: each new token's row of the tables."""

    cos: torch.Tensor
    sin: torch.Tensor


class LayerOps(Protocol):
    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(residual + x) * weight, residual + x); without a residual, of x alone."""
        ...

    def qk_norm_rope(self, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                     eps: float, rope: RopeRows) -> tuple[torch.Tensor, torch.Tensor]:
        """q [tokens, heads, head_dim], k [tokens, kv_heads, head_dim]: each head RMS-normalised
        times its weight, then rotated by its token's row."""
        ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """[tokens, 2 * size] gate|up -> silu(gate) * up [tokens, size]."""
        ...


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen3RMSNorm: float32 statistics, cast back before the weight."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class TorchLayerOps:
    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        total = x if residual is None else residual + x
        return rms_norm(total, weight, eps), total

    def qk_norm_rope(self, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                     eps: float, rope: RopeRows) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
        cos, sin = rope.cos[:, None, :], rope.sin[:, None, :]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.split(x.shape[-1] // 2, dim=-1)
        return F.silu(gate) * up


class TritonLayerOps:
    """Direct launches when eager; the custom ops (`torch.ops.pdserve.*`) under torch.compile."""

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        from pdserve.model import triton_fused as kernels

        if torch.compiler.is_compiling():
            return torch.ops.pdserve.add_rms_norm(x, residual, weight, eps)
        return kernels.add_rms_norm(x, residual, weight, eps)

    def qk_norm_rope(self, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                     eps: float, rope: RopeRows) -> tuple[torch.Tensor, torch.Tensor]:
        from pdserve.model import triton_fused as kernels

        if torch.compiler.is_compiling():
            return torch.ops.pdserve.qk_norm_rope(q, k, q_weight, k_weight, eps, rope.cos, rope.sin)
        return kernels.qk_norm_rope(q, k, q_weight, k_weight, eps, rope.cos, rope.sin)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        from pdserve.model import triton_fused as kernels

        if torch.compiler.is_compiling():
            return torch.ops.pdserve.silu_and_mul(x)
        return kernels.silu_and_mul(x)


TORCH_OPS = TorchLayerOps()
TRITON_OPS = TritonLayerOps()


def layer_ops(meta: StepMetadata) -> LayerOps:
    """The implementation that goes with this step's attention backend."""
    return TRITON_OPS if isinstance(meta, PagedMetadata) else TORCH_OPS
