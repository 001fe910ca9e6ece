"""What every `pdserve bench` mode shares: the workload, load and output flags, and one load run
(command.py: one run against --url; sweep.py, compare.py: several)."""

from __future__ import annotations

import argparse
import asyncio
import math
from pathlib import Path

from pdserve.bench.serve import workloads
from pdserve.bench.serve.client import LoadConfig, LoadResult, run_load
from pdserve.bench.serve.metrics import Slo, Summary, summarize


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--workload", choices=["seed-mix", "random", "shared-prefix", "sharegpt"], default="seed-mix",
                   help="seed-mix: 500/2000/5000-token prompts at 6:3:1, 500 output tokens (times --scale)")
    g.add_argument("--num-prompts", type=int, default=100, help="requests to send (per run of a sweep)")
    g.add_argument("--scale", type=float, default=1.0,
                   help="seed-mix: multiply every length (and the sweep's default concurrency ladder) by this")
    g.add_argument("--input-len", type=int, default=1024, help="random: mean prompt tokens")
    g.add_argument("--output-len", type=int, default=None,
                   help="output tokens (random default 128; seed-mix default 500 x --scale; sharegpt: the reply's)")
    g.add_argument("--range-ratio", type=float, default=0.0, help="random: lengths uniform in len x [1-r, 1+r]")
    g.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: tokens of the shared prefix")
    g.add_argument("--suffix-len", type=int, default=128, help="shared-prefix: tokens of each request's own suffix")
    g.add_argument("--num-prefixes", type=int, default=1, help="shared-prefix: distinct prefixes")
    g.add_argument("--dataset-path", type=Path, default=None, help="sharegpt: the JSON file")
    g.add_argument("--tokenizer", default=None,
                   help="sharegpt: checkpoint dir whose tokenizer counts lengths (default: 4 characters a token)")
    g.add_argument("--prompt-format", choices=["tokens", "text"], default="tokens",
                   help="tokens: token-id lists (exact lengths; pdserve, vLLM, SGLang); text: words")
    g.add_argument("--vocab-size", type=int, default=32000, help="token ids are drawn below this")


def add_load_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("load")
    g.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                   help="/v1/completions or /v1/chat/completions (chat sends text)")
    g.add_argument("--model", default=None, help="model id to send (default: the server's first /v1/models id)")
    g.add_argument("--api-key", default=None,
                   help="the server's client key, sent as 'Authorization: Bearer' (default: env PDSERVE_API_KEY)")
    g.add_argument("--max-concurrency", "--concurrency", type=int, default=None,
                   help="requests in flight at most (default: no cap)")
    g.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests/s (gamma arrivals); inf sends all at once")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 Poisson, <1 burstier, >1 steadier")
    g.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                   help="stream (needed for TTFT, TPOT, ITL); --no-stream measures E2E only, like the seed's client")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="send vLLM's ignore_eos so outputs have exactly max_tokens tokens (off for servers that "
                        "reject unknown fields, e.g. transformers serve)")
    g.add_argument("--cancel-rate", type=float, default=0.0, help="share of requests the client drops mid-way")
    g.add_argument("--seed", type=int, default=0, help="workload, arrivals and cancellations")
    g.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    g.add_argument("--slo", type=Slo.parse, default=Slo(), help="goodput SLOs, e.g. ttft=2500,tpot=50 (ms)")
    g.add_argument("--warmup", type=int, default=0, help="short requests sent (and not counted) before the run")
    g.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")


def add_output_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--save", type=Path, default=None, help="JSON results (vLLM's key names)")
    parser.add_argument("--plot", type=Path, default=None, help="directory for PNG plots")


def build_workload(ns: argparse.Namespace) -> workloads.Workload:
    if ns.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    kind = workloads.PromptKind(ns.vocab_size, as_text=ns.prompt_format == "text" or ns.endpoint == "chat")
    if ns.workload == "seed-mix":
        return workloads.seed_mix(ns.num_prompts, ns.scale, ns.output_len, ns.seed, kind)
    if ns.workload == "random":
        return workloads.random_lengths(ns.num_prompts, ns.input_len, ns.output_len or 128, ns.range_ratio, ns.seed,
                                        kind)
    if ns.workload == "shared-prefix":
        return workloads.shared_prefix(ns.num_prompts, workloads.SharedPrefixes(ns.prefix_len, ns.num_prefixes),
                                       ns.suffix_len, ns.output_len or 128, ns.seed, kind)
    if ns.dataset_path is None:
        raise ValueError("--workload sharegpt needs --dataset-path")
    count = None
    if ns.tokenizer:
        from pdserve.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(ns.tokenizer)

        def count(text: str) -> int:
            return len(tokenizer.encode(text))

    return workloads.sharegpt(ns.dataset_path, ns.num_prompts, ns.seed, ns.output_len, count)


def load_config(ns: argparse.Namespace, url: str, max_concurrency: int | None = None) -> LoadConfig:
    if ns.slo.needs_stream and not ns.stream:
        raise ValueError("a ttft or tpot SLO needs --stream (without it only E2E is measured)")
    if not 0.0 <= ns.cancel_rate <= 1.0:
        raise ValueError("--cancel-rate must be in [0, 1]")
    return LoadConfig(base_url=url.rstrip("/"), model=ns.model, endpoint=ns.endpoint, stream=ns.stream,
                      max_concurrency=max_concurrency or ns.max_concurrency, request_rate=ns.request_rate,
                      burstiness=ns.burstiness, cancel_rate=ns.cancel_rate, seed=ns.seed, timeout_s=ns.timeout,
                      progress=not ns.no_progress, ignore_eos=ns.ignore_eos, api_key=_api_key(ns))


def _api_key(ns: argparse.Namespace) -> str | None:
    from pdserve import envs

    keys = envs.api_keys()
    return ns.api_key or (keys[0] if keys else None)


def warm_up(config: LoadConfig, num_requests: int) -> None:
    """Short requests with their own prompts (never the measured ones: they would warm the prefix cache)."""
    if num_requests > 0:
        work = workloads.random_lengths(num_requests, 16, 4, seed=config.seed + 7919,
                                        kind=workloads.PromptKind(vocab_size=1000))
        asyncio.run(run_load(work, LoadConfig(config.base_url, config.model, config.endpoint, config.stream,
                                              progress=False, timeout_s=config.timeout_s,
                                              ignore_eos=config.ignore_eos, api_key=config.api_key)))


def run_once(workload: workloads.Workload, config: LoadConfig, slo: Slo,
             warmup: int = 0) -> tuple[LoadResult, Summary]:
    """Warm up, then one measured run of `workload`."""
    warm_up(config, warmup)
    result = asyncio.run(run_load(workload, config))
    return result, summarize(result.records, result.duration_s, slo)
