"""Mixture of experts on CPU: pdserve's offline throughput against transformers on the same random
Qwen3-MoE, and the grouped-experts layer (tokens sorted by expert; torch's grouped GEMM over all
experts' runs, and the per-expert loop: one matmul pair per active expert) against a per-token loop
(each token's k experts, one at a time).

    python -m pdserve.bench.moe [--preset small-moe] [--num-requests 16] [--skip-transformers]

Throughput: the workload of bench/offline_throughput.py (random prompts, greedy, ignore_eos,
float32), pdserve `LLM.generate` then transformers' batched `generate` in the same process; greedy
outputs compared. Layer: one sparse layer of `--experts` experts, top `--top-k`, hidden
`--hidden`, expert width `--expert-width` (default: a quarter of Qwen3-30B-A3B's layer in each
dimension), for several token counts; median of `--reps` calls after one warm-up, outputs checked
equal. Every ratio is measured in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from pdserve import LLM
from pdserve.bench.common import hardware_line, print_table
from pdserve.bench.offline_throughput import make_workload, run_pdserve, run_transformers
from pdserve.model import moe
from pdserve.model.demo_checkpoint import PRESETS, write_checkpoint
from pdserve.model.moe import GroupedExperts

MOE_PRESETS = [name for name, shape in PRESETS.items() if shape.is_moe]


def per_token_loop(experts: GroupedExperts, x: torch.Tensor, expert_ids: torch.Tensor,
                   weights: torch.Tensor) -> torch.Tensor:
    """The baseline: every token through each of its experts on its own."""
    out = torch.zeros_like(x)
    for token in range(x.shape[0]):
        for slot in range(expert_ids.shape[1]):
            expert = int(expert_ids[token, slot])
            out[token] += weights[token, slot] * experts.expert_forward(expert, x[token:token + 1])[0]
    return out


def _median_s(call: Callable[[], object], reps: int) -> float:
    call()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@contextlib.contextmanager
def _expert_loop_only() -> Iterator[None]:
    """The grouped path without torch's grouped GEMM: a matmul pair per active expert (what CUDA
    float16/float32 run)."""
    saved = moe._has_grouped_mm
    moe._has_grouped_mm = lambda x: False
    try:
        yield
    finally:
        moe._has_grouped_mm = saved


def layer_rows(ns: argparse.Namespace) -> list[list[str]]:
    gen = torch.Generator().manual_seed(ns.seed)
    experts = GroupedExperts(ns.experts, ns.hidden, ns.expert_width)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=gen) * ns.hidden**-0.5)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=gen) * ns.expert_width**-0.5)
    rows = []
    for tokens in ns.tokens:
        x = torch.randn(tokens, ns.hidden, generator=gen)
        logits = torch.randn(tokens, ns.experts, generator=gen)
        weights, expert_ids = torch.topk(torch.softmax(logits, -1), ns.top_k, dim=-1)
        with torch.inference_mode():
            grouped = experts(x, expert_ids, weights)
            looped = per_token_loop(experts, x, expert_ids, weights)
            if not torch.allclose(grouped, looped, rtol=1e-4, atol=1e-5):
                raise AssertionError(f"{tokens} tokens: the grouped experts differ from the per-token loop")
            grouped_s = _median_s(functools.partial(experts, x, expert_ids, weights), ns.reps)
            looped_s = _median_s(functools.partial(per_token_loop, experts, x, expert_ids, weights), ns.reps)
            with _expert_loop_only():
                by_expert_s = _median_s(functools.partial(experts, x, expert_ids, weights), ns.reps)
        active = int(expert_ids.unique().numel())
        rows.append([str(tokens), str(active), f"{grouped_s * 1e3:.2f}", f"{by_expert_s * 1e3:.2f}",
                     f"{looped_s * 1e3:.2f}", f"{looped_s / grouped_s:.1f}x"])
    return rows


def throughput_rows(ns: argparse.Namespace, model_dir: Path) -> list[list[str]]:
    work = make_workload(ns.num_requests, tuple(ns.input_len), tuple(ns.output_len), ns.seed)
    llm = LLM(str(model_dir), dtype="float32", max_num_seqs=ns.max_num_seqs, kv_cache_memory="1GiB",
              num_threads=ns.threads)
    run_pdserve(llm, make_workload(2, (8, 16), (2, 4), ns.seed + 1))  # warm-up
    pd_s, pd_tokens = run_pdserve(llm, work)
    rows = [["pdserve LLM.generate", f"{pd_s:.2f}", f"{work.num_output_tokens / pd_s:.1f}", "1.00", "-"]]
    if not ns.skip_transformers:
        hf_s, hf_tokens = run_transformers(str(model_dir), work, ns.max_num_seqs)
        same = sum(a == b for a, b in zip(pd_tokens, hf_tokens, strict=True))
        rows.append(["transformers generate", f"{hf_s:.2f}", f"{work.num_output_tokens / hf_s:.1f}",
                     f"{hf_s / pd_s:.2f}x slower", f"{same}/{len(pd_tokens)}"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=MOE_PRESETS, default="small-moe", help="the random MoE (make-model)")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--input-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 64), metavar=("MIN", "MAX"))
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--expert-width", type=int, default=192)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads for every row (NOTE: on a small, "
                        "shared VM tiny matmuls on 2 threads run ~1000x slower than on one: thread wake-ups)")
    ns = parser.parse_args()
    torch.set_num_threads(ns.threads)
    print(f"hardware: {hardware_line()}")
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-moe-") as tmp:
        shape = PRESETS[ns.preset]
        model_dir = write_checkpoint(Path(tmp) / ns.preset, shape, seed=ns.seed)
        print(f"model: random {ns.preset} (hidden {shape.hidden_size}, {shape.num_hidden_layers} layers, "
              f"{shape.num_experts} experts, top-{shape.num_experts_per_tok}, expert width "
              f"{shape.moe_intermediate_size}), float32; workload: {ns.num_requests} requests, input "
              f"{ns.input_len[0]}-{ns.input_len[1]}, output {ns.output_len[0]}-{ns.output_len[1]} tokens, greedy")
        print_table(["system", "time s", "output tok/s", "vs pdserve", "same greedy"], throughput_rows(ns, model_dir))
    print(f"\nsparse layer: {ns.experts} experts, top-{ns.top_k}, hidden {ns.hidden}, expert width {ns.expert_width}, "
          f"float32; median of {ns.reps}")
    print_table(["tokens", "active experts", "grouped ms", "per-expert loop ms", "per-token loop ms",
                 "per-token / grouped"], layer_rows(ns))


if __name__ == "__main__":
    main()
