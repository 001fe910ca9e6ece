"""One simulated run: bench's workload and arrivals in, bench's records and summary out."""

from __future__ import annotations

import argparse
import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pdserve.bench.serve import workloads
from pdserve.bench.serve.client import LoadConfig, LoadResult, RequestRecord
from pdserve.bench.serve.metrics import Slo, Summary, summarize
from pdserve.sizing.profile import PDPathCosts, Profile
from pdserve.sizing.sim.cluster import Arrival, Cluster, ClusterSpec, Topology
from pdserve.sizing.sim.request import SimRequest
from pdserve.sizing.sim.worker import WorkerLimits


@dataclass(frozen=True, slots=True)
class SimRun:
    result: LoadResult  # what `pdserve bench` would have recorded
    summary: Summary
    cluster: Cluster
    wall_s: float  # how long the simulation itself took
    cpu_s: float  # its CPU time (on a shared machine, wall time says more about the neighbours)

    @property
    def num_preemptions(self) -> int:
        return sum(w.num_preemptions for w in self.cluster.workers)


def seed_mix_lengths(num_requests: int, scale: float, output_len: int | None, seed: int) -> list[tuple[int, int]]:
    """The (prompt, output) lengths `workloads.seed_mix` draws, without drawing the prompts (the
    shuffle comes first with the same generator, so the order is the same)."""
    rng = np.random.default_rng(seed)
    out = output_len if output_len is not None else workloads.scaled(workloads.SEED_MIX_OUTPUT_LEN, scale, minimum=2)
    counts = workloads.mix_counts(num_requests, workloads.SEED_MIX_WEIGHTS)
    lens = [workloads.scaled(n, scale) for n, c in zip(workloads.SEED_MIX_INPUT_LENS, counts, strict=True)
            for _ in range(c)]
    rng.shuffle(lens)
    return [(n, out) for n in lens]


def workload_lengths(ns: argparse.Namespace) -> tuple[str, list[tuple[int, int]]]:
    """The workload `pdserve bench` builds from the same flags, as lengths only."""
    if ns.workload == "seed-mix":
        return f"seed-mix x{ns.scale:g}", seed_mix_lengths(ns.num_prompts, ns.scale, ns.output_len, ns.seed)
    from pdserve.bench.serve.command import build_workload

    work = build_workload(ns)
    return work.name, [(r.prompt_len, r.max_tokens) for r in work.requests]


# NOTE: a request's way from the client to the router over loopback HTTP, and the gap between two
# sends of one client: a few ms on the 2-vCPU VM (`pdserve serve` adds ~6 ms to the offline engine's
# TTFT of a 4-token prompt, git history of docs/BENCHMARKS.md)
DISPATCH_S = 0.002


def arrivals(lengths: Sequence[tuple[int, int]], request_rate: float, burstiness: float, seed: int) -> list[Arrival]:
    offsets = workloads.arrival_offsets_s(len(lengths), request_rate, burstiness, seed)
    return [Arrival(p, o, t) for (p, o), t in zip(lengths, offsets, strict=True)]


@dataclass(frozen=True, slots=True)
class ClusterOptions:
    """How a simulated cluster runs, beside its profile and topology. Decode workers may have their
    own `max_num_seqs`. `early_first_token`: as the router's `--early-first-token` (on by default),
    the first token of a PD request reaches the client when prefill sampled it (the router sends it
    early for greedy and seeded requests of one sequence; bench's are greedy). `dispatch_s`: see
    cluster.py's Client. `pd_path_costs`: charge the profile's PD path costs (profile.PDPathCosts; a
    profile without them: none)."""

    layerwise: bool = True
    decode_max_num_seqs: int | None = None
    max_queued_requests: int = 512
    enable_chunked_prefill: bool = True
    early_first_token: bool = True
    dispatch_s: float = DISPATCH_S
    pd_path_costs: bool = True


def cluster_spec(profile: Profile, topology: Topology, transport: str | None,
                 options: ClusterOptions = ClusterOptions()) -> ClusterSpec:
    """Every worker has the profile's limits, the cluster `options`' settings."""
    limits = WorkerLimits(profile.num_kv_blocks, profile.block_size, profile.max_num_seqs,
                          profile.max_num_batched_tokens, options.enable_chunked_prefill)
    seqs = options.decode_max_num_seqs or profile.max_num_seqs
    decode = WorkerLimits(profile.num_kv_blocks, profile.block_size, seqs, max(seqs, profile.max_num_batched_tokens))
    transfer = profile.transport(transport) if transport and topology.is_pd else None
    costs = profile.pd_path if options.pd_path_costs and profile.pd_path is not None else PDPathCosts()
    return ClusterSpec(topology, profile.step, limits, decode, transfer, profile.kv_bytes_per_token,
                       profile.model.num_layers, options.layerwise, options.max_queued_requests, profile.decode_step,
                       options.early_first_token, options.dispatch_s, profile.prefill_step, costs)


def to_record(request_index: int, r: SimRequest) -> RequestRecord:
    assert r.finished_s is not None, "a request never finished"
    e2e = r.finished_s - r.sent_s
    if r.error_kind is not None:
        return RequestRecord(request_index, r.sent_s, e2e, r.prompt_len, 0, error_kind=r.error_kind,
                             error=f"simulated {r.error_kind}")
    # NOTE: in order: the router relays a PD request's decode tokens after its first (and the load's relay delay)
    relayed = (t - r.sent_s + (r.relay_s if i else 0.0) for i, t in enumerate(r.token_times_s))
    times = tuple(itertools.accumulate(relayed, max))
    return RequestRecord(request_index, r.sent_s, e2e, r.prompt_len, r.generated, times[0], times)


@dataclass(frozen=True, slots=True)
class ArrivalPattern:
    """How the arrivals were drawn (`arrivals`), recorded with a run's result."""

    request_rate: float = math.inf
    burstiness: float = 1.0
    seed: int = 0


def simulate(spec: ClusterSpec, arrivals_: Sequence[Arrival], max_concurrency: int | None, slo: Slo | None = None,
             label: str = "sim", pattern: ArrivalPattern = ArrivalPattern()) -> SimRun:
    """Run the cluster on the arrivals; every request ends finished or refused (checked)."""
    start, start_cpu = time.perf_counter(), time.process_time()
    cluster = Cluster(spec, max_concurrency)
    done = cluster.run(arrivals_)
    # NOTE: conservation: every request sent, every one ended, no KV block left behind
    stalled = sum(r.finished_s is None for r in done) + len(arrivals_) - len(done)
    if stalled:
        raise RuntimeError(f"simulation stalled: {stalled} requests never finished (a scheduler deadlock)")
    assert all(w.free_blocks == w.limits.num_kv_blocks for w in cluster.workers), "KV blocks leaked"
    records = tuple(to_record(r.index, r) for r in sorted(done, key=lambda r: r.index))
    duration = max((r.finished_s or 0.0) for r in done) if done else 0.0
    config = LoadConfig(base_url=f"sim://{spec.topology}", model=label, max_concurrency=max_concurrency,
                        request_rate=pattern.request_rate, burstiness=pattern.burstiness, seed=pattern.seed,
                        progress=False)
    result = LoadResult(records, duration, label, config)
    summary = summarize(records, duration, slo)
    return SimRun(result, summary, cluster, time.perf_counter() - start, time.process_time() - start_cpu)
