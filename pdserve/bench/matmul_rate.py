"""How close an offline run comes to this machine's matmul rate.

The useful work of a generation, counted as FLOPs the way a roofline counts them:
- prefill of P tokens after C cached: 2 x layer matmul parameters x P, attention over
  P x (C + (P + 1) / 2) pairs, and the LM head for the one row that is sampled;
- each later token: 2 x (layer matmul parameters + LM head) plus attention over its context.
Nothing is counted twice (a preempted and recomputed prompt is work done again, not more work).

The rate torch itself reaches: fp32 `torch.mm` on the model's own GEMM shapes (QKV, o, gate+up,
down, LM head) with a decode-sized M (the batch) and a prefill-sized M (a chunk), in this process
with its threads; the best of them is the ceiling. Both are measured in the same run, so the
fraction is what the machine allowed at that moment, load included.

A second, tighter ceiling (`gemm_ceiling_s`): the time torch.mm alone needs for the run's own
matmuls at the M each ran at: prompt tokens at the chunk's rate, later tokens and every sampled
row of the LM head at the decode batch's, attention pairs at the best rate. Where a small M runs
far below the best rate (the decode batch), no engine reaches the first ceiling; the second says
how much of the rest is the engine's.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.model.facts import ModelFacts

_REPS = 5


@dataclass(frozen=True, slots=True)
class Rate:
    label: str  # "M x K x N"
    flops_per_s: float
    shape: tuple[int, int, int] = (0, 0, 0)


def workload_flops(model: ModelFacts, prompt_lens: Sequence[int], output_lens: Sequence[int],
                   cached_lens: Sequence[int] | None = None) -> float:
    cached = cached_lens or [0] * len(prompt_lens)
    computed = sum(p - c for p, c in zip(prompt_lens, cached, strict=True))
    later = sum(max(0, n - 1) for n in output_lens)  # the first output token came from the prefill
    return (2.0 * model.layers_matmul_params * (computed + later)
            + 2.0 * model.vocab_size * model.hidden_size * (len(prompt_lens) + later)
            + model.attention_flops_per_pair() * attention_pairs(prompt_lens, output_lens, cached))


def attention_pairs(prompt_lens: Sequence[int], output_lens: Sequence[int], cached_lens: Sequence[int]) -> float:
    """(query, key) pairs the run's attention computes: each computed prompt token over the cached
    prefix and the prompt up to itself, each later token over everything before it."""
    total = 0.0
    for prompt, output, cached in zip(prompt_lens, output_lens, cached_lens, strict=True):
        new = prompt - cached
        total += new * (cached + (new + 1) / 2) + sum(prompt + step for step in range(1, output))
    return total


def gemm_shapes(model: ModelFacts, batch: int, chunk: int) -> list[tuple[int, int, int]]:
    h, q, kv = model.hidden_size, model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    weights = [(h, q + 2 * kv), (q, h), (h, 2 * model.intermediate_size), (model.intermediate_size, h)]
    shapes = [(m, k, n) for m in (batch, chunk) for k, n in weights]
    return [*shapes, (batch, h, model.vocab_size)]


def matmul_rates(model: ModelFacts, batch: int = 24, chunk: int = 256) -> list[Rate]:
    """fp32 torch.mm on each shape: the best of `_REPS` timed runs after a warm-up."""
    rates = []
    for m, k, n in gemm_shapes(model, batch, chunk):
        a, b = torch.randn(m, k), torch.randn(k, n)
        out = torch.empty(m, n)
        torch.mm(a, b, out=out)
        best = float("inf")
        for _ in range(_REPS):
            start = time.perf_counter()
            torch.mm(a, b, out=out)
            best = min(best, time.perf_counter() - start)
        rates.append(Rate(f"{m} x {k} x {n}", 2.0 * m * k * n / best, (m, k, n)))
    return rates


def gemm_ceiling_s(model: ModelFacts, rates: Sequence[Rate], prompt_lens: Sequence[int], output_lens: Sequence[int],
                   batch: int, chunk: int) -> float:
    """Seconds torch.mm alone takes for a run's matmuls at the M they ran at (`rates` from
    `matmul_rates(model, batch, chunk)`): the lower bound on the run's time on this machine."""
    by_shape = {r.shape: r.flops_per_s for r in rates}
    per_token: dict[int, float] = {}
    for m in (batch, chunk):  # NOTE: a MoE's active experts counted as its dense MLP would be
        layer = gemm_shapes(model, m, m)[:4]
        per_token[m] = model.num_layers * sum(2.0 * k * n / by_shape[(m, k, n)] for _, k, n in layer)
    head = 2.0 * model.vocab_size * model.hidden_size / by_shape[(batch, model.hidden_size, model.vocab_size)]
    prompt_tokens, sampled = sum(prompt_lens), sum(output_lens)
    later = sum(max(0, n - 1) for n in output_lens)
    pairs = attention_pairs(prompt_lens, output_lens, [0] * len(prompt_lens))
    best = max(r.flops_per_s for r in rates)
    return (prompt_tokens * per_token[chunk] + later * per_token[batch] + sampled * head
            + pairs * model.attention_flops_per_pair() / best)
