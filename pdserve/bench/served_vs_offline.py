"""Served against offline: the same requests through `LLM.generate` and through a `pdserve serve`
subprocess (concurrent streams over HTTP), with the engine on a thread of the API process
(`--engine-in-process`, as it once always ran) and in its own process (the default), in one run.

    python -m pdserve.bench.served_vs_offline [--preset small | --model DIR] [--num-requests 64]
        [--concurrency 64] [--input-len 64] [--output-len 64] [--num-threads 1] [--device cuda --dtype bfloat16]

Every engine gets `--num-threads` torch threads (default 1) and the same pool; requests are greedy
with `ignore_eos`, so each produces exactly its max_tokens. Printed per system: output tok/s and
its ratio to offline, the mean step period (its own time plus any gap while work waited, from
PDSERVE_STEP_LOG; the served one is what the API process's load costs the engine) against the
offline step, and the streams' TTFT and TPOT medians.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from pdserve import LLM, SamplingParams
from pdserve.bench.common import hardware_line, print_table
from pdserve.bench.serve import local
from pdserve.bench.serve.client import LoadConfig, LoadResult, run_load
from pdserve.bench.serve.workloads import PromptKind, Workload, random_lengths
from pdserve.engine.llm import TokensPrompt
from pdserve.engine.step_log import read_step_logs
from pdserve.envs import STEP_LOG
from pdserve.model.demo_checkpoint import PRESETS, QWEN3_SHAPES, write_checkpoint
from pdserve.model.qwen3_config import Qwen3ModelConfig

_READY_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class Run:
    name: str
    output_tok_s: float
    mean_step_s: float
    num_steps: int
    ttft_p50_s: float | None = None
    tpot_p50_s: float | None = None


def _steps(directory: Path) -> list[float]:
    return [step.period_s for step in read_step_logs([directory])] if any(directory.glob("steps-*.jsonl")) else []


def run_offline(model: str, work: Workload, engine_args: dict[str, int | str], step_dir: Path) -> Run:
    os.environ[STEP_LOG] = str(step_dir)
    try:
        llm = LLM(model, **engine_args)
    finally:
        del os.environ[STEP_LOG]
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in work.requests]
    prompts = [TokensPrompt(prompt_token_ids=_token_ids(r.prompt)) for r in work.requests]
    llm.generate(prompts[:1], params[:1])  # warm-up, as the served runs' readiness request
    before = len(_steps(step_dir))
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    llm.engine.close()
    steps = _steps(step_dir)[before:]
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return Run("offline (LLM.generate)", tokens / elapsed, statistics.fmean(steps), len(steps))


def _token_ids(prompt: list[int] | str) -> list[int]:
    assert not isinstance(prompt, str), "random_lengths makes token-id prompts"
    return list(prompt)


@dataclass(frozen=True, slots=True)
class Server:
    """A `pdserve serve` to start: its model and flags, where its log goes."""

    model: str
    flags: list[str]
    log_dir: Path


def run_served(name: str, server_: Server, work: Workload, concurrency: int, step_dir: Path) -> Run:
    model, flags, log_dir = server_.model, server_.flags, server_.log_dir
    port = local.free_port()
    os.environ[STEP_LOG] = str(step_dir)
    try:
        server = local.start(name.split()[0], ["serve", "--port", str(port), "--model", model, *flags], port, log_dir)
    finally:
        del os.environ[STEP_LOG]
    try:
        local.wait_ready(server, _READY_TIMEOUT_S)
        before = len(_steps(step_dir))
        result = asyncio.run(run_load(work, LoadConfig(server.url, max_concurrency=concurrency, progress=False)))
    finally:
        local.stop(server)
    return _served_run(name, result, _steps(step_dir)[before:])


def _served_run(name: str, result: LoadResult, steps: list[float]) -> Run:
    failed = [r for r in result.records if not r.ok]
    if failed:
        raise RuntimeError(f"{name}: {len(failed)} requests failed, e.g. {failed[0].error_kind}: {failed[0].error}")
    tokens = sum(r.output_tokens for r in result.records)
    ttfts = [r.ttft_s for r in result.records if r.ttft_s is not None]
    tpots = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in result.records
             if r.ttft_s is not None and r.output_tokens > 1]
    return Run(name, tokens / result.duration_s, statistics.fmean(steps), len(steps),
               statistics.median(ttfts) if ttfts else None, statistics.median(tpots) if tpots else None)


def table(runs: list[Run]) -> tuple[list[str], list[list[str]]]:
    offline = runs[0]

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.1f}"

    headers = ["system", "output tok/s", "vs offline", "mean step ms", "step vs offline", "steps", "TTFT p50 ms",
               "TPOT p50 ms"]
    rows = [[r.name, f"{r.output_tok_s:.1f}", f"{r.output_tok_s / offline.output_tok_s:.2f}", ms(r.mean_step_s),
             f"{r.mean_step_s / offline.mean_step_s:.2f}", str(r.num_steps), ms(r.ttft_p50_s), ms(r.tpot_p50_s)]
            for r in runs]
    return headers, rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint dir (default: a random --preset model)")
    parser.add_argument("--preset", default="small", choices=sorted(PRESETS | QWEN3_SHAPES))
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=64, help="streams in flight at once")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-threads", type=int, default=1, help="torch threads of every engine")
    parser.add_argument("--num-kv-blocks", type=int, default=2048)
    parser.add_argument("--device", default="auto", help="every engine's --device")
    parser.add_argument("--dtype", default="float32", help="every engine's --dtype (the weights are written in it)")
    parser.add_argument("--seed", type=int, default=0)
    ns = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pdserve-served-vs-offline-") as tmp:
        root = Path(tmp)
        model = ns.model or str(write_checkpoint(root / "model", (PRESETS | QWEN3_SHAPES)[ns.preset], seed=ns.seed,
                                                 device="cuda" if ns.device.startswith("cuda") else "cpu"))
        vocab = Qwen3ModelConfig.from_dir(model).vocab_size
        work = random_lengths(ns.num_requests, ns.input_len, ns.output_len, seed=ns.seed,
                              kind=PromptKind(vocab))
        engine: dict[str, int | str] = {"num_threads": ns.num_threads, "num_kv_blocks": ns.num_kv_blocks,
                                        "device": ns.device, "dtype": ns.dtype}
        flags = [f"--{key.replace('_', '-')}={value}" for key, value in engine.items()]
        print(f"# served vs offline: {ns.preset if ns.model is None else model}, {work.name}, {ns.num_requests} "
              f"requests, {ns.concurrency} streams, {ns.num_threads} torch thread(s), {ns.device}, {ns.dtype}\n"
              f"# {hardware_line()}")
        runs = [run_offline(model, work, engine, root / "steps-offline")]
        for name, extra in (("served, engine thread (--engine-in-process)", ["--engine-in-process"]),
                            ("served, engine process", [])):
            runs.append(run_served(name, Server(model, flags + extra, root / "logs"), work, ns.concurrency,
                                   root / f"steps-{len(runs)}"))
        print_table(*table(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
