"""`pdserve bench` command line: flags (vLLM's names where vLLM has one), and one load run.

    pdserve bench --url URL [workload] [arrivals] [--save FILE] [--plot DIR]
    pdserve bench sweep   ...   concurrency ladder against --url, or a P:D sweep on local clusters (--pd)
    pdserve bench compare ...   colocated (chunked prefill on/off) vs PD, same cores, same workload
    pdserve bench capacity      what this client sustains against a stub that answers at once
"""

from __future__ import annotations

import argparse
import math

from pdserve.bench.serve.report import format_summary, plot_latency_cdfs, result_json, save_json
from pdserve.bench.serve.runs import (
    add_load_args,
    add_output_args,
    add_workload_args,
    build_workload,
    load_config,
    run_once,
)


def run_bench(ns: argparse.Namespace) -> int:
    """Plain `pdserve bench --url URL`: one load run, the result block, optional JSON and plots."""
    if not ns.url:
        raise ValueError("--url is required (or use `pdserve bench sweep | compare | capacity`)")
    work = build_workload(ns)
    config = load_config(ns, ns.url)
    rate = "inf" if math.isinf(config.request_rate) else f"{config.request_rate:g}/s"
    print(f"pdserve bench: {work.name}, {len(work.requests)} requests to {config.base_url} "
          f"(max concurrency {config.max_concurrency or 'none'}, rate {rate}, burstiness {config.burstiness:g}, "
          f"{'stream' if config.stream else 'no stream'}, cancel rate {config.cancel_rate:g}, seed {config.seed})")
    result, summary = run_once(work, config, ns.slo, ns.warmup)
    print(format_summary(summary))
    if ns.save:
        save_json(ns.save, result_json(result, summary, work.name))
        print(f"saved {ns.save}")
    if ns.plot:
        print(f"plotted {plot_latency_cdfs(result, ns.plot)}")
    return 0


def add_bench_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The `bench` subcommand with its `sweep`, `compare` and `capacity` subcommands."""
    from pdserve.bench.serve import capacity, compare, sweep

    bench = sub.add_parser("bench", help="load-test an OpenAI-compatible server (TTFT, TPOT, ITL, goodput)",
                           description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_argument("--url", default=None, help="server base URL, e.g. http://127.0.0.1:8000")
    for add in (add_workload_args, add_load_args, add_output_args):
        add(bench)
    bench.set_defaults(bench_run=run_bench)
    modes = bench.add_subparsers(dest="bench_command", required=False)
    for module in (sweep, compare, capacity):
        module.add_parser(modes)
    return bench
