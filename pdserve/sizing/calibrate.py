"""`pdserve calibrate`: measure this machine's step-time model and KV transfer rates for a model.

Steps are timed on the real engine (`LLMEngine.step`, scheduling and sampling included), one
scenario at a time, the median of a few repetitions each:
- prefill: one prompt of T new tokens after C tokens already cached (prefix caching: the first
  request leaves C tokens in the cache, the second extends them), for a grid of T and C;
- decode: B sequences of context C decoding together, for a grid of B and C.
profile.StepModel is then fitted to all samples by least squares on the relative error; a
coefficient that comes out negative is dropped (held at 0) and the rest refitted.

Threads: by default the engine gets the torch threads `pdserve up` gives each of its workers
(CPUs // `--workers`, default 2: up's one prefill and one decode worker), so that the profile times
the engine the simulator stands in for (timed on every core, calibrate missed served TTFT by 69 %);
`--num-threads` overrides it.

The PD path (profile version 2): then calibrate starts a small real PD cluster the way `pdserve up`
runs one (1 prefill + 1 decode worker, these engine flags and threads) and measures what a PD
request costs beyond its timed steps: each PD role's served step (`prefill_step`, `decode_step`:
the timed model scaled and shifted to the steps the workers logged while serving) and the PD path's
fixed costs (`pd_path`: the router, the `/pd/*` hops, the early first token, the hand-off), see
sizing/served_pd.py. `--served-requests 0` skips it (the simulator then charges no PD path cost).

`--from-step-log PATH...` fits the steps engines logged while serving instead (`PDSERVE_STEP_LOG`,
engine/step_log.py): the step costs of a real run, with whatever shared the machine then.

Transfer: `bench.kv_transport.run_workload` moves one prompt's KV (this model's shape) between two
processes with each transport at two sizes; `latency_s` and `bytes_per_s` are the line through them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from pdserve.config import EngineArgs, create_engine_config
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.step_log import read_step_logs
from pdserve.model.facts import ModelFacts
from pdserve.sizing.devices import DeviceSpec, device
from pdserve.sizing.profile import Limits, Placement, Profile, StepModel, TransferModel, roofline
from pdserve.sizing.served_pd import ServedPlan

_REPS = 3
_VOCAB_LOW = 100  # token ids drawn above the specials, as bench's prompts are


@dataclass(frozen=True, slots=True)
class Sample:
    """One timed step: its counts (StepModel's columns) and its median seconds."""

    prefill_tokens: int
    prefill_pairs: float
    decode_seqs: int
    decode_context: int
    seconds: float

    def row(self) -> list[float]:
        return [1.0, self.prefill_tokens, self.prefill_pairs, self.decode_seqs, self.decode_context]


class _Prompts:
    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        self._rng = np.random.default_rng(seed)
        self._vocab = vocab_size

    def draw(self, n: int) -> list[int]:
        return self._rng.integers(_VOCAB_LOW, self._vocab, n).tolist()


def _run_to_end(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def prefill_sample(engine: LLMEngine, prompts: _Prompts, new: int, context: int) -> Sample:
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    times = []
    for rep in range(_REPS + 1):
        prefix = prompts.draw(context)
        if context:
            engine.add_request(f"warm-{new}-{context}-{rep}", prefix, params)
            _run_to_end(engine)
        engine.add_request(f"pf-{new}-{context}-{rep}", prefix + prompts.draw(new), params)
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        _run_to_end(engine)
    return Sample(new, new * (context + new / 2), 0, 0, statistics.median(times[1:]))


def decode_sample(engine: LLMEngine, prompts: _Prompts, batch: int, context: int) -> Sample:
    params = SamplingParams(max_tokens=_REPS + 3, ignore_eos=True, temperature=0.0)
    ids = [f"dc-{batch}-{context}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, prompts.draw(context), params)
    while any(not s.num_computed_tokens >= s.num_prompt_tokens for s in engine.scheduler.running) or \
            engine.scheduler.waiting:
        engine.step()
    engine.step()  # the first decode step (its timing includes the step after the prefills)
    times = []
    for _ in range(_REPS):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    _run_to_end(engine)
    return Sample(0, 0.0, batch, batch * (context + 2), statistics.median(times))


def fit(samples: list[Sample]) -> StepModel:
    """Least squares on the relative error (each sample's row and time divided by its time, so a
    19 s prefill does not drown a 0.4 s decode step), with the columns whose coefficient would be
    negative dropped (held at 0)."""
    y = np.array([s.seconds for s in samples])
    x = np.array([s.row() for s in samples]) / y[:, None]
    y = np.ones_like(y)
    keep = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while keep:
        solution, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
        if (solution >= 0).all():
            coef[keep] = solution
            break
        keep.pop(int(np.argmin(solution)))
    return StepModel(*(float(c) for c in coef))


@dataclass(frozen=True, slots=True)
class Grid:
    """The scenarios timed: prefill tokens x cached context (in blocks), decode batch x context."""

    prefill_tokens: tuple[int, ...] = (32, 128, 512)
    prefill_context_blocks: tuple[int, ...] = (0, 8, 32)
    decode_batches: tuple[int, ...] = (1, 4, 16)
    decode_contexts: tuple[int, ...] = (16, 256)


def measure_steps(engine: LLMEngine, grid: Grid) -> list[Sample]:
    prompts = _Prompts(engine.config.model.vocab_size)
    block = engine.config.cache.block_size
    sched = engine.config.scheduler
    samples = []
    # NOTE: a cached context needs prefix caching (without it the "context" would be recomputed)
    contexts = grid.prefill_context_blocks if engine.config.cache.enable_prefix_caching else (0,)
    for new in (t for t in grid.prefill_tokens if t <= sched.max_num_batched_tokens):
        for context in contexts:
            samples.append(prefill_sample(engine, prompts, new, context * block))
    for batch in (b for b in grid.decode_batches if b <= sched.max_num_seqs):
        for context in grid.decode_contexts:
            samples.append(decode_sample(engine, prompts, batch, context))
    return samples


def measure_transfer(model: ModelFacts, dtype: str, block_size: int, transports: list[str]) -> dict[str, TransferModel]:
    from pdserve.bench.kv_transport import run_workload
    from pdserve.bench.kv_workload import KVWorkload

    points: dict[str, list[tuple[float, float]]] = {name: [] for name in transports}
    for tokens in (256, 4096):
        work = KVWorkload(f"calibrate-{tokens}", model.num_layers, model.num_kv_heads, model.head_dim, dtype,
                          block_size, tokens)
        seconds = run_workload(work, transports, reps=3)
        for name in transports:
            points[name].append((work.payload_bytes, statistics.median(seconds[f"{name}, served"])))
    out = {}
    for name, ((b1, t1), (b2, t2)) in points.items():
        rate = (b2 - b1) / max(t2 - t1, 1e-9)
        out[name] = TransferModel(max(0.0, t1 - b1 / rate), rate)
    return out


@dataclass(frozen=True, slots=True)
class Logged:
    """Steps engines logged while serving: decode workers' apart (a decode worker's steps may cost
    more than the same work elsewhere: its KV receiver shares its core), every other role's."""

    steps: list[Sample]
    decode: list[Sample]


def logged_samples(paths: list[Path]) -> Logged:
    """The steps engines logged while serving (`PDSERVE_STEP_LOG`, engine/step_log.py)."""
    logged = Logged([], [])
    for w, seconds, role, _ in read_step_logs(paths):
        if seconds > 0:
            sample = Sample(w.prefill_tokens, w.prefill_pairs, w.decode_seqs, w.decode_context, seconds)
            (logged.decode if role == "decode" else logged.steps).append(sample)
    if not logged.steps and not logged.decode:
        raise ValueError(f"no logged steps in {', '.join(map(str, paths))}")
    return logged


def calibrate(args: EngineArgs, transports: list[str], hardware: str,
              grid: Grid = Grid(), logged: Logged | None = None,  # noqa: B008
              served: ServedPlan | None = None) -> tuple[Profile, list[Sample]]:
    """Measure (or take `logged` steps), fit, and build the profile (limits: the engine's own).
    Logged decode workers' steps get a step model of their own when other roles' steps were
    logged too (`Profile.decode_step`). `served` (timed steps only): then the served PD run
    (sizing/served_pd.py) adds the PD workers' served steps and the PD path's costs. Returns the
    samples `Profile.step` was fitted to."""
    cfg = create_engine_config(args)  # NOTE: an engine (weights, pool) only to time steps here
    model = ModelFacts.from_config(cfg.model_path.rstrip("/").split("/")[-1], _config_dict(cfg.model_path))
    if logged is None:
        engine = LLMEngine.from_engine_args(args)
        samples, decode_step = measure_steps(engine, grid), None
        engine.close()  # NOTE: before the served run, which needs the cores (and the memory) to itself
    else:
        samples = logged.steps or logged.decode
        decode_step = fit(logged.decode) if logged.steps and logged.decode else None
    step = fit(samples)
    dtype = str(cfg.dtype).removeprefix("torch.")
    element = cfg.kv_bytes_per_block // (cfg.cache.block_size * 2 * model.num_layers * model.num_kv_heads
                                         * model.head_dim)
    transfer = measure_transfer(model, dtype, cfg.cache.block_size, transports) if transports else {}
    threads = cfg.num_threads or "default"
    how = "logged while serving" if logged is not None else f"{_REPS} reps each, median"
    notes = f"{len(samples)} step samples ({how}); torch threads {threads}; {dtype}"
    if decode_step is not None and logged is not None:
        notes += f"; decode workers' steps fitted apart ({len(logged.decode)} samples)"
    profile = Profile(model.name, f"calibrated on {hardware}", model, step,
                      model.kv_bytes_per_token(element), cfg.cache.block_size, cfg.cache.num_kv_blocks,
                      cfg.scheduler.max_num_seqs, cfg.scheduler.max_num_batched_tokens, transfer, notes,
                      decode_step)
    if served is not None and logged is None:
        from pdserve.disagg.transport import nixl_available
        from pdserve.sizing.served_pd import run_served_pd, served_profile

        transport = "nixl" if nixl_available() else "tcp"  # NOTE: what `pdserve up`'s workers use by default
        try:
            run_ = run_served_pd(args, step, transport, cfg.scheduler.max_num_seqs, cfg.model.vocab_size, served)
            profile, fits = served_profile(profile, run_)
        except (RuntimeError, OSError) as exc:  # NOTE: the timed steps are still worth a profile
            print(f"pdserve calibrate: the served PD run failed, the profile has no PD path costs: {exc}",
                  file=sys.stderr)
            return profile, samples
        said = "; ".join(f"{role} {a:.2f} x timed + {b * 1e3:.2f} ms ({len(run_.steps[role])} steps)"
                         for role, (a, b) in fits.items())
        loads = profile.pd_path.num_loads if profile.pd_path else 0
        said += f"; load-dependent costs: the medians of {loads} loads' fits"
        profile = replace(profile, notes=f"{profile.notes}; served PD run over {transport}: {said}")
    return profile, samples


def _config_dict(model_path: str) -> dict:
    return dict(json.loads((Path(model_path) / "config.json").read_text()))


def fit_error(step: StepModel, samples: list[Sample]) -> float:
    """Median relative error of the fitted model over the samples."""
    return statistics.median(abs(step.step_s(s.prefill_tokens, s.prefill_pairs, s.decode_seqs, s.decode_context)
                                 - s.seconds) / s.seconds for s in samples)


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not at least 1")
    return value


def add_parser(sub: argparse._SubParsersAction) -> None:
    from pdserve.config_flags import add_config_args

    p = sub.add_parser("calibrate", help="measure a step-time model and KV transfer rates; write a profile",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=str, required=True, help="the profile file to write (JSON)")
    p.add_argument("--transports", default=None,
                   help="comma-separated: tcp, nixl (default: tcp, and nixl when importable); '': none")
    p.add_argument("--prefill-tokens", default=None, help="comma-separated prompt lengths timed (default 32,128,512)")
    p.add_argument("--decode-batches", default=None, help="comma-separated decode batch sizes timed (default 1,4,16)")
    p.add_argument("--from-step-log", nargs="+", type=Path, default=None, metavar="PATH",
                   help="fit the steps engines logged while serving (PDSERVE_STEP_LOG=DIR: files or DIRs) instead "
                        "of timing steps here")
    p.add_argument("--workers", type=int, default=2,
                   help="without --num-threads: time the engine with the torch threads `pdserve up` gives each of "
                        "this many workers (CPUs // workers; default 2, up's 1 prefill + 1 decode)")
    p.add_argument("--served-requests", type=int, default=ServedPlan().load,
                   help=f"the served PD run's load (requests; it also sends {ServedPlan().probe} isolated ones "
                        "first): what a PD request costs beyond its timed steps; 0: no served run (no PD path costs "
                        "in the profile)")
    p.add_argument("--served-concurrency", type=int, default=ServedPlan().concurrency,
                   help="the served PD run's load: requests in flight (at most --max-num-seqs; near the concurrency "
                        "you will simulate: the load-dependent costs are fitted there)")
    p.add_argument("--served-rounds", type=positive_int, default=ServedPlan().rounds,
                   help="the served PD run's loads, each with fresh prompts, of two prompt lengths in turn: the "
                        "hand-off's load-dependent cost is the median of their fits (one short load's fit moves a lot)")
    p.add_argument("--served-long-requests", type=int, default=ServedPlan().long_load,
                   help="then the served PD run's long loads (requests each): the first token's load-dependent cost "
                        "is the median of their fits (a short load runs in waves, a long one loses them, as a bench "
                        "does); 0: none (the short loads fit both costs)")
    p.add_argument("--served-long-rounds", type=positive_int, default=ServedPlan().long_rounds,
                   help="the served PD run's long loads, fresh prompts each")
    p.add_argument("--compare-device", default=None,
                   help="also print each sample against that device's roofline profile (e.g. H200)")
    add_config_args(p, EngineArgs, title="engine")
    p.set_defaults(func=run)


def engine_args(ns: argparse.Namespace) -> EngineArgs:
    """The engine flags, with `--num-threads` defaulting to what `pdserve up` gives each of `--workers`."""
    from pdserve.config_flags import config_from_args
    from pdserve.ops.threads import threads_per_worker

    args = config_from_args(EngineArgs, ns)
    if ns.workers < 1:
        raise ValueError(f"--workers {ns.workers}: expected at least 1")
    if args.num_threads is None and args.tensor_parallel_size == 1:
        args = replace(args, num_threads=threads_per_worker(ns.workers))
    return args


def run(ns: argparse.Namespace) -> int:
    from pdserve.bench.common import hardware_line
    from pdserve.disagg.transport import nixl_available

    text = ns.transports if ns.transports is not None else "tcp,nixl" if nixl_available() else "tcp"
    transports = [t.strip() for t in text.split(",") if t.strip()]
    if "nixl" in transports and not nixl_available():
        raise ValueError("--transports nixl: NIXL is not importable here")
    start = time.perf_counter()
    grid = Grid(prefill_tokens=_ints(ns.prefill_tokens, Grid().prefill_tokens),
                decode_batches=_ints(ns.decode_batches, Grid().decode_batches))
    compare = device(ns.compare_device) if ns.compare_device else None  # an unknown name fails before measuring
    logged = logged_samples(ns.from_step_log) if ns.from_step_log else None
    served = (ServedPlan(load=ns.served_requests, concurrency=ns.served_concurrency, rounds=ns.served_rounds,
                         long_load=max(0, ns.served_long_requests), long_rounds=ns.served_long_rounds)
              if ns.served_requests > 0 else None)
    profile, samples = calibrate(engine_args(ns), transports, hardware_line(), grid, logged, served)
    profile.save(Path(ns.out))
    samples_path = Path(ns.out).with_suffix(".samples.json")
    samples_path.write_text(json.dumps([asdict(x) for x in samples], indent=1) + "\n")
    s = profile.step
    print(f"step_s = {s.base_s * 1e3:.3f} ms + {s.prefill_token_s * 1e6:.3f} us x prefill tokens + "
          f"{s.prefill_pair_s * 1e9:.4f} ns x prefill pairs + {s.decode_seq_s * 1e6:.3f} us x decode seqs + "
          f"{s.decode_context_s * 1e9:.4f} ns x decode context tokens")
    print(f"fit: median relative error {fit_error(s, samples):.1%} over {len(samples)} samples")
    if profile.decode_step is not None and logged is not None:
        d = profile.decode_step
        print(f"decode workers: step_s = {d.base_s * 1e3:.3f} ms + {d.decode_seq_s * 1e6:.3f} us x decode seqs + "
              f"{d.decode_context_s * 1e9:.4f} ns x decode context tokens (+ prefill terms: "
              f"{d.prefill_token_s * 1e6:.3f} us/token); fit: median relative error "
              f"{fit_error(d, logged.decode):.1%} over {len(logged.decode)} samples")
    for name, t in profile.transports.items():
        print(f"{name}: {t.latency_s * 1e3:.3f} ms + bytes / {t.bytes_per_s / 1e9:.2f} GB/s")
    if profile.pd_path is not None:
        c = profile.pd_path
        print(f"served PD run over {profile.notes.rpartition('served PD run over ')[2]}")
        print(f"PD path over {c.transport}, beyond the simulated steps and transfer (fixed: {c.num_requests} isolated "
              f"requests; the rest: the load): first token +{c.first_token_s * 1e3:.1f} ms + "
              f"{c.first_token_per_streaming_s * 1e3:.2f} ms per other request streaming (past its first token), "
              f"hand-off +{c.handoff_s * 1e3:.1f} ms + "
              f"{c.handoff_per_waiting_s * 1e3:.2f} ms per other request not yet at decode")
    if compare is not None:
        print_against_roofline(profile, samples, compare)
    print(f"wrote {ns.out} (samples: {samples_path}) in {time.perf_counter() - start:.1f} s")
    return 0


def _ints(text: str | None, default: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(t) for t in text.split(",")) if text else default


def print_against_roofline(profile: Profile, samples: list[Sample], spec: DeviceSpec) -> None:
    """Each measured step next to what `roofline` predicts for it on `spec` (same model; the KV's
    element size stands for the weights' too, as with `--kv-cache-dtype auto`)."""
    from pdserve.bench.common import print_table

    element = profile.kv_bytes_per_token // max(1, profile.model.kv_bytes_per_token(1))
    limits = Limits(profile.num_kv_blocks, profile.max_num_seqs, profile.max_num_batched_tokens, profile.block_size)
    model = roofline(profile.model, spec, limits, Placement(dtype_bytes=element, kv_dtype_bytes=element)).step
    rows = []
    for s in samples:
        predicted = model.step_s(s.prefill_tokens, s.prefill_pairs, s.decode_seqs, s.decode_context)
        rows.append([str(s.prefill_tokens), f"{s.prefill_pairs:.0f}", str(s.decode_seqs), str(s.decode_context),
                     f"{s.seconds * 1e3:.2f}", f"{predicted * 1e3:.2f}", f"{s.seconds / predicted:.2f}"])
    print(f"measured against roofline {spec.describe()}:")
    print_table(["prefill tok", "prefill pairs", "decode seqs", "decode ctx", "measured ms", "roofline ms",
                 "measured/roofline"], rows)
