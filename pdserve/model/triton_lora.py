"""The batched LoRA matmul in Triton (CUDA; the tests run it in Triton's interpreter on CPU).

Each token t uses slot s = token_slots[t] of a projection's stacked adapters (model/lora.py), -1
for none. Two launches, the punica/vLLM shrink-expand split:

    shrink  program (t, rank tile):  y[t, r]    = sum_k lora_a[s, r, k] * x[t, k]
    expand  program (t, out tile):   out[t, n] += sum_r y[t, r] * lora_bt[s, r, n]

A token with s = -1 loads nothing and stores nothing (masked), so base-model tokens cost one index
load. The grid depends only on the row count and the shapes, and the slots are read from a tensor,
so a CUDA graph captured for a batch size replays for any mix of adapters. Math in float32, the
output cast back (as in triton_attention.py); no autotuning (a graph captures one launch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_K = 64  # input features per step of the shrink
BLOCK_N = 64  # output features per expand program
BLOCK_R = 16  # rank rows per shrink program / per step of the expand


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, y_ptr, stride_xt, stride_as, stride_ar, stride_yt, K, R,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    token = tl.program_id(0)
    ranks = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    # NOTE: a base-model token (slot -1) gets limits of 0, so every load and store below is masked off
    k_limit = tl.where(slot >= 0, K, 0)
    r_limit = tl.where(slot >= 0, R, 0)
    safe_slot = tl.maximum(slot, 0)
    acc = tl.zeros([BLOCK_R], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + token * stride_xt + ks, mask=ks < k_limit, other=0.0).to(tl.float32)
        a_mask = (ranks[:, None] < r_limit) & (ks[None, :] < k_limit)
        a = tl.load(a_ptr + safe_slot * stride_as + ranks[:, None] * stride_ar + ks[None, :], mask=a_mask,
                    other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(y_ptr + token * stride_yt + ranks, acc, mask=ranks < r_limit)


@triton.jit
def _expand_kernel(y_ptr, bt_ptr, slots_ptr, out_ptr, stride_yt, stride_bs, stride_br, stride_ot, N, R,
                   BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    n_limit = tl.where(slot >= 0, N, 0)
    r_limit = tl.where(slot >= 0, R, 0)
    safe_slot = tl.maximum(slot, 0)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for r0 in range(0, R, BLOCK_R):
        ranks = r0 + tl.arange(0, BLOCK_R)
        y = tl.load(y_ptr + token * stride_yt + ranks, mask=ranks < r_limit, other=0.0)
        b_mask = (ranks[:, None] < r_limit) & (cols[None, :] < n_limit)
        b = tl.load(bt_ptr + safe_slot * stride_bs + ranks[:, None] * stride_br + cols[None, :], mask=b_mask,
                    other=0.0).to(tl.float32)
        acc += tl.sum(b * y[:, None], axis=0)
    out_mask = cols < n_limit
    dst = out_ptr + token * stride_ot + cols
    base = tl.load(dst, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(dst, (base + acc).to(out_ptr.dtype.element_ty), mask=out_mask)


def add_lora(x: torch.Tensor, out: torch.Tensor, lora_a: torch.Tensor, lora_bt: torch.Tensor,
             token_slots: torch.Tensor) -> None:
    """out[t] += (x[t] @ lora_a[s].T) @ lora_bt[s] for s = token_slots[t] >= 0, in place.
    x [T, K], out [T, N] (rows contiguous), lora_a [S, R, K], lora_bt [S, R, N], token_slots [T] int."""
    num_tokens, k = x.shape
    _, r, n = lora_bt.shape
    if num_tokens == 0:
        return
    x = x.contiguous()
    assert out.stride(1) == 1 and lora_a.is_contiguous() and lora_bt.is_contiguous()
    y = torch.empty((num_tokens, r), dtype=torch.float32, device=x.device)
    _shrink_kernel[(num_tokens, triton.cdiv(r, BLOCK_R))](
        x, lora_a, token_slots, y, x.stride(0), lora_a.stride(0), lora_a.stride(1), y.stride(0), k, r,
        BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K)
    _expand_kernel[(num_tokens, triton.cdiv(n, BLOCK_N))](
        y, lora_bt, token_slots, out, y.stride(0), lora_bt.stride(0), lora_bt.stride(1), out.stride(0), n, r,
        BLOCK_N=BLOCK_N, BLOCK_R=BLOCK_R)
