"""Qwen3-MoE's sparse MLP: a float32 softmax router picks each token's top-k experts, the experts
run grouped by expert, and their outputs are summed with the router's weights.

Grouped by expert: the T x k (token, expert) pairs are sorted by expert id, so each expert's tokens
are one contiguous run of rows and the expert is one matmul pair over that run (torch's
`grouped_mm` over all runs at once where it runs, else a loop over the active experts; never a loop
over tokens), then the rows are weighted and added back to their tokens:

    expert_ids [T, k] --flatten, stable argsort--> order [T*k]     token of row r = order[r] // k
    rows = x[order // k]          | e0 e0 e0 | e1 | e3 e3 | ...     counts = zeros[E].scatter_add_(ids, 1)
    out[run of e] = down_e(silu(gate_e(rows)) * up_e(rows)) * weight
    y = out[argsort(order)].view(T, k, H).sum(1)     (pair (t, j) back at [t, j], then summed over j)

Capture-safe and batch-invariant: nothing on the grouped path reads a device value back to the host
(counting with scatter_add_, not bincount, which syncs to size its output; no .tolist()), so a CUDA
graph captures it and torch.compile(fullgraph=True) traces it. A token's k expert outputs are summed
over its own [k, H] slice in top-k slot order, as transformers' grouped_mm experts do, never with
index_add_ (atomics on CUDA: an order, and bf16 roundings, that change with the batch). The
per-expert loop (CUDA float16/float32, where no grouped GEMM runs) needs each expert's row count on
the host, one sync per layer: it runs eagerly only (`capture_safe`; engine/cuda_graphs.py).
With tensor parallelism every rank holds every expert's slice of the intermediate dimension (as
the dense MLP is split) and the block's partial sums are added by one all-reduce.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model.parallel import ParallelGroup
from pdserve.model.qwen3_config import Qwen3ModelConfig

logger = logging.getLogger(__name__)
_GROUPED_MM_REFUSED: set[str] = set()  # devices whose grouped GEMM raised once


def _has_grouped_mm(x: torch.Tensor) -> bool:
    """torch's grouped GEMM runs on CPU (any float dtype) and on CUDA in bfloat16 from SM 8.0; other
    CUDA dtypes (float16, float32) take the per-expert loop."""
    if not hasattr(F, "grouped_mm") or str(x.device) in _GROUPED_MM_REFUSED:
        return False
    if x.device.type == "cpu":
        return True
    return (x.device.type == "cuda" and x.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device) >= (8, 0))


def capture_safe(x: torch.Tensor) -> bool:
    """Whether the experts run on `x`'s device and dtype without a host sync (the grouped GEMM), so a
    CUDA graph can capture them; the per-expert loop cannot be captured."""
    return _has_grouped_mm(x)


class Router(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (routing weights [T, k] in x's dtype, expert ids [T, k])."""
        probs = F.softmax(F.linear(x, self.weight), dim=-1, dtype=torch.float)
        weights, expert_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), expert_ids


class GroupedExperts(nn.Module):
    """All experts of a layer as stacked weights: gate_up_proj [E, 2I, H] (gate rows, then up rows),
    down_proj [E, H, I]; I is this rank's share of moe_intermediate_size."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        tokens, top_k = expert_ids.shape
        flat = expert_ids.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat))
        rows = x[order // top_k]
        out = None
        if _has_grouped_mm(x):
            try:
                out = self._grouped_mm(rows, counts)
            except RuntimeError as exc:  # NOTE: a kernel limit this device or shape hits: never try again
                _GROUPED_MM_REFUSED.add(str(x.device))
                logger.warning("grouped GEMM refused on %s (%s); experts run one matmul pair each", x.device, exc)
        if out is None:
            out = self._expert_loop(rows, counts)
        out *= weights.flatten()[order, None]
        # row r of `out` is pair order[r]: gathered back into pair order, each token's k rows summed
        return out[torch.argsort(order)].view(tokens, top_k, -1).sum(dim=1)

    def _grouped_mm(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """One grouped GEMM per projection over every expert's run: no host sync, no Python loop."""
        offsets = counts.cumsum(0).to(torch.int32)
        gate, up = F.grouped_mm(rows, self.gate_up_proj.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
        return F.grouped_mm(F.silu(gate) * up, self.down_proj.transpose(1, 2), offs=offsets)

    def _expert_loop(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """A matmul pair per active expert (a loop over experts, never over tokens)."""
        out = torch.empty_like(rows)
        start = 0
        for expert, count in enumerate(counts.tolist()):  # NOTE: one host sync per layer
            if count:
                out[start:start + count] = self.expert_forward(expert, rows[start:start + count])
                start += count
        return out

    def expert_forward(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """One expert's SwiGLU MLP on rows x [n, H] -> [n, H]."""
        gate, up = F.linear(x, self.gate_up_proj[expert]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj[expert])


class SparseMoeBlock(nn.Module):
    """Parameter names: `gate.weight` (the router, as in the checkpoint) and the stacked
    `experts.gate_up_proj` / `experts.down_proj` that the loader fills from per-expert tensors."""

    def __init__(self, cfg: Qwen3ModelConfig, group: ParallelGroup | None = None) -> None:
        super().__init__()
        assert cfg.moe is not None
        moe = cfg.moe
        self.group = group
        self.gate = Router(cfg.hidden_size, moe.num_experts, moe.num_experts_per_tok, moe.norm_topk_prob)
        self.experts = GroupedExperts(moe.num_experts, cfg.hidden_size, moe.moe_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = self.gate(x)
        out = self.experts(x, expert_ids, weights)
        return out if self.group is None else self.group.all_reduce(out)
