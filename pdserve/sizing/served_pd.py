"""`pdserve calibrate`'s served PD run: the costs a PD request has beyond the steps timed alone.

Timed alone (`calibrate.measure_steps`), an engine step leaves out what serving adds to it, and the
simulator's PD path had none of the router's and the workers' HTTP hops: the default calibrate ->
simulate -> bench loop missed the real PD TTFT median by 89 % (the git history of docs/BENCHMARKS.md). So
calibrate also starts a small real cluster the way `pdserve up` runs one (1 prefill + 1 decode
worker, the calibrated engine flags and threads, `PDSERVE_STEP_LOG` on) and drives it with
`pdserve bench`'s client:

1. **Isolated requests** (`probe`, one at a time): what the simulator predicts for a request alone
   is its dispatch, a prefill step, the transfer and a decode step; what the client saw beyond that
   is the PD path's fixed cost. `PDPathCosts.first_token_s` is the median first token's excess,
   `handoff_s` the second token's (both measured against the simulator itself, run on the same
   requests with the served steps below, so the two agree on an isolated request by construction).
2. **Loads** (`rounds` short ones of `load` requests, then `long_rounds` long ones of `long_load`,
   each at `concurrency`, all sent at once, a fresh draw of prompts each; within a load one length,
   as bench's `random` workload, and the loads alternate two lengths, half and one and a half times
   `input_len`: two lengths tell the served prefill step's scale from its shift, which steps of one
   length trade against each other). A closed loop of one-length requests runs in waves, which the
   prefill worker batches; a short load is mostly waves, a long one loses them after a few:
   - the steps the two workers logged while serving (their period: the step and any gap while work
     waited). Each role's served step is the timed step model scaled and shifted, `a x timed + b`,
     fitted to that role's logged steps (least squares on the seconds, a decode step weighted by its
     sequences, see `fit_served`): the timed model keeps the shape over the whole grid, the served
     run says what serving does to it (the API server's loop and the KV transport sharing the
     worker's process, the router and the client sharing the cores);
   - the PD path's load-dependent costs (`first_token_per_streaming_s`: per other request in
     flight past its first token, `handoff_per_waiting_s`: per other request not yet at its decode
     worker): under load the first token's way shares the router's and the workers' loops (and a
     CPU host's cores) with the other requests' token relays, and the hand-off waits behind the
     others'; the simulator, run on the same requests at the same concurrency, gets a load's real
     first- and second-token medians with them (bisection), solved for each load apart. The first
     token's cost is the median of the long loads' solutions: a steady load's first token shares
     the loops with seven streams, a wave's with none (its step's batch holds it back instead).
     The hand-off's cost is the median of the short loads' solutions with that first-token cost
     held: it counts the others not yet at decode, which a wave has many of and a steady load one
     or two, so a long load's solution stands for whatever else holds a steady load's second token
     back (2-3x the short loads': +40-70 % on a waves workload's TPOT). What the costs count, and
     what the earlier profile versions counted, is `PDPathCosts`'s story.
"""

from __future__ import annotations

import asyncio
import math
import os
import statistics
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from pdserve.bench.serve.client import LoadConfig, RequestRecord, run_load
from pdserve.bench.serve.workloads import PromptKind, Workload, random_lengths
from pdserve.config import EngineArgs
from pdserve.config_flags import to_argv
from pdserve.engine.step_log import read_step_logs, step_log_role
from pdserve.envs import STEP_LOG
from pdserve.sizing.profile import PDPathCosts, Profile, StepModel

# NOTE: the isolated requests: a short prompt, a few tokens (the second token's time is the hand-off's)
PROBE_PROMPT_LEN = 32
PROBE_OUTPUT_LEN = 8


@dataclass(frozen=True, slots=True)
class ServedPlan:
    probe: int = 12  # isolated requests
    load: int = 48  # requests of each load
    rounds: int = 4  # loads (fresh prompts each): the hand-off's load-dependent cost is the median of their fits
    long_load: int = 144  # requests of each long load (0: none; the short loads then fit both costs)
    long_rounds: int = 2  # long loads: the first token's load-dependent cost is the median of their fits
    concurrency: int = 8  # the load's concurrency (capped by max_num_seqs)
    input_len: int = 96  # the loads' mean prompt (each load of one length: input_len / 2, then x 3 / 2)
    output_len: int = 24
    ready_timeout_s: float = 600.0


def load_prompt_len(plan: ServedPlan, n: int) -> int:
    """Load n's prompt length: half `input_len`, then one and a half times, in turn."""
    return max(1, plan.input_len // 2 if n % 2 == 0 else plan.input_len * 3 // 2)


@dataclass(frozen=True, slots=True)
class Step:
    """One logged step: the timed model's prediction for its work, its served period, and its weight
    in the fit (a decode step's sequences, each of which got a token; 1 for a prefill step)."""

    predicted_s: float
    seconds: float
    weight: float = 1.0


@dataclass(frozen=True, slots=True)
class Load:
    """One load of the served run: its requests' records, the workload sent, its concurrency, and
    whether it is a long one (it fits the first token's cost; a short one, the hand-off's)."""

    records: tuple[RequestRecord, ...]
    workload: Workload
    concurrency: int
    long: bool = False


@dataclass(frozen=True, slots=True)
class ServedRun:
    probe: tuple[RequestRecord, ...]
    probe_workload: Workload
    loads: tuple[Load, ...]
    steps: dict[str, list[Step]]  # role ("prefill", "decode") -> its logged steps
    transport: str


def fit_served(timed: StepModel, steps: list[Step]) -> tuple[StepModel, float, float]:
    """`a x timed + b` fitted to the served steps by least squares on the seconds (not the relative
    error: the simulator must get the role's busy time right, and served steps spread widely, which
    a relative fit answers with too short a step), each step weighted by `Step.weight`; where b
    comes out negative, b = 0 and a is the ratio of the weighted sums. Returns the served step
    model, a and b.

    Why a decode step weighs as its sequences: a request's TPOT is the mean over its tokens, so the
    TPOT median follows the step periods seen per token, not per step. Unweighted, the small decode
    steps that run while the rest of a wave is prefilled and handed off (1.2-1.7x their timed step
    on a 2-vCPU host, where the router, both API processes and the prefill engine want the same
    cores) set the scale of the full-batch steps (1.06x): the loop's 48-prompt TPOT median came out
    +18 % (the git history of docs/BENCHMARKS.md)."""
    y = np.array([s.seconds for s in steps])
    x = np.array([[s.predicted_s, 1.0] for s in steps])
    w = np.array([s.weight for s in steps])
    root = np.sqrt(w)
    (a, b), *_ = np.linalg.lstsq(x * root[:, None], y * root, rcond=None)
    if b < 0 or a <= 0:
        a, b = float((w * y).sum() / (w * x[:, 0]).sum()), 0.0
    a, b = float(a), float(b)
    model = StepModel(timed.base_s * a + b, timed.prefill_token_s * a, timed.prefill_pair_s * a,
                      timed.decode_seq_s * a, timed.decode_context_s * a)
    return model, a, b


def _token_s(records: Sequence[RequestRecord], index: int) -> float:
    """The median time of the `index`-th token (0: the first) since each request was sent."""
    return statistics.median(r.chunk_times_s[index] for r in records if r.ok and len(r.chunk_times_s) > index)


def _simulated(profile: Profile, costs: PDPathCosts, transport: str, workload: Workload,
               concurrency: int) -> tuple[RequestRecord, ...]:
    from pdserve.sizing.sim.cluster import Arrival, Topology
    from pdserve.sizing.sim.run import cluster_spec, simulate

    # NOTE: a transport the profile did not time (nixl, with `--transports tcp`): its tcp model, or the seed's
    # (what `pdserve simulate`'s default `--transport tcp` charges; the costs take up the difference)
    known = transport if transport in profile.transports else "tcp"
    spec = cluster_spec(replace(profile, pd_path=costs), Topology(num_prefill=1, num_decode=1), known)
    return simulate(spec, [Arrival(r.prompt_len, r.max_tokens, 0.0) for r in workload.requests], concurrency
                    ).result.records


def _solve(excess: Callable[[float], float], high: float) -> float:
    """The x in [0, high] where excess(x) (increasing) crosses 0, by bisection; 0 if it is above 0
    there. A median of a few dozen requests moves in steps: where it jumps over 0, the side of the
    jump nearer 0 (the midpoint may land on the far side: a hand-off's cost 2 ms off the load's
    second-token median in a test, when the near side was 0.1 ms off)."""
    low, low_excess = 0.0, excess(0.0)
    if low_excess >= 0:
        return low
    high_excess = math.inf  # NOTE: `high` itself is not simulated: until a midpoint crosses, low is nearer
    for _ in range(30):
        mid = (low + high) / 2
        mid_excess = excess(mid)
        if mid_excess < 0:
            low, low_excess = mid, mid_excess
        else:
            high, high_excess = mid, mid_excess
    return low if -low_excess < high_excess else high


def path_costs(profile: Profile, run: ServedRun) -> PDPathCosts:
    """The PD path's costs (profile: with its served steps): the fixed parts are the isolated
    requests' first and second token medians in excess of the simulator's for the same requests;
    the load-dependent parts are, for each load, those that make the simulator's first and second
    token medians of the load (same requests, same concurrency) the real ones: the median over the
    loads. The first token's cost comes from the long loads (no waves: a request's others stream),
    the hand-off's from the short ones (waves: many others not yet at decode), each solved with
    the other held, twice over (each moves the other's loads a little); with loads of one kind,
    both from those."""
    ok = [r for r in run.probe if r.ok and len(r.chunk_times_s) >= 2]
    # NOTE: a load whose requests all failed says nothing; `num_loads` counts the fits kept
    loads = [load for load in run.loads if any(r.ok and len(r.chunk_times_s) >= 2 for r in load.records)]
    if not ok or not loads:
        raise RuntimeError("the served PD run's requests failed (see the cluster's log)")
    sim = _simulated(profile, PDPathCosts(), run.transport, run.probe_workload, 1)
    costs = PDPathCosts(max(0.0, _token_s(ok, 0) - _token_s(sim, 0)), max(0.0, _token_s(ok, 1) - _token_s(sim, 1)),
                        transport=run.transport, num_requests=len(ok), num_loads=len(loads))
    short, long_ = [load for load in loads if not load.long], [load for load in loads if load.long]
    for _ in range(2):
        first = statistics.median(_load_cost(profile, costs, run.transport, load, 0) for load in long_ or short)
        costs = replace(costs, first_token_per_streaming_s=first)
        handoff = statistics.median(_load_cost(profile, costs, run.transport, load, 1) for load in short or long_)
        costs = replace(costs, handoff_per_waiting_s=handoff)
    return costs


def _load_cost(profile: Profile, costs: PDPathCosts, transport: str, load: Load, index: int) -> float:
    """The load-dependent cost that gives the simulator `load`'s real median of token `index`, the
    rest of `costs` held: the first token's per other request streaming (0) or the hand-off's per
    other request not yet at decode (1)."""
    real = _token_s(load.records, index)

    def excess(x: float) -> float:
        trial = (replace(costs, first_token_per_streaming_s=x) if index == 0
                 else replace(costs, handoff_per_waiting_s=x))
        return _token_s(_simulated(profile, trial, transport, load.workload, load.concurrency), index) - real

    return _solve(excess, real)


def served_profile(profile: Profile, run: ServedRun) -> tuple[Profile, dict[str, tuple[float, float]]]:
    """The profile with its PD workers' served steps and the PD path's costs; and per role the
    fitted (a, b) of `a x timed + b`."""
    fits: dict[str, tuple[float, float]] = {}
    models: dict[str, StepModel | None] = {"prefill": None, "decode": None}
    for role in models:
        if len(run.steps.get(role, ())) >= 3:
            models[role], a, b = fit_served(profile.step, run.steps[role])
            fits[role] = (a, b)
    served = replace(profile, prefill_step=models["prefill"], decode_step=models["decode"])
    return replace(served, pd_path=path_costs(served, run)), fits


def engine_flags(args: EngineArgs, transport: str) -> list[str]:
    """The calibrated engine's flags for `pdserve up`'s workers (every field, so the workers'
    defaults never differ from calibrate's), and the KV transport."""
    return [*to_argv(args), "--kv-transport", transport]


@contextmanager
def _step_log_env(directory: Path) -> Iterator[None]:
    old = os.environ.get(STEP_LOG)
    os.environ[STEP_LOG] = str(directory)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(STEP_LOG, None)
        else:
            os.environ[STEP_LOG] = old


def _line_counts(directory: Path) -> dict[Path, int]:
    return {f: len(f.read_text().splitlines()) for f in directory.glob("steps-*.jsonl")}


def run_served_pd(args: EngineArgs, timed: StepModel, transport: str, max_num_seqs: int, vocab_size: int,
                  plan: ServedPlan = ServedPlan()) -> ServedRun:  # noqa: B008
    """Start `pdserve up --prefill 1 --decode 1` with the calibrated engine flags, send the isolated
    requests, then the load; the workers' steps logged during both (not the readiness ones)."""
    from pdserve.bench.serve import local

    threads = args.num_threads or local.up_threads_per_worker(2)
    probe = random_lengths(plan.probe, PROBE_PROMPT_LEN, PROBE_OUTPUT_LEN, seed=1, kind=PromptKind(vocab_size))
    sizes = [(plan.load, False)] * plan.rounds + [(plan.long_load, True)] * (plan.long_rounds if plan.long_load else 0)
    kind = PromptKind(vocab_size)
    workloads = [(random_lengths(size, load_prompt_len(plan, n), plan.output_len, seed=2 + n, kind=kind), long)
                 for n, (size, long) in enumerate(sizes)]
    concurrency = max(1, min(plan.concurrency, max_num_seqs))
    with tempfile.TemporaryDirectory(prefix="pdserve-calibrate-pd-") as tmp:
        log_dir, step_dir = Path(tmp) / "logs", Path(tmp) / "steps"
        step_dir.mkdir()
        port = local.free_port()
        cli = local.pd_args(port, 1, 1, threads, engine_flags(args, transport))
        with _step_log_env(step_dir):
            server = local.start("calibrate-pd", cli, port, log_dir)
        try:
            local.wait_ready(server, plan.ready_timeout_s)
            skip = _line_counts(step_dir)  # NOTE: the readiness requests' steps (the first, cold ones)
            config = LoadConfig(server.url, max_concurrency=1, progress=False)
            records = asyncio.run(run_load(probe, config)).records
            loads = tuple(Load(asyncio.run(run_load(w, replace(config, max_concurrency=concurrency))).records, w,
                               concurrency, long) for w, long in workloads)
        finally:
            local.stop(server)
        steps: dict[str, list[Step]] = {}
        for file in sorted(step_dir.glob("steps-*.jsonl")):
            role = step_log_role(file) or "colocated"
            for work, seconds, _, _ in read_step_logs([file])[skip.get(file, 0):]:
                predicted = timed.step_s(work.prefill_tokens, work.prefill_pairs, work.decode_seqs,
                                         work.decode_context)
                if seconds > 0 and predicted > 0:
                    steps.setdefault(role, []).append(Step(predicted, seconds, max(1, work.decode_seqs)))
    return ServedRun(records, probe, loads, steps, transport)
