"""`pdserve bench sweep`: the seed's staged load test.

- Concurrency ladder against a running server (`--url`): the same workload at each concurrency
  (seed: 30 -> 100 -> 150; the default ladder is that times --scale, at least 1).
- P:D ratio sweep (`--pd 2:2,2:4,2:6,2:8`): for each ratio this command starts a local cluster with
  `pdserve up`, runs the workload at one concurrency, and stops the cluster before the next one.

Both print one table and, with --plot, draw "instances (or concurrency) - P99 latency - throughput".
"""

from __future__ import annotations

import argparse
import shlex
import tempfile
from dataclasses import replace
from pathlib import Path

from pdserve.bench.common import hardware_line, print_table
from pdserve.bench.serve import local
from pdserve.bench.serve.report import SweepPoint, format_sweep_table, plot_sweep, save_json
from pdserve.bench.serve.runs import (
    add_load_args,
    add_output_args,
    add_workload_args,
    build_workload,
    load_config,
    run_once,
)

SEED_LADDER = (30, 100, 150)


def default_ladder(scale: float) -> list[int]:
    return sorted({max(1, round(c * scale)) for c in SEED_LADDER})


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_ratios(text: str) -> list[tuple[int, int]]:
    """`2:2,2:4` -> [(2, 2), (2, 4)] (prefill, decode)."""
    ratios = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        prefill, _, decode = item.partition(":")
        ratios.append((int(prefill), int(decode)))
    if not ratios or any(p < 1 or d < 1 for p, d in ratios):
        raise ValueError(f"bad --pd {text!r}: expected P:D pairs like 2:2,2:4")
    return ratios


def add_parser(modes: argparse._SubParsersAction) -> None:
    p = modes.add_parser("sweep", help="concurrency ladder (--url) or P:D ratio sweep on local clusters (--pd)",
                         description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="server to sweep concurrency against (not with --pd)")
    p.add_argument("--concurrencies", type=parse_ints, default=None,
                   help="comma-separated ladder (default: 30,100,150 x --scale)")
    p.add_argument("--pd", type=parse_ratios, default=None, help="P:D ratios to launch with `pdserve up`, e.g. 2:2,2:4")
    p.add_argument("--threads-per-worker", type=int, default=None,
                   help="--pd: torch threads per worker (default: `pdserve up`'s split, CPUs // workers)")
    p.add_argument("--engine-args", default="", help="--pd: extra flags for the workers, e.g. '--num-kv-blocks 512'")
    p.add_argument("--ready-timeout", type=float, default=300.0, help="--pd: seconds a cluster may take to start")
    p.add_argument("--log-dir", type=Path, default=None, help="--pd: where the clusters' logs go (default: a temp dir)")
    for add in (add_workload_args, add_load_args, add_output_args):
        add(p)
    p.set_defaults(bench_run=run)


def _concurrency_ladder(ns: argparse.Namespace) -> list[SweepPoint]:
    work = build_workload(ns)
    points = []
    for concurrency in ns.concurrencies or default_ladder(ns.scale):
        print(f"-- concurrency {concurrency}: {work.name}, {len(work.requests)} requests")
        config = load_config(ns, ns.url, max_concurrency=concurrency)
        _, summary = run_once(work, config, ns.slo, ns.warmup)
        points.append(SweepPoint(str(concurrency), concurrency, summary))
    return points


def _pd_sweep(ns: argparse.Namespace) -> list[SweepPoint]:
    work = build_workload(ns)
    ladder = default_ladder(ns.scale)
    concurrency = ns.max_concurrency or ladder[len(ladder) // 2]  # the seed ran its P:D sweep mid-ladder
    log_dir = ns.log_dir or Path(tempfile.mkdtemp(prefix="pdserve-bench-"))
    engine_args = shlex.split(ns.engine_args)
    if ns.model:
        engine_args += ["--model", ns.model]
    points = []
    for prefill, decode in ns.pd:
        threads = ns.threads_per_worker or local.up_threads_per_worker(prefill + decode)
        port = local.free_port()
        args = local.pd_args(port, prefill, decode, threads, engine_args)
        print(f"-- P:D {prefill}:{decode} ({threads} torch threads per worker), concurrency {concurrency}: "
              f"{work.name}, {len(work.requests)} requests; log {log_dir}/pd-{prefill}-{decode}.log")
        with local.running(f"pd-{prefill}-{decode}", args, port, log_dir, ns.ready_timeout) as server:
            # NOTE: the model id comes from the cluster's /v1/models; --model is the checkpoint path here.
            config = replace(load_config(ns, server.url, max_concurrency=concurrency), model=None)
            _, summary = run_once(work, config, ns.slo, warmup=max(1, ns.warmup))  # a fresh cluster: warm it
        points.append(SweepPoint(f"{prefill}:{decode}", prefill + decode, summary))
    return points


def run(ns: argparse.Namespace) -> int:
    if bool(ns.url) == bool(ns.pd):
        raise ValueError("give either --url (concurrency ladder) or --pd (P:D sweep on local clusters)")
    print(f"hardware: {hardware_line()}")
    points = _pd_sweep(ns) if ns.pd else _concurrency_ladder(ns)
    x_header = "P:D" if ns.pd else "concurrency"
    headers, rows = format_sweep_table(points, x_header)
    print_table(headers, rows)
    if ns.save:
        save_json(ns.save, {"sweep": x_header, "points": [
            {"label": p.label, "x": p.x, **p.summary.to_vllm_dict()} for p in points]})
        print(f"saved {ns.save}")
    if ns.plot:
        name = "pd_sweep" if ns.pd else "concurrency_sweep"
        x_label = "instances (P + D)" if ns.pd else "max concurrency"
        print(f"plotted {plot_sweep(points, ns.plot, x_label, name)}")
    return 0
