"""Simulator vs real runs: simulate the workload of saved `pdserve bench` results and compare.

    python -m pdserve.sizing.validate_sim --profile PROFILE.json \\
        --run colocated:2=colocated.json --run pd:1:1=pd.json [--transport tcp] [--save table.json]

Each `--run CONFIG=FILE` names a real run's `--save` file and the cluster it ran on:
`colocated:N` (N colocated replicas behind the router, one device or core set each) or `pd:P:D`.
The simulation replays that run exactly: the same prompt and output lengths in the same order
(the file's `input_lens`/`output_lens`), the same arrivals (`request_rate`, `burstiness`, `seed`)
and concurrency cap (`max_concurrency`). Engine limits come from the profile unless overridden
(`--max-num-seqs`, `--max-num-batched-tokens`, `--num-kv-blocks`, as the real workers were
started). The table gives TTFT and TPOT median and P99, and output throughput, real vs simulated,
with the error (sim - real) / real; targets: medians within 15 %, P99s within 25 %.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from pdserve.bench.common import print_table
from pdserve.sizing.sim.cluster import Topology
from pdserve.sizing.sim.run import ClusterOptions, arrivals, cluster_spec, simulate
from pdserve.sizing.simulate_command import add_sim_args, build_profile

METRICS = (("median_ttft_ms", 0.15), ("p99_ttft_ms", 0.25), ("median_tpot_ms", 0.15), ("p99_tpot_ms", 0.25),
           ("output_throughput", 0.15))


@dataclass(frozen=True, slots=True)
class RealRun:
    label: str
    topology: Topology
    path: Path


def parse_run(text: str) -> RealRun:
    """`colocated:2=FILE` or `pd:1:1=FILE`."""
    config, sep, path = text.partition("=")
    parts = config.split(":")
    try:
        if sep and parts[0] == "colocated" and len(parts) == 2:
            return RealRun(config, Topology(num_colocated=int(parts[1])), Path(path))
        if sep and parts[0] == "pd" and len(parts) == 3:
            return RealRun(config, Topology(num_prefill=int(parts[1]), num_decode=int(parts[2])), Path(path))
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"bad --run {text!r}: expected colocated:N=FILE or pd:P:D=FILE")


def simulate_like(ns: argparse.Namespace, run: RealRun, doc: dict) -> dict:
    """The simulated counterpart of one saved run, as vLLM-keyed metrics."""
    lengths = list(zip(doc["input_lens"], doc["output_lens"], strict=True))
    if doc.get("failed"):
        print(f"warning: {run.path}: {doc['failed']} failed requests are not replayed (their lengths are not saved)",
              file=sys.stderr)
    rate = math.inf if doc.get("request_rate", "inf") == "inf" else float(doc["request_rate"])
    profile = build_profile(ns)
    options = ClusterOptions(not ns.no_layerwise, ns.decode_max_num_seqs, ns.max_queued_requests,
                             not ns.no_enable_chunked_prefill, ns.early_first_token, ns.dispatch_ms / 1e3)
    spec = cluster_spec(profile, run.topology, None if ns.transport == "none" else ns.transport, options)
    sim = simulate(spec, arrivals(lengths, rate, float(doc.get("burstiness", 1.0)), int(doc.get("seed", 0))),
                   doc.get("max_concurrency"))
    return sim.summary.to_vllm_dict()


def error(sim: float | None, real: float | None) -> float:
    if sim is None or real is None or real == 0 or math.isnan(sim) or math.isnan(real):
        return math.nan
    return (sim - real) / real


def compare(ns: argparse.Namespace) -> list[dict]:
    rows = []
    for run in ns.run:
        doc = json.loads(run.path.read_text())
        sim = simulate_like(ns, run, doc)
        for key, target in METRICS:
            err = error(sim[key], doc.get(key))
            rows.append({"config": run.label, "metric": key, "real": doc.get(key), "sim": sim[key], "error": err,
                         "target": target, "ok": not math.isnan(err) and abs(err) <= target})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.sizing.validate_sim", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=parse_run, action="append", required=True, metavar="CONFIG=FILE")
    parser.add_argument("--save", type=Path, default=None, help="the table as JSON")
    add_sim_args(parser)
    ns = parser.parse_args(argv)
    try:
        rows = compare(ns)
    except (ValueError, OSError, KeyError) as exc:
        print(f"validate_sim: {exc!r}", file=sys.stderr)
        return 2
    print_table(["config", "metric", "real", "sim", "error", "within"],
                [[r["config"], r["metric"], _num(r["real"]), _num(r["sim"]), f"{r['error']:+.1%}",
                  f"{'yes' if r['ok'] else 'NO'} ({r['target']:.0%})"] for r in rows])
    if ns.save:
        ns.save.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    sys.exit(main())
