"""`pdserve simulate`: one simulated run, or a sweep, with `pdserve bench`'s workloads, metrics and files.

    pdserve simulate --profile P.json --prefill 1 --decode 4 [bench workload/load flags]
    pdserve simulate --roofline H20:qwen3-8b --colocated 5 --max-concurrency 110
    pdserve simulate ... --concurrencies 30,100,150        concurrency ladder
    pdserve simulate ... --pd 1:1,1:2,1:4,1:8 [--with-colocated]   P:D ladder (and N = P + D colocated)
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

from pdserve.bench.common import print_table
from pdserve.bench.serve.command import add_load_args, add_output_args, add_workload_args
from pdserve.bench.serve.report import (
    SweepPoint,
    format_summary,
    format_sweep_table,
    plot_latency_cdfs,
    plot_sweep,
    result_json,
    save_json,
)
from pdserve.bench.serve.sweep import parse_ints, parse_ratios
from pdserve.model.facts import load_model_facts
from pdserve.sizing.devices import device
from pdserve.sizing.plan import PlanInputs, make_plan
from pdserve.sizing.profile import Limits, Profile, load_profile, roofline
from pdserve.sizing.sim.cluster import Topology
from pdserve.sizing.sim.run import (
    DISPATCH_S,
    ArrivalPattern,
    ClusterOptions,
    SimRun,
    arrivals,
    cluster_spec,
    simulate,
    workload_lengths,
)

TRANSPORTS = ("tcp", "erdma", "gdr", "nixl", "none")


def add_sim_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("simulated cluster")
    g.add_argument("--profile", type=Path, default=None, help="a profile from `pdserve calibrate`")
    g.add_argument("--roofline", default=None, metavar="DEVICE:MODEL",
                   help="a datasheet profile instead, e.g. H20:qwen3-8b (KV blocks from `pdserve plan`'s arithmetic)")
    g.add_argument("--transport", choices=TRANSPORTS, default="tcp",
                   help="PD hand-off: the profile's measured transport, or the seed's tcp/erdma/gdr rates")
    g.add_argument("--no-layerwise", action="store_true", help="send the KV only after the prefill step ends")
    g.add_argument("--dispatch-ms", type=float, default=DISPATCH_S * 1e3,
                   help="a request's way from the client to the router, and the gap between two sends; a worker "
                        "does not wait for a request still on its way (0: requests of one instant are batched)")
    g.add_argument("--early-first-token", action=argparse.BooleanOptionalAction, default=True,
                   help="PD: the client gets the first token when prefill sampled it (the router's "
                        "--early-first-token), "
                        "not once decode has the KV")
    g.add_argument("--pd-path-costs", action=argparse.BooleanOptionalAction, default=True,
                   help="PD: charge the profile's PD path costs (the router, the /pd/* hops, the hand-off: "
                        "`pdserve calibrate`'s served PD run; a profile without them has none)")
    g.add_argument("--max-num-seqs", type=int, default=None, help="per worker (default: the profile's)")
    g.add_argument("--decode-max-num-seqs", type=int, default=None, help="PD decode workers (default: --max-num-seqs)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="per worker (default: the profile's)")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="per worker (default: the profile's)")
    g.add_argument("--no-enable-chunked-prefill", action="store_true")
    g.add_argument("--max-queued-requests", type=int, default=512, help="the router's admission limit (429 beyond)")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="discrete-event simulation of colocated replicas or a P + D cluster",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("topology")
    g.add_argument("--colocated", type=int, default=0, help="N colocated replicas, one device each")
    g.add_argument("--prefill", type=int, default=0, help="P prefill workers")
    g.add_argument("--decode", type=int, default=0, help="D decode workers")
    g.add_argument("--concurrencies", type=parse_ints, default=None, help="sweep: concurrency ladder")
    g.add_argument("--pd", type=parse_ratios, default=None, help="sweep: P:D ratios, e.g. 1:1,1:2,1:4")
    g.add_argument("--with-colocated", action="store_true", help="--pd: also N = P + D colocated replicas")
    add_sim_args(p)
    for add in (add_workload_args, add_load_args, add_output_args):
        add(p)
    p.set_defaults(func=run)


def build_profile(ns: argparse.Namespace) -> Profile:
    if (ns.profile is None) == (ns.roofline is None):
        raise ValueError("give exactly one of --profile FILE and --roofline DEVICE:MODEL")
    if ns.profile is not None:
        profile = load_profile(ns.profile)
    else:
        name, _, model_name = ns.roofline.partition(":")
        spec, model = device(name), load_model_facts(model_name or "qwen3-8b")
        plan = make_plan(PlanInputs(spec.memory_bytes, 0.9, model, overhead_bytes=2 * 1024**3, mean_input_len=1,
                                    output_len=1))
        profile = roofline(model, spec, Limits(plan.num_kv_blocks or 1, max_num_seqs=256, max_num_batched_tokens=8192))
    return profile.with_limits(ns.num_kv_blocks, ns.max_num_seqs, ns.max_num_batched_tokens)


@dataclass(frozen=True, slots=True)
class _Setup:
    profile: Profile
    workload: str
    lengths: list[tuple[int, int]]


def run_one(ns: argparse.Namespace, setup: _Setup, topology: Topology, concurrency: int | None) -> SimRun:
    options = ClusterOptions(not ns.no_layerwise, ns.decode_max_num_seqs, ns.max_queued_requests,
                             not ns.no_enable_chunked_prefill, ns.early_first_token, ns.dispatch_ms / 1e3,
                             ns.pd_path_costs)
    spec = cluster_spec(setup.profile, topology, None if ns.transport == "none" else ns.transport, options)
    return simulate(spec, arrivals(setup.lengths, ns.request_rate, ns.burstiness, ns.seed), concurrency, ns.slo,
                    f"sim {setup.profile.name}", ArrivalPattern(ns.request_rate, ns.burstiness, ns.seed))


def _points(ns: argparse.Namespace, setup: _Setup) -> list[SweepPoint]:
    points = []
    if ns.pd:
        for p, d in ns.pd:
            topologies = [Topology(num_prefill=p, num_decode=d)]
            if ns.with_colocated:
                topologies.append(Topology(num_colocated=p + d))
            for topology in topologies:
                run = run_one(ns, setup, topology, ns.max_concurrency)
                label = f"{p}:{d}" if topology.is_pd else f"col{p + d}"
                points.append(SweepPoint(label, topology.num_devices, run.summary))
        return points
    topology = Topology(ns.colocated, ns.prefill, ns.decode)
    for concurrency in ns.concurrencies:
        points.append(SweepPoint(str(concurrency), concurrency, run_one(ns, setup, topology, concurrency).summary))
    return points


def run(ns: argparse.Namespace) -> int:
    profile = build_profile(ns)
    workload, lengths = workload_lengths(ns)
    setup = _Setup(profile, workload, lengths)
    rate = "inf" if math.isinf(ns.request_rate) else f"{ns.request_rate:g}/s"
    print(f"pdserve simulate: profile {profile.name} ({profile.source}); {workload}, {len(lengths)} requests, "
          f"max concurrency {ns.max_concurrency or 'none'}, rate {rate}, seed {ns.seed}, transport {ns.transport}")
    pd = bool(ns.pd) or ns.prefill > 0
    if pd and ns.pd_path_costs and profile.pd_path is None:
        print(f"note: profile {profile.name} (version {profile.version}, {profile.source}) has no PD path costs: the "
              f"simulated PD TTFT leaves out the router, the /pd/* hops and the hand-off (re-run `pdserve calibrate` "
              f"without --served-requests 0 for them)")
    if ns.pd or ns.concurrencies:
        return _sweep(ns, setup)
    run_ = run_one(ns, setup, Topology(ns.colocated, ns.prefill, ns.decode), ns.max_concurrency)
    print(format_summary(run_.summary, title=f"Simulated: {run_.cluster.spec.topology}"))
    print(f"simulated {len(lengths)} requests in {run_.wall_s:.2f} s wall ({run_.cpu_s:.2f} s CPU); "
          f"preemptions {run_.num_preemptions}; KV transfers {run_.cluster.num_transfers}")
    if ns.save:
        save_json(ns.save, result_json(run_.result, run_.summary, workload))
        print(f"saved {ns.save}")
    if ns.plot:
        print(f"plotted {plot_latency_cdfs(run_.result, ns.plot)}")
    return 0


def _sweep(ns: argparse.Namespace, setup: _Setup) -> int:
    points = _points(ns, setup)
    x_header = "P:D" if ns.pd else "concurrency"
    headers, rows = format_sweep_table(points, x_header)
    print_table(headers, rows)
    if ns.save:
        save_json(ns.save, {"sweep": x_header, "simulated": True, "profile": setup.profile.name, "points": [
            {"label": p.label, "x": p.x, **p.summary.to_vllm_dict()} for p in points]})
        print(f"saved {ns.save}")
    if ns.plot:
        name = "sim_pd_sweep" if ns.pd else "sim_concurrency_sweep"
        print(f"plotted {plot_sweep(points, ns.plot, 'devices (P + D)' if ns.pd else 'max concurrency', name)}")
    return 0
