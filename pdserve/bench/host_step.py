"""The host's work per decode step with the model stubbed out: scheduler, KV cache manager, the
runner's input preparation (step plan, persistent step buffers, decode buckets), output
processing and the encoding of the step's message to the API process: everything the engine core
process's step (`LLMEngine.step_deltas`, `encode_from_core`) does except the math. The model's
forward returns zeros of the right shape, so what is timed is what a GPU would wait on between two
replays.

Each shape (streams x context) is prefilled first (untimed), then `--steps` decode steps are timed
and the median step is printed. `--compare-with DIR` runs the same shapes, with this file's
harness, against another checkout's sources (a git worktree of an earlier commit) in a subprocess
and prints both columns and their ratio.

    python -m pdserve.bench.host_step [--shapes 64x256,64x4096,256x2048,64x16384] [--steps 30]
        [--compare-with /tmp/pdserve-before]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from pdserve import LLM
from pdserve.bench.common import hardware_line, print_table, step_until_prompts_are_in
from pdserve.engine.sampling_params import SamplingParams
from pdserve.model.demo_checkpoint import PRESETS, write_checkpoint

_BLOCK_SIZE = 16
_STUB_VOCAB = 256
_DEFAULT_SHAPES = "64x256,64x4096,256x2048,64x16384"


def _stub_forward(hidden_size: int, dtype: torch.dtype) -> Callable[..., torch.Tensor]:
    def forward(input_ids: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        return torch.zeros(input_ids.shape[0], hidden_size, dtype=dtype)
    return forward


def _stub_logits() -> Callable[[torch.Tensor], torch.Tensor]:
    """Logits _STUB_VOCAB wide: the argmax over a real vocabulary is device work on a GPU, and on
    this CPU it would cost more than all the host work measured here."""
    def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
        return torch.zeros(hidden.shape[0], _STUB_VOCAB)
    return compute_logits


def tiny_long_context_model(out_dir: Path) -> Path:
    """The tiny demo shape with a 40K context (the tiny preset's is 4K); weights do not matter here."""
    return write_checkpoint(out_dir, replace(PRESETS["tiny"], max_position_embeddings=40960))


def engine_core_step(engine: object) -> Callable[[], bytes]:
    """A step as the engine core process runs it (engine/core_proc.py): `step_deltas`, then its
    message to the API process encoded. For another checkout (`--compare-with`), the same work as
    it did it: from before `StepTokens` every delta whole; from before `step_deltas` snapshots
    turned into deltas by its `_DeltaTracker`."""
    from pdserve.engine import output
    from pdserve.engine.core_wire import FromCore, encode_from_core

    step_deltas = getattr(engine, "step_deltas", None)
    short_form = getattr(output, "StepTokens", None)
    if step_deltas is not None and short_form is not None:
        def step() -> bytes:
            alone = short_form()
            return encode_from_core(FromCore(step_deltas(alone), alone=alone))
        return step
    if step_deltas is not None:
        return lambda: encode_from_core(FromCore(step_deltas()))
    from pdserve.engine.core_proc import _DeltaTracker  # type: ignore[attr-defined]
    tracker = _DeltaTracker()
    return lambda: encode_from_core(FromCore([tracker.delta(o) for o in engine.step()]))  # type: ignore[attr-defined]


def measure(model_dir: Path, num_streams: int, context_len: int, num_steps: int) -> float:
    """Median host time of one decode step (ms) with `num_streams` requests at `context_len`."""
    batched_tokens = max(8192, num_streams)
    # NOTE: streams whose prompt is in decode during the later streams' prefill steps: none may finish first
    max_tokens = num_steps + 8 + -(-num_streams * context_len // batched_tokens)
    max_len = context_len + max_tokens + _BLOCK_SIZE
    num_blocks = num_streams * (-(-max_len // _BLOCK_SIZE)) + 64
    llm = LLM(model=str(model_dir), device="cpu", dtype="bfloat16", block_size=_BLOCK_SIZE,
              num_kv_blocks=num_blocks, max_num_seqs=num_streams, max_model_len=max_len,
              max_num_batched_tokens=batched_tokens)
    engine = llm.engine
    engine.detokenize = False  # as the engine core process runs (engine/core_proc.py): its API process detokenizes
    runner = engine.runner
    runner.use_paged_step(graphs=True)  # what CUDA runs: step buffers, decode steps padded to their bucket
    # NOTE: mixed and prefill steps (the prompts, untimed) run the stubbed forward eagerly: the
    # piecewise path would call the model's pieces, which are not stubbed
    runner.piecewise_graphs = None
    model = runner.model
    model.forward = _stub_forward(model.cfg.hidden_size, runner.config.dtype)  # type: ignore[method-assign]
    model.compute_logits = _stub_logits()  # type: ignore[method-assign, assignment]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for index in range(num_streams):  # distinct prompts: no prefix shared
        start = 1 + (index * 7919) % 100
        engine.add_request(f"r{index}", [(start + i) % 150 + 1 for i in range(context_len)], params)
    step_until_prompts_are_in(engine)
    gc.collect()  # NOTE: the earlier shapes' engines are garbage now; their collection is not this shape's work
    times = []
    step = engine_core_step(engine)
    for _ in range(num_steps):
        start_s = time.perf_counter()
        step()
        times.append(time.perf_counter() - start_s)
    running = len(engine.scheduler.running)
    assert running == num_streams, f"{running} of {num_streams} streams decode (every one should, every step)"
    return statistics.median(times) * 1e3


def _parse_shapes(text: str) -> list[tuple[int, int]]:
    return [(int(b), int(c)) for b, c in (s.split("x") for s in text.split(","))]


def _run_elsewhere(checkout: str, shapes: str, num_steps: int) -> dict[str, float]:
    """This file's `--json` run against another checkout's sources: the same harness times both
    columns (run as a script, `pdserve` resolves to the checkout's)."""
    env = dict(os.environ, PYTHONPATH=checkout)
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--shapes", shapes, "--steps", str(num_steps),
                          "--json"], env=env, cwd=checkout, check=True, capture_output=True, text=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=_DEFAULT_SHAPES, help="streams x context, comma-separated")
    parser.add_argument("--steps", type=int, default=30, help="decode steps timed per shape")
    parser.add_argument("--compare-with", default=None, help="another checkout to run the same shapes from")
    parser.add_argument("--json", action="store_true", help="print one JSON line {shape: ms} only")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)  # NOTE: host work is one thread; a pool's spin-waits would be timed as work
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = tiny_long_context_model(Path(tmp) / "tiny-40k")
        results = {f"{b}x{c}": measure(model_dir, b, c, args.steps) for b, c in _parse_shapes(args.shapes)}
    if args.json:
        print(json.dumps(results))
        return
    before = _run_elsewhere(args.compare_with, args.shapes, args.steps) if args.compare_with else {}
    print(hardware_line())
    print(f"workload: tiny demo model stubbed (forward returns zeros, logits {_STUB_VOCAB} wide), "
          f"block size {_BLOCK_SIZE}, greedy, median of {args.steps} decode steps after the prompts are in")
    headers = ["streams x context", "host ms / step"] + (["before ms", "after / before"] if before else [])
    rows = []
    for shape, ms in results.items():
        row = [shape, f"{ms:.3f}"]
        if before:
            row += [f"{before[shape]:.3f}", f"{ms / before[shape]:.2f}"]
        rows.append(row)
    print_table(headers, rows)


if __name__ == "__main__":
    main()
