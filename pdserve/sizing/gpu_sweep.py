"""The seed's P:D experiment at GPU scale, simulated (DIGEST 18-19): roofline profiles, equal devices.

    python -m pdserve.sizing.gpu_sweep [--devices H20,H800] [--model qwen3-8b] [--prefill 2]
        [--decode 2,4,6,8,12,16] [--concurrency 110] [--num-prompts 1000] [--plot docs/img] [--save FILE]

For each device: P prefill + D decode workers for each D (P:D 1:1 to 1:8), against N = P + D
colocated replicas (one device each) on the same workload: the seed mix (500/2000/5000 tokens at
6:3:1, 500 out) at a fixed concurrency, KV over the seed's eRDMA rate, layer-wise. Every worker's
`--max-num-seqs` and KV blocks come from `pdserve plan`'s arithmetic for that device; prefill
workers get an 8192-token budget, colocated replicas vLLM's chunked-prefill default of 2048 (a
stronger TPOT baseline than 8192: smaller chunks stall decode less).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from pdserve.bench.common import print_table
from pdserve.bench.serve.metrics import Summary
from pdserve.bench.serve.report import save_json
from pdserve.model.facts import load_model_facts
from pdserve.sizing.devices import device
from pdserve.sizing.plan import GIB, PlanInputs, make_plan
from pdserve.sizing.profile import Limits, Profile, roofline
from pdserve.sizing.sim.cluster import Topology
from pdserve.sizing.sim.run import arrivals, cluster_spec, seed_mix_lengths, simulate

PREFILL_BUDGET = 8192
COLOCATED_BUDGET = 2048


@dataclass(frozen=True, slots=True)
class Point:
    device: str
    label: str  # "2:8" or "col10"
    num_devices: int
    summary: Summary
    wall_s: float


def device_profile(device_name: str, model_name: str) -> Profile:
    spec, model = device(device_name), load_model_facts(model_name)
    plan = make_plan(PlanInputs(spec.memory_bytes, 0.9, model, overhead_bytes=2 * GIB, mean_input_len=1400,
                                max_input_len=5000, output_len=500))
    return roofline(model, spec, Limits(plan.num_kv_blocks or 1, plan.max_num_seqs, PREFILL_BUDGET))


def sweep_device(ns: argparse.Namespace, device_name: str) -> list[Point]:
    profile = device_profile(device_name, ns.model)
    work = arrivals(seed_mix_lengths(ns.num_prompts, 1.0, None, ns.seed), float("inf"), 1.0, ns.seed)
    points = []
    for d in ns.decode:
        for topology, limits in ((Topology(num_prefill=ns.prefill, num_decode=d), profile),
                                 (Topology(num_colocated=ns.prefill + d),
                                  profile.with_limits(max_num_batched_tokens=COLOCATED_BUDGET))):
            run = simulate(cluster_spec(limits, topology, "erdma"), work, ns.concurrency)
            label = f"{ns.prefill}:{d}" if topology.is_pd else f"col{ns.prefill + d}"
            points.append(Point(device_name, label, topology.num_devices, run.summary, run.wall_s))
    return points


def table(points: list[Point]) -> tuple[list[str], list[list[str]]]:
    headers = ["device", "system", "devices", "out tok/s", "tok/s/device", "TTFT P99 s", "TPOT med ms",
               "TPOT P99 ms", "failed", "sim wall s"]
    rows = []
    for p in points:
        s = p.summary
        rows.append([p.device, p.label, str(p.num_devices), f"{s.output_throughput:.0f}",
                     f"{s.output_throughput / p.num_devices:.0f}", f"{s.latency['ttft'].percentiles_ms[99] / 1e3:.2f}",
                     f"{s.latency['tpot'].median_ms:.1f}", f"{s.latency['tpot'].percentiles_ms[99]:.1f}",
                     str(s.failed), f"{p.wall_s:.1f}"])
    return headers, rows


def plot(points: list[Point], devices: list[str], out_dir: Path, name: str = "sim_pd_sweep") -> Path:
    from pdserve.bench.serve.report import _pyplot, save_figure

    plt = _pyplot()
    fig, axes = plt.subplots(len(devices), 3, figsize=(15, 3.8 * len(devices)), squeeze=False)
    for row, device_name in zip(axes, devices, strict=True):
        mine = [p for p in points if p.device == device_name]
        for system, style in (("PD", "o-"), ("colocated", "s--")):
            sel = [p for p in mine if p.label.startswith("col") == (system == "colocated")]
            xs = [p.num_devices for p in sel]
            row[0].plot(xs, [p.summary.output_throughput for p in sel], style, label=system)
            row[1].plot(xs, [p.summary.latency["tpot"].percentiles_ms[99] for p in sel], style, label=system)
            row[2].plot(xs, [p.summary.latency["ttft"].percentiles_ms[99] / 1e3 for p in sel], style, label=system)
        pd_points = [p for p in mine if not p.label.startswith("col")]
        for ax, title in zip(row, ("output tok/s", "TPOT P99 (ms)", "TTFT P99 (s)"), strict=True):
            ax.set_title(f"{device_name}: {title}")
            ax.set_xlabel("devices (P:D for PD)")
            ax.set_xticks([p.num_devices for p in pd_points], [f"{p.num_devices}\n{p.label}" for p in pd_points])
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    return save_figure(fig, out_dir, name, dpi=90)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", default="H20,H800")
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--prefill", type=int, default=2)
    parser.add_argument("--decode", type=lambda t: [int(x) for x in t.split(",")], default=[2, 4, 6, 8, 12, 16])
    parser.add_argument("--concurrency", type=int, default=110)
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--save", type=Path, default=None)
    parser.add_argument("--name", default="sim_pd_sweep", help="the plot's file name (without .png)")
    ns = parser.parse_args(argv)
    devices = ns.devices.split(",")
    for name in devices:
        p = device_profile(name, ns.model)
        print(f"{p.name}: {p.notes}; max_num_seqs {p.max_num_seqs}, {p.num_kv_blocks} KV blocks; step {p.step}")
    points = [p for name in devices for p in sweep_device(ns, name)]
    print_table(*table(points))
    if ns.save:
        save_json(ns.save, {"points": [{"device": p.device, "label": p.label, "devices": p.num_devices,
                                        **p.summary.to_vllm_dict()} for p in points]})
    if ns.plot:
        print(f"plotted {plot(points, devices, ns.plot, ns.name)}")


if __name__ == "__main__":
    main()
