"""A decoder layer's elementwise work in Triton, one kernel each (model/layer_ops.py uses them on the
CUDA backend; the CPU keeps torch's ops, model/qwen3.py's reference math):

    add_rms_norm    residual + x, then RMSNorm of the sum (vLLM's fused_add_rms_norm): returns both,
                    the sum being the next residual. Without a residual (the first layer), x's RMSNorm.
    qk_norm_rope    Qwen3's per-head RMSNorm of q and of k, then the rotary embedding of both, from
                    the step's cos/sin rows (gathered once a step: model/layer_ops.py `RopeRows`)
    silu_and_mul    silu(gate) * up of the fused gate|up projection

Each kernel replaces 6-16 torch kernels (RMSNorm alone is 8: cast, pow, mean, add, rsqrt, mul, cast,
mul). The math is float32 with a rounding to the model's dtype wherever torch's op sequence rounds
(after the residual add, after the normalisation, after the weight, after silu), so a bfloat16
model's values stay within one rounding of the torch path; float32 models agree to float32 rounding
(the mean's summation order differs).

Every kernel is also a torch custom op (`torch.ops.pdserve.*`): a graph that torch.compile traces
keeps each one a single opaque node (Triton's interpreter, on CPU, is Python that Dynamo would
otherwise trace). Eager calls launch directly: a custom op's dispatch costs more host time than the
launch itself.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_LIB = "pdserve"


@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr, eps, stride_x, stride_r, stride_o,
                         stride_s, HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    dtype = x.dtype
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)  # torch's add rounds to the model dtype
        tl.store(sum_ptr + row * stride_s + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, 0) / HIDDEN + eps)
    normed = (x32 * rstd).to(dtype).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [tokens, hidden] (rows may be strided). Returns (rms_norm(sum) * weight, sum),
    sum = residual + x (x itself without a residual)."""
    assert x.dim() == 2 and x.stride(1) == 1 and (residual is None or residual.stride(1) == 1)
    num_tokens, hidden = x.shape
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    total = x if residual is None else torch.empty_like(out)
    if num_tokens:
        r = x if residual is None else residual
        _add_rms_norm_kernel[(num_tokens,)](
            x, r, weight, out, total, eps, x.stride(0), r.stride(0), out.stride(0), total.stride(0), HIDDEN=hidden,
            BLOCK=triton.next_power_of_2(hidden), HAS_RESIDUAL=residual is not None, num_warps=_warps(hidden))
    return out, total


@triton.jit
def _norm_rope_heads(src_ptr, dst_ptr, weight_ptr, cos_a, cos_b, sin_a, sin_b, eps, stride_st, stride_sh,
                     stride_dt, token, NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr,
                     BLOCK_HALF: tl.constexpr):
    """One token's heads [NUM_HEADS, 2 * HALF]: RMSNorm over each head, times weight, rotated."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HALF)
    src = src_ptr + token * stride_st + heads * stride_sh + dims
    x1 = tl.load(src, mask=mask, other=0.0)
    dtype = x1.dtype
    a = x1.to(tl.float32)
    b = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt((tl.sum(a * a, 1) + tl.sum(b * b, 1)) / (2 * HALF) + eps)[:, None]
    w_a = tl.load(weight_ptr + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    w_b = tl.load(weight_ptr + HALF + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    a = (w_a * (a * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)  # RMSNorm rounds twice in torch
    b = (w_b * (b * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    # rotate_half: (a, b) -> (-b, a)
    out_a = a * cos_a - b * sin_a
    out_b = b * cos_b + a * sin_b
    dst = dst_ptr + token * stride_dt + heads * (2 * HALF) + dims
    tl.store(dst, out_a.to(dtype), mask=mask)
    tl.store(dst + HALF, out_b.to(dtype), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, q_weight_ptr, k_weight_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, eps,
                         stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, NUM_HEADS: tl.constexpr,
                         NUM_KV_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr,
                         HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = dims < HALF
    row = token * stride_cos + dims
    cos_a = tl.load(cos_ptr + row, mask=mask, other=0.0).to(tl.float32)
    cos_b = tl.load(cos_ptr + row + HALF, mask=mask, other=0.0).to(tl.float32)
    sin_a = tl.load(sin_ptr + row, mask=mask, other=0.0).to(tl.float32)
    sin_b = tl.load(sin_ptr + row + HALF, mask=mask, other=0.0).to(tl.float32)
    _norm_rope_heads(q_ptr, q_out_ptr, q_weight_ptr, cos_a, cos_b, sin_a, sin_b, eps, stride_qt, stride_qh,
                     NUM_HEADS * 2 * HALF, token, NUM_HEADS, BLOCK_H, HALF, BLOCK_HALF)
    _norm_rope_heads(k_ptr, k_out_ptr, k_weight_ptr, cos_a, cos_b, sin_a, sin_b, eps, stride_kt, stride_kh,
                     NUM_KV_HEADS * 2 * HALF, token, NUM_KV_HEADS, BLOCK_KV, HALF, BLOCK_HALF)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                 cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [tokens, heads, head_dim], k [tokens, kv_heads, head_dim] (views of the fused projection:
    any token and head strides); cos, sin [tokens, head_dim] (each token's rows, rotate-half layout).
    Returns new contiguous (q, k): each head RMS-normalised, times its weight, then rotated."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert head_dim % 2 == 0 and q.stride(2) == 1 and k.stride(2) == 1 and cos.stride(1) == 1
    assert sin.stride() == cos.stride()
    q_out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((num_tokens, num_kv_heads, head_dim), dtype=k.dtype, device=k.device)
    if num_tokens:
        _qk_norm_rope_kernel[(num_tokens,)](
            q, k, q_weight, k_weight, cos, sin, q_out, k_out, eps, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            cos.stride(0), NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, BLOCK_H=triton.next_power_of_2(num_heads),
            BLOCK_KV=triton.next_power_of_2(num_kv_heads), HALF=head_dim // 2,
            BLOCK_HALF=triton.next_power_of_2(head_dim // 2), num_warps=4)
    return q_out, k_out


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, SIZE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < SIZE
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    dtype = gate.dtype
    g = gate.to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + SIZE + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)  # torch's F.silu rounds before the product
    tl.store(out_ptr + row * stride_o + cols, (silu * up).to(dtype), mask=mask)


SILU_BLOCK = 1024  # columns per program: a 12K-wide MLP (Qwen3-8B) is 12 programs a token


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [tokens, 2 * size] = gate | up -> silu(gate) * up [tokens, size]."""
    assert x.dim() == 2 and x.stride(1) == 1 and x.shape[1] % 2 == 0
    num_tokens, size = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_tokens, size), dtype=x.dtype, device=x.device)
    if num_tokens:
        block = min(SILU_BLOCK, triton.next_power_of_2(size))
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(size, block))](
            x, out, x.stride(0), out.stride(0), SIZE=size, BLOCK=block, num_warps=4)
    return out


def _warps(hidden: int) -> int:
    return 8 if hidden >= 4096 else 4


# --- custom ops: what torch.compile sees ---------------------------------------------------------

@torch.library.custom_op(f"{_LIB}::add_rms_norm", mutates_args=())
def _add_rms_norm_op(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    out, total = add_rms_norm(x, residual, weight, eps)
    return out, total.clone() if residual is None else total  # NOTE: a custom op may not return its input


@_add_rms_norm_op.register_fake
def _(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
      ) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape), x.new_empty(x.shape)


@torch.library.custom_op(f"{_LIB}::qk_norm_rope", mutates_args=())
def _qk_norm_rope_op(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                     cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return qk_norm_rope(q, k, q_weight, k_weight, eps, cos, sin)


@_qk_norm_rope_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
      cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape)


@torch.library.custom_op(f"{_LIB}::silu_and_mul", mutates_args=())
def _silu_and_mul_op(x: torch.Tensor) -> torch.Tensor:
    return silu_and_mul(x)


@_silu_and_mul_op.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], x.shape[1] // 2))
