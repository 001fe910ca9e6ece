"""Whole engine steps on a GPU, the stages of the first GPU check after the kernels alone
(bench/gpu_kernels.py): what a step costs beside its kernels. Each stage builds the model in
process with random weights (no checkpoint written), a `ModelRunner` on it, and times
`ModelRunner.run` on hand-made `StepPlan`s (no scheduler, no sampling):

    capture  the dense shape (qwen3-8b) and a MoE preset (small-moe): decode CUDA graphs captured
             (one per bucket up to --max-batch) and piecewise graphs (each token bucket's pieces,
             engine/piecewise_graphs.py), the capture's seconds and graph-pool MiB
    profile  one replayed decode step at batch 1 and 64 x --context under torch.profiler: kernels
             per step and per layer, GPU busy ms (GEMM and the rest), idle gaps in the step's GPU
             span, against the HBM floor (every matmul weight and the KV read once at 4.8 TB/s:
             sizing/gpu_floor.py)
    long     decode at long context (--long 1x16384,64x4096,16x32768): the whole step (wall,
             synchronized) and the graph replay alone (CUDA events); the difference is host time
    mixed    64 decodes plus one fresh 2,048-token prompt chunk in one (eager: above the largest
             token bucket) step, against the same 64 decodes replayed, and the chunk alone; then
             64 decodes plus a 448-token chunk (--piecewise, 512 tokens: the largest bucket) from
             piecewise graphs against the same step fully eager

    python -m pdserve.sizing.gpu_steps STAGE [--preset qwen3-8b] [--save FILE]
    python -m pdserve.sizing.gpu_steps summary FILE...     # one table of the stages' JSON files
    TRITON_INTERPRET=1 python -m pdserve.sizing.gpu_steps STAGE --smoke   # tiny shapes on CPU

`--smoke` runs the same code on CPU in float32: decode steps padded to their bucket run eagerly
(engine/cuda_graphs.py), "replay" is that eager forward, the profiler records CPU ops only (its
counts are top-level ops, not kernels). scripts/device_check.sh runs each stage under its own limit.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from pdserve.bench.common import hardware_line, print_table
from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.cuda_graphs import bucket_for, pad_decode_plan
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.step_plan import PlannedPrefill, StepPlan
from pdserve.model.demo_checkpoint import PRESETS, QWEN3_SHAPES, ModelVariant
from pdserve.model.facts import ModelFacts
from pdserve.model.qwen3 import Qwen3ForCausalLM, RotaryEmbedding
from pdserve.sizing.devices import device as device_spec
from pdserve.sizing.gpu_floor import decode_floor_s

_BLOCK = 16
# cuBLAS/cuBLASLt/CUTLASS GEMM kernels on CUDA; the matmul ops on CPU
_GEMM = re.compile(r"gemm|nvjet|cutlass|xmma|_grouped_mm|aten::(mm|addmm|bmm|linear|matmul)\b", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class Result:
    stage: str
    model: str
    step: str  # "decode 64 x 256", "capture", "mixed 64 + 2048"
    values: dict[str, float]  # what the stage measured, by name (ms, counts, ratios)


@dataclass(frozen=True, slots=True)
class Setup:
    device: torch.device
    dtype: torch.dtype
    repeats: int
    max_batch: int


def random_model(preset: str, dtype: torch.dtype, device: torch.device, max_positions: int) -> Qwen3ForCausalLM:
    """The preset's shape with random weights drawn where it runs (an 8B model in seconds on a GPU,
    no checkpoint): matrices N(0, 1/fan_in), norms 1, as demo_checkpoint's."""
    cfg = (PRESETS | QWEN3_SHAPES)[preset].config(ModelVariant(dtype=dtype))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(cfg, 1)
    finally:
        torch.set_default_dtype(previous)
    model.rope = RotaryEmbedding(cfg, max_positions).to(device)  # NOTE: float32 tables, as the loader's
    gen = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.fill_(1.0)
            else:
                param.normal_(0.0, param.shape[-1] ** -0.5, generator=gen)
    return model.eval()


def make_runner(preset: str, setup: Setup, num_blocks: int, max_tokens: int, max_len: int) -> ModelRunner:
    """A runner on the Triton backend's path with decode graphs not yet captured (see `capture`)."""
    model = random_model(preset, setup.dtype, setup.device, max_len)
    config = EngineConfig(model_path=f"random {preset}", model=model.cfg, dtype=setup.dtype, device=setup.device,
                          cache=CacheConfig(_BLOCK, num_blocks, 0, False),
                          scheduler=SchedulerConfig(setup.max_batch, max_tokens, max_len, True, "recompute"),
                          seed=0, num_threads=None, enforce_eager=True)
    runner = ModelRunner(config, model)  # NOTE: eager: its own capture is not timed, this one is
    runner.use_paged_step(graphs=True)  # on CPU too: padded buckets, eager (the tests' path)
    return runner


def capture(runner: ModelRunner) -> tuple[float, float]:
    """(seconds, MiB of GPU memory) to capture every bucket's graphs, decode and piecewise; (0, 0)
    on CPU (none)."""
    graphs, pieces = runner.decode_graphs, runner.piecewise_graphs
    assert graphs is not None and pieces is not None
    if runner.device.type != "cuda":
        return 0.0, 0.0
    free = torch.cuda.mem_get_info(runner.device)[0]
    start = time.perf_counter()
    pool = torch.cuda.graph_pool_handle()
    with torch.inference_mode():
        graphs.capture(pool)
        pieces.capture(pool)
    return time.perf_counter() - start, (free - torch.cuda.mem_get_info(runner.device)[0]) / 2**20


def decode_plan(batch: int, context: int, first_block: int = 1) -> StepPlan:
    """`batch` sequences of `context` cached tokens each decoding one more, in adjacent blocks
    from `first_block` on (block 0: the padded rows'); every row samples."""
    plan = StepPlan()
    blocks = -(-(context + 1) // _BLOCK)
    for row in range(batch):
        table = list(range(first_block + row * blocks, first_block + (row + 1) * blocks))
        plan.token_ids.append(100 + row)
        plan.positions.append(context)
        plan.slots.append(table[context // _BLOCK] * _BLOCK + context % _BLOCK)
        plan.decode_rows.append(row)
        plan.decode_tables.append(table)
        plan.decode_lens.append(context + 1)
        plan.sample_rows.append(row)
    return plan


def add_prompt(plan: StepPlan, tokens: int, first_block: int) -> StepPlan:
    """`plan` with a fresh prompt chunk of `tokens` after its rows (blocks from `first_block`)."""
    start = len(plan.token_ids)
    table = list(range(first_block, first_block + -(-tokens // _BLOCK)))
    plan.token_ids.extend(range(1000, 1000 + tokens))
    plan.positions.extend(range(tokens))
    plan.slots.extend(table[p // _BLOCK] * _BLOCK + p % _BLOCK for p in range(tokens))
    plan.prefills.append(PlannedPrefill(start, start + tokens, tokens, table))
    plan.sample_rows.append(start + tokens - 1)
    return plan


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_ms(runner: ModelRunner, plan: StepPlan, repeats: int) -> float:
    """Median wall ms of `ModelRunner.run(plan)` to its last kernel (after one warm-up)."""
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        runner.run(plan)
        _sync(runner.device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[1:])


def replay_fn(runner: ModelRunner, plan: StepPlan) -> Callable[[], None]:
    """What a replayed step runs on the GPU: its bucket's graph (its inputs prepared once), or on
    CPU the padded eager forward the graph would hold."""
    graphs = runner.decode_graphs
    assert graphs is not None
    bucket = bucket_for(len(plan.decode_rows), graphs.buckets)
    assert bucket is not None and not plan.prefills, "a decode step within the largest bucket"
    input_ids, positions, meta = graphs.buffers.prepare(pad_decode_plan(plan, bucket))
    graph = graphs.graphs.get(bucket)
    if graph is not None:
        return graph.replay

    def forward() -> None:
        with torch.inference_mode():
            graphs.model(input_ids, positions, graphs.layer_caches, meta)

    return forward


def replay_ms(runner: ModelRunner, plan: StepPlan, repeats: int) -> float:
    """Median ms of the replay alone: CUDA events around it on a GPU, wall time on CPU."""
    fn = replay_fn(runner, plan)
    fn()
    times = []
    for _ in range(repeats):
        if runner.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


def profile_step(runner: ModelRunner, plan: StepPlan) -> dict[str, float]:
    """One step (after a warm-up) under torch.profiler: kernels (CUDA) or top-level ops (CPU), their
    busy ms, the GEMMs' share, and the idle ms inside the span from the first to the last."""
    from torch.profiler import ProfilerActivity, profile

    cuda = runner.device.type == "cuda"
    runner.run(plan)
    _sync(runner.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        runner.run(plan)
        _sync(runner.device)
    events = [e for e in prof.events() if (e.device_type == torch.autograd.DeviceType.CUDA
                                           and not e.name.startswith(("Memcpy", "Memset"))
                                           if cuda else e.cpu_parent is None and e.name.startswith("aten::"))]
    if not events:
        raise RuntimeError("the profiler recorded no kernel in the step")
    busy = sum(e.time_range.elapsed_us() for e in events) / 1e3
    gemm = sum(e.time_range.elapsed_us() for e in events if _GEMM.search(e.name)) / 1e3
    span = (max(e.time_range.end for e in events) - min(e.time_range.start for e in events)) / 1e3
    return {"kernels": float(len(events)), "busy_ms": busy, "gemm_ms": gemm, "other_ms": busy - gemm,
            "idle_ms": max(0.0, span - busy)}


def floor_ms(runner: ModelRunner, batch: int, context: int, spec_name: str) -> float:
    """The HBM floor of a decode step (sizing/gpu_floor.py's): weights and KV read once."""
    facts = ModelFacts.from_config(runner.config.model_path, _config_json(runner))
    element = torch.empty((), dtype=runner.config.dtype).element_size()
    return decode_floor_s(facts, device_spec(spec_name), batch, context + 1, element, element) * 1e3


def _config_json(runner: ModelRunner) -> dict:
    preset = runner.config.model_path.removeprefix("random ")
    return (PRESETS | QWEN3_SHAPES)[preset].config_json(ModelVariant(dtype=runner.config.dtype))


def replay_error(runner: ModelRunner, plan: StepPlan) -> float:
    """Max |logit| difference of the replayed step against the same padded step run eagerly (0 on CPU)."""
    graphs = runner.decode_graphs
    assert graphs is not None
    replayed = runner.run(plan)
    assert replayed is not None
    replayed = replayed.clone()
    saved = dict(graphs.graphs)
    graphs.graphs.clear()  # NOTE: a bucket without a graph runs eagerly (cuda_graphs.py)
    try:
        eager = runner.run(plan)
    finally:
        graphs.graphs.update(saved)
    assert eager is not None
    return float((replayed - eager).abs().max())


def _blocks(batch: int, context: int) -> int:
    return batch * -(-(context + 1) // _BLOCK)


def _release(runner: ModelRunner) -> None:
    """Graphs and their pool freed before the next model is built."""
    for graphs in (runner.decode_graphs, runner.piecewise_graphs):
        if graphs is not None:
            graphs.graphs.clear()
            graphs.outputs.clear()
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
        torch.cuda.empty_cache()


def stage_capture(ns: argparse.Namespace, setup: Setup) -> list[Result]:
    results = []
    for preset in (ns.preset, ns.moe_preset):
        start = time.perf_counter()
        runner = make_runner(preset, setup, _blocks(setup.max_batch, ns.context) + 1, setup.max_batch,
                             ns.context + 2 * _BLOCK)
        built = time.perf_counter() - start
        seconds, mib = capture(runner)
        graphs, pieces = runner.decode_graphs, runner.piecewise_graphs
        assert graphs is not None and pieces is not None
        on_gpu = setup.device.type == "cuda"
        error = replay_error(runner, decode_plan(min(3, setup.max_batch), ns.context))
        results.append(Result("capture", preset, f"buckets {','.join(map(str, graphs.buckets))}; tokens "
                              f"{','.join(map(str, pieces.buckets))}",
                              {"build_s": built, "graphs": float(len(graphs.graphs)),
                               "expected": float(len(graphs.buckets) if on_gpu else 0),
                               "piecewise": float(len(pieces.graphs)),
                               "piecewise_expected": float(len(pieces.buckets) if on_gpu else 0),
                               "capture_s": seconds, "pool_mib": mib, "replay_vs_eager": error}))
        _release(runner)
        del runner, graphs, pieces
    return results


def stage_profile(ns: argparse.Namespace, setup: Setup) -> list[Result]:
    batches = [int(b) for b in ns.batches.split(",")]
    runner = make_runner(ns.preset, setup, _blocks(max(batches), ns.context) + 1, setup.max_batch,
                         ns.context + 2 * _BLOCK)
    capture(runner)
    layers = runner.model.cfg.num_hidden_layers
    results = []
    for batch in batches:
        plan = decode_plan(batch, ns.context)
        values = profile_step(runner, plan)
        floor = floor_ms(runner, batch, ns.context, ns.compare_device)
        values |= {"per_layer": values["kernels"] / layers, "floor_ms": floor, "x_floor": values["busy_ms"] / floor,
                   "step_ms": step_ms(runner, plan, setup.repeats)}
        if values["kernels"] < layers:  # NOTE: a profiler that sees the graph launch, not its kernels
            print(f"batch {batch}: {values['kernels']:.0f} kernels for {layers} layers: the replay's kernels "
                  "were not traced one by one", flush=True)
        results.append(Result("profile", ns.preset, f"decode {batch} x {ns.context}", values))
    _release(runner)
    return results


def stage_long(ns: argparse.Namespace, setup: Setup) -> list[Result]:
    shapes = _pairs(ns.long)
    runner = make_runner(ns.preset, setup, max(_blocks(b, c) for b, c in shapes) + 1, setup.max_batch,
                         max(c for _, c in shapes) + 2 * _BLOCK)
    capture(runner)
    results = []
    for batch, context in shapes:
        plan = decode_plan(batch, context)
        full, replay = step_ms(runner, plan, setup.repeats), replay_ms(runner, plan, setup.repeats)
        floor = floor_ms(runner, batch, context, ns.compare_device)
        results.append(Result("long", ns.preset, f"decode {batch} x {context}",
                              {"step_ms": full, "replay_ms": replay, "host_ms": full - replay, "floor_ms": floor,
                               "x_floor": replay / floor}))
    _release(runner)
    return results


def stage_mixed(ns: argparse.Namespace, setup: Setup) -> list[Result]:
    (batch, chunk), = _pairs(ns.mixed)
    (small_batch, small_chunk), = _pairs(ns.piecewise)
    decode_blocks = _blocks(max(batch, small_batch), ns.context)
    # NOTE: room for the decodes and the prompt's sequence, as an engine running them all would have
    seqs = replace(setup, max_batch=max(setup.max_batch, batch + 1, small_batch + 1))
    runner = make_runner(ns.preset, seqs, decode_blocks + -(-max(chunk, small_chunk) // _BLOCK) + 1,
                         max(batch + chunk, small_batch + small_chunk), max(ns.context, chunk) + 2 * _BLOCK)
    capture(runner)
    mixed = step_ms(runner, add_prompt(decode_plan(batch, ns.context), chunk, decode_blocks + 1), setup.repeats)
    decode = step_ms(runner, decode_plan(batch, ns.context), setup.repeats)
    prompt = step_ms(runner, add_prompt(StepPlan(), chunk, decode_blocks + 1), setup.repeats)
    small = add_prompt(decode_plan(small_batch, ns.context), small_chunk, decode_blocks + 1)
    pieces, runner.piecewise_graphs = runner.piecewise_graphs, None
    eager = step_ms(runner, small, setup.repeats)
    runner.piecewise_graphs = pieces
    assert pieces is not None and pieces.run(small) is not None, "--piecewise: a step within the largest bucket"
    piecewise = step_ms(runner, small, setup.repeats)
    _release(runner)
    return [Result("mixed", ns.preset, f"{batch} x {ns.context} decodes + {chunk} prompt",
                   {"mixed_ms": mixed, "decode_ms": decode, "prompt_ms": prompt,
                    "mixed_minus_decode_ms": mixed - decode, "x_separate": mixed / (decode + prompt)}),
            Result("mixed", ns.preset, f"{small_batch} x {ns.context} decodes + {small_chunk} prompt, piecewise",
                   {"piecewise_ms": piecewise, "eager_ms": eager, "x_eager": piecewise / eager})]


STAGES: dict[str, Callable[[argparse.Namespace, Setup], list[Result]]] = {
    "capture": stage_capture, "profile": stage_profile, "long": stage_long, "mixed": stage_mixed}


def _pairs(text: str) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in (p.split("x") for p in text.split(",") if p)]


def summary(paths: list[str]) -> list[Result]:
    """One table of the stages' saved results, in the files' order."""
    results = [Result(**r) for path in paths if Path(path).exists()
               for r in json.loads(Path(path).read_text())["results"]]
    print_table(["stage", "model", "step", "measured"],
                [[r.stage, r.model, r.step, ", ".join(f"{k} {_fmt(v)}" for k, v in r.values.items())]
                 for r in results] or [["(none)", "", "", ""]])
    return results


def _fmt(value: float) -> str:
    return f"{value:.0f}" if value == int(value) and abs(value) >= 1 else f"{value:.3g}"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=[*STAGES, "summary"])
    parser.add_argument("files", nargs="*", help="summary: the stages' --save files")
    parser.add_argument("--preset", default="qwen3-8b", help="the dense shape (model/demo_checkpoint.py)")
    parser.add_argument("--moe-preset", default="small-moe", help="capture: the MoE shape")
    parser.add_argument("--context", type=int, default=256, help="cached tokens of each decode (profile, mixed)")
    parser.add_argument("--batches", default="1,64", help="profile: decode batch sizes")
    parser.add_argument("--long", default="1x16384,64x4096,16x32768", help="long: batch x context, comma-separated")
    parser.add_argument("--mixed", default="64x2048", help="mixed: decodes x prompt chunk tokens")
    parser.add_argument("--piecewise", default="64x448", help="mixed: decodes x chunk within the largest token "
                        "bucket (512), from piecewise graphs and eagerly")
    parser.add_argument("--max-batch", type=int, default=64, help="max_num_seqs: the largest graph bucket")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--compare-device", default="H200", help="the HBM floor's datasheet (sizing/devices.py)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU in float32 (Triton's interpreter)")
    parser.add_argument("--save", type=Path, default=None, help="write the results as JSON here")
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    if ns.stage == "summary":
        summary(ns.files)
        return 0
    if ns.smoke:
        ns.preset, ns.moe_preset, ns.context, ns.batches = "tiny", "tiny-moe", 20, "1,4"
        ns.long, ns.mixed, ns.piecewise = "2x40", "4x8", "3x6"
        setup = Setup(torch.device("cpu"), torch.float32, 2, 4)
    else:
        setup = Setup(torch.device("cuda"), torch.bfloat16, ns.repeats, ns.max_batch)
    torch.manual_seed(0)
    print(hardware_line(), flush=True)
    results = STAGES[ns.stage](ns, setup)
    summary_rows = [[r.model, r.step, ", ".join(f"{k} {_fmt(v)}" for k, v in r.values.items())] for r in results]
    print_table(["model", "step", "measured"], summary_rows)
    if ns.save:
        ns.save.write_text(json.dumps({"hardware": hardware_line(), "results": [asdict(r) for r in results]},
                                      indent=1) + "\n")
    failed = [r for r in results if r.stage == "capture" and (r.values["graphs"] != r.values["expected"] or
                                                               r.values.get("piecewise", 0.0)
                                                               != r.values.get("piecewise_expected", 0.0))]
    for r in failed:
        print(f"{r.model}: {r.values['graphs']:.0f} decode graphs captured, {r.values['expected']:.0f} expected; "
              f"piecewise graphs for {r.values.get('piecewise', 0.0):.0f} token buckets, "
              f"{r.values.get('piecewise_expected', 0.0):.0f} expected")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
