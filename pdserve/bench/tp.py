"""Tensor parallelism: TP=2 (two ranks, one thread each) against TP=1 (one process, two threads),
same random model, same prompts, greedy; offline, plus the all-reduce's share of a TP=2 step and
TP=1 on one thread for scale; or served (`--served`).

    python -m pdserve.bench.tp [--preset small] [--num-requests 16] [--reps 2]
    python -m pdserve.bench.tp --served [--preset small] [--num-requests 16]

`--served`: each configuration is a `pdserve serve` of its own (the same flags but
--tensor-parallel-size and --num-threads), started, warmed up, sent the whole workload at once over
HTTP (streamed completions of the token-id prompts), then stopped before the next starts. The table
gives output throughput, TTFT and TPOT, each as a ratio to TP=1 measured in the same run; a second,
non-streamed pass over the first --check prompts compares the greedy texts.

Workload: --num-requests prompts of random token ids, lengths uniform in --input-len, each asking
for --output-len tokens (ignore_eos), float32. Each configuration warms up on the first two
requests, then runs the whole workload --reps times (no prefix caching: every run prefills every
prompt); the table gives the best run, as a ratio to TP=1 measured in the same run. The all-reduce
share is rank 0's time inside all-reduces over its step time: it includes waiting for the slower
rank, not only moving bytes.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from pdserve.bench.common import hardware_line, print_table
from pdserve.bench.serve import local
from pdserve.bench.serve.client import LoadConfig
from pdserve.bench.serve.command import run_once
from pdserve.bench.serve.metrics import Slo, Summary
from pdserve.bench.serve.workloads import RequestSpec, Workload
from pdserve.engine.llm import LLM, TokensPrompt
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tensor_parallel import TPModelRunner
from pdserve.model.demo_checkpoint import default_model_dir

_FIRST_SPECIAL_TOKEN = 151643


@dataclass(frozen=True, slots=True)
class Result:
    name: str
    best_s: float
    tokens: list[list[int]]
    reduce_share: float | None  # all-reduce time / step time on rank 0 (TP > 1)


def _prompts(num: int, input_len: tuple[int, int], seed: int) -> list[TokensPrompt]:
    rng = random.Random(seed)
    return [TokensPrompt(prompt_token_ids=[rng.randrange(_FIRST_SPECIAL_TOKEN) for _ in range(rng.randint(*input_len))])
            for _ in range(num)]


@dataclass(frozen=True, slots=True)
class Layout:
    """One configuration under test: its name, tensor-parallel size and threads (per rank)."""

    name: str
    tp: int
    threads: int


def run(layout: Layout, model: str, prompts: list[TokensPrompt], output_len: int, reps: int) -> Result:
    name, tp, threads = layout.name, layout.tp, layout.threads
    # NOTE: no prefix caching: a second run of the same prompts would otherwise skip their prefill
    llm = LLM(model=model, dtype="float32", tensor_parallel_size=tp, num_threads=threads, kv_cache_memory="512MiB",
              enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    try:
        llm.generate(prompts[:2], params)  # warm-up
        runner, engine = llm.engine.runner, llm.engine
        reduce_s0 = runner.group.reduce_s if isinstance(runner, TPModelRunner) else 0.0
        step_s0 = engine.stats().step_time_s
        times, tokens = [], []
        for _ in range(reps):
            start = time.perf_counter()
            outputs = llm.generate(prompts, params)
            times.append(time.perf_counter() - start)
            tokens = [o.outputs[0].token_ids for o in outputs]
        share = None
        if isinstance(runner, TPModelRunner):
            share = (runner.group.reduce_s - reduce_s0) / (engine.stats().step_time_s - step_s0)
        return Result(name, min(times), tokens, share)
    finally:
        llm.engine.close()


@dataclass(frozen=True, slots=True)
class Served:
    name: str
    summary: Summary
    texts: list[str]


def serve_run(layout: Layout, model: str, prompts: list[TokensPrompt], output_len: int, num_checked: int,
              log_dir: Path) -> Served:
    """One `pdserve serve` with this TP and thread count: warm-up, the measured run, the text check."""
    name, tp, threads = layout.name, layout.tp, layout.threads
    port = local.free_port()
    args = ["serve", "--port", str(port), "--model", model, "--dtype", "float32", "--kv-cache-memory", "512MiB",
            "--no-enable-prefix-caching", "--tensor-parallel-size", str(tp), "--num-threads", str(threads)]
    work = Workload(name, tuple(RequestSpec(list(p["prompt_token_ids"]), len(p["prompt_token_ids"]), output_len)
                                for p in prompts))
    with local.running(name.replace(" ", "_").replace(",", ""), args, port, log_dir, ready_timeout_s=600) as server:
        _, summary = run_once(work, LoadConfig(server.url, progress=False), Slo(), warmup=2)
        with httpx.Client(base_url=server.url, timeout=600) as http:
            texts = []
            for p in prompts[:num_checked]:
                reply = http.post("/v1/completions", json={"prompt": p["prompt_token_ids"], "max_tokens": output_len,
                                                           "temperature": 0.0, "ignore_eos": True})
                reply.raise_for_status()
                texts.append(reply.json()["choices"][0]["text"])
    return Served(name, summary, texts)


def served_table(runs: list[Served]) -> tuple[list[str], list[list[str]]]:
    base = runs[0].summary

    def ratio(value: float, of: float) -> str:
        return f"{value / of:.2f}" if of else "n/a"

    headers = ["configuration", "output tok/s", "TTFT median ms", "TTFT P99 ms", "TPOT median ms", "TPOT P99 ms",
               "throughput vs TP=1", "TPOT median vs TP=1"]
    rows = []
    for r in runs:
        s, ttft, tpot = r.summary, r.summary.latency["ttft"], r.summary.latency["tpot"]
        rows.append([r.name, f"{s.output_throughput:.1f}", f"{ttft.median_ms:.0f}", f"{ttft.percentiles_ms[99]:.0f}",
                     f"{tpot.median_ms:.1f}", f"{tpot.percentiles_ms[99]:.1f}",
                     ratio(s.output_throughput, base.output_throughput),
                     ratio(tpot.median_ms, base.latency["tpot"].median_ms)])
    return headers, rows


def main_served(model: str, prompts: list[TokensPrompt], output_len: int, num_checked: int) -> None:
    log_dir = Path(tempfile.mkdtemp(prefix="pdserve-bench-tp-"))
    runs = [serve_run(Layout("TP=1, 2 threads", 1, 2), model, prompts, output_len, num_checked, log_dir),
            serve_run(Layout("TP=2, 1 thread per rank", 2, 1), model, prompts, output_len, num_checked, log_dir)]
    if failed := [f"{r.name}: {r.summary.failed} failed" for r in runs if r.summary.failed]:
        raise SystemExit(f"requests failed ({'; '.join(failed)}); logs in {log_dir}")
    print_table(*served_table(runs))
    same = runs[0].texts == runs[1].texts
    print(f"same greedy text for the first {num_checked} prompts: {'yes' if same else 'NO'} (logs in {log_dir})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", help="demo checkpoint preset (tiny, small, qwen3-0.6b)")
    parser.add_argument("--model", default=None, help="a checkpoint directory instead of --preset")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--input-len", type=int, nargs=2, default=(48, 240))
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--reps", type=int, default=2, help="offline: runs of the workload (the best counts)")
    parser.add_argument("--served", action="store_true", help="through `pdserve serve` instead of offline")
    parser.add_argument("--check", type=int, default=4, help="served: prompts whose greedy texts are compared")
    args = parser.parse_args()
    model = args.model or str(default_model_dir(args.preset))
    prompts = _prompts(args.num_requests, tuple(args.input_len), seed=0)
    num_tokens = args.num_requests * args.output_len
    print(hardware_line())
    print(f"model {args.model or args.preset}, float32, {args.num_requests} requests, prompts "
          f"{args.input_len[0]}-{args.input_len[1]} tokens, {args.output_len} output tokens each"
          + (", served, all sent at once" if args.served else f", best of {args.reps}"))
    if args.served:
        main_served(model, prompts, args.output_len, args.check)
        return
    base = run(Layout("TP=1, 2 threads", 1, 2), model, prompts, args.output_len, args.reps)
    one = run(Layout("TP=1, 1 thread", 1, 1), model, prompts, args.output_len, args.reps)
    tp2 = run(Layout("TP=2, 1 thread per rank", 2, 1), model, prompts, args.output_len, args.reps)
    rows = [[r.name, f"{r.best_s:.2f}", f"{num_tokens / r.best_s:.1f}", f"{base.best_s / r.best_s:.2f}",
             "-" if r.reduce_share is None else f"{100 * r.reduce_share:.1f}%"] for r in (base, one, tp2)]
    print_table(["configuration", "time s", "output tok/s", "speed vs TP=1", "all-reduce share of step"], rows)
    same = tp2.tokens == base.tokens == one.tokens
    print(f"same greedy tokens in all three: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
