"""`pdserve bench compare`: colocated vs PD on the same machine, cores, workload and seed.

The systems, started one after another by this command, each stopped before the next starts:

- `colocated-replicas`:  `pdserve up --colocated P+D`: P + D colocated replicas behind a balancer
- `colocated-chunked`:   `pdserve serve --enable-chunked-prefill --num-threads T` (one instance)
- `colocated-nochunk`:   `pdserve serve --no-enable-chunked-prefill --num-threads T`
- `pd`:                  `pdserve up --prefill P --decode D --num-threads T // (P + D)`

Two questions, two comparisons. **Equal hardware** (`--pin`, the seed's comparison): a worker is a
"device", pinned to T // (P + D) cores of its own, and N = P + D devices are used either as N
colocated replicas (`colocated-replicas`, the baseline) or as P prefill + D decode workers (`pd`).
Without `--pin`, the **same thread budget**: every system gets the same total of T torch threads
(default: the CPU count), unpinned, shared by the OS as it likes; one big colocated instance
(`colocated-chunked`) is then a fair baseline too, but it answers another question than the seed's.
The router or balancer and the load client run on the same cores in every case and do no model
math; the client's own capacity (stub server) is measured first and printed, so the table shows it
was not the limit.

`--max-num-batched-tokens` caps the step budget of the chunked systems (scale it with the workload:
with prompts of at most 1000 tokens the default 2048 rarely splits one; the seed caps it so one
huge prompt cannot monopolise a step). Without chunked prefill a whole prompt must fit one step,
so colocated-nochunk keeps its default budget (>= max_model_len).

Every system gets the same workload (same seed: same prompts, same order, same arrival times), one
warm-up, then the measured run. The ratio table divides each system's numbers by the baseline's.
"""

from __future__ import annotations

import argparse
import os
import shlex
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from pdserve.bench.common import hardware_line, print_table
from pdserve.bench.serve import capacity, local
from pdserve.bench.serve.metrics import Summary
from pdserve.bench.serve.report import format_summary, result_json, save_json
from pdserve.bench.serve.runs import (
    add_load_args,
    add_output_args,
    add_workload_args,
    build_workload,
    load_config,
    run_once,
)

SYSTEMS = ("colocated-replicas", "colocated-chunked", "colocated-nochunk", "pd")
DEFAULT_SYSTEMS = ("colocated-chunked", "colocated-nochunk", "pd")
PINNED_SYSTEMS = ("colocated-replicas", "pd")  # --pin: equal hardware


@dataclass(frozen=True, slots=True)
class SystemRun:
    name: str
    threads: str  # how the torch threads were split, e.g. "2" or "1 prefill + 1 decode"
    summary: Summary


def add_parser(modes: argparse._SubParsersAction) -> None:
    p = modes.add_parser("compare", help="colocated (chunked prefill on/off) vs PD, same cores and workload",
                         description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default=None,
                   help=f"comma-separated subset of {', '.join(SYSTEMS)} (default: {','.join(DEFAULT_SYSTEMS)}; "
                        f"with --pin {','.join(PINNED_SYSTEMS)}); the first is the baseline")
    p.add_argument("--pin", action="store_true",
                   help="equal hardware: every worker pinned to total-threads // (P + D) cores of its own, "
                        "colocated-replicas runs P + D replicas")
    p.add_argument("--prefill", type=int, default=1, help="pd: prefill workers")
    p.add_argument("--decode", type=int, default=1, help="pd: decode workers")
    p.add_argument("--total-threads", type=int, default=os.cpu_count() or 1,
                   help="torch threads per system: colocated gets all, each PD worker total // (P + D)")
    p.add_argument("--engine-args", default="", help="flags for every server, e.g. '--num-kv-blocks 2048'")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="step token budget of the chunked systems (colocated-chunked, both PD roles); "
                        "colocated-nochunk keeps its own (>= max_model_len, as it must)")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--log-dir", type=Path, default=None, help="servers' logs (default: a temp dir)")
    p.add_argument("--skip-capacity", action="store_true", help="do not measure the client against the stub")
    for add in (add_workload_args, add_load_args, add_output_args):
        add(p)
    p.set_defaults(bench_run=run)


def _launch_args(name: str, port: int, ns: argparse.Namespace, engine_args: list[str]) -> tuple[list[str], str]:
    if ns.max_num_batched_tokens and name != "colocated-nochunk":
        engine_args = [*engine_args, "--max-num-batched-tokens", str(ns.max_num_batched_tokens)]
    per_worker = max(1, ns.total_threads // (ns.prefill + ns.decode))
    pin = ["--cpus-per-worker", str(per_worker)] if ns.pin else []
    pinned = " pinned" if ns.pin else ""
    if name == "pd":
        split = f"{per_worker}{pinned} x ({ns.prefill} prefill + {ns.decode} decode)"
        return [*local.pd_args(port, ns.prefill, ns.decode, per_worker, engine_args), *pin], split
    if name == "colocated-replicas":
        replicas = ns.prefill + ns.decode
        return ([*local.replicas_args(port, replicas, per_worker, engine_args), *pin],
                f"{per_worker}{pinned} x {replicas} replicas")
    return local.colocated_args(port, ns.total_threads, name == "colocated-chunked", engine_args), str(ns.total_threads)


def _ratio(value: float | None, base: float | None) -> str:
    if value is None or base is None or base == 0 or value != value or base != base:  # None or NaN
        return "n/a"
    return f"{value / base:.2f}x"


def ratio_table(runs: list[SystemRun]) -> tuple[list[str], list[list[str]]]:
    """Each system against the first (the baseline): P99 TPOT/TTFT below 1 and goodput/throughput above 1 are better."""
    base = runs[0].summary
    headers = ["system", "torch threads", "output tok/s", "TTFT P99 ms", "TPOT P99 ms", "goodput req/s",
               "throughput ratio", "TTFT P99 ratio", "TPOT P99 ratio", "goodput ratio"]
    rows = []
    for run_ in runs:
        s = run_.summary
        ttft, tpot = s.latency["ttft"].percentiles_ms[99], s.latency["tpot"].percentiles_ms[99]
        rows.append([run_.name, run_.threads, f"{s.output_throughput:.1f}", f"{ttft:.1f}", f"{tpot:.1f}",
                     "n/a" if s.request_goodput is None else f"{s.request_goodput:.3f}",
                     _ratio(s.output_throughput, base.output_throughput),
                     _ratio(ttft, base.latency["ttft"].percentiles_ms[99]),
                     _ratio(tpot, base.latency["tpot"].percentiles_ms[99]),
                     _ratio(s.request_goodput, base.request_goodput)])
    return headers, rows


def run(ns: argparse.Namespace) -> int:
    chosen = ns.systems or ",".join(PINNED_SYSTEMS if ns.pin else DEFAULT_SYSTEMS)
    systems = [s.strip() for s in chosen.split(",") if s.strip()]
    if unknown := [s for s in systems if s not in SYSTEMS]:
        raise ValueError(f"unknown system(s) {unknown}; choose from {SYSTEMS}")
    work = build_workload(ns)
    engine_args = shlex.split(ns.engine_args) + (["--model", ns.model] if ns.model else [])
    log_dir = ns.log_dir or Path(tempfile.mkdtemp(prefix="pdserve-compare-"))
    print(f"hardware: {hardware_line()}")
    print(f"workload: {work.name}, {len(work.requests)} requests, seed {ns.seed}; max concurrency "
          f"{ns.max_concurrency or 'none'}, request rate {ns.request_rate:g}; SLO {ns.slo}; logs in {log_dir}")
    if not ns.skip_capacity:
        print(capacity.measure(num_requests=500, output_len=64, concurrency=ns.max_concurrency or 64))
    runs = []
    for name in systems:
        port = local.free_port()
        args, threads = _launch_args(name, port, ns, engine_args)
        print(f"-- {name}: pdserve {' '.join(args)}")
        with local.running(name, args, port, log_dir, ns.ready_timeout) as server:
            config = replace(load_config(ns, server.url), model=None)  # --model is a path here
            result, summary = run_once(work, config, ns.slo, warmup=max(1, ns.warmup))
        print(format_summary(summary, title=name))
        if ns.save:  # NOTE: each system's own run too, as `pdserve bench --save` writes it (validate_sim reads it)
            save_json(ns.save.with_suffix(f".{name}.json"), result_json(result, summary, work.name))
        runs.append(SystemRun(name, threads, summary))
    question = "equal hardware: each worker on cores of its own" if ns.pin else "same total torch threads"
    print(f"\nratios against {runs[0].name} (same workload and seed; {question}):")
    print_table(*ratio_table(runs))
    if ns.save:
        save_json(ns.save, {"baseline": runs[0].name, "systems": [
            {"system": r.name, "torch_threads": r.threads, **r.summary.to_vllm_dict()} for r in runs]})
        print(f"saved {ns.save}")
    return 0
