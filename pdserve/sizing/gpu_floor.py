"""Engine steps against the GPU's floors, decode from CUDA graphs and eagerly.

    python -m pdserve.sizing.gpu_floor --model CK [--model CK2 ...] [--device cuda] [--dtype bfloat16]
        [--compare-device H200] [--batches 1,16,64,256] [--context 256] [--prefill-tokens 8192]
        [--greedy-check] [--save FILE]

For each model, one engine with decode CUDA graphs (the default on CUDA), then one with
`--enforce-eager`; each times, through `LLMEngine.step` as `pdserve calibrate` does
(sizing/calibrate.py: median of its repetitions):
- a decode step of B sequences at `--context` tokens each, against the HBM floor: the bytes a
  step must read (every matmul weight once, the LM head included; each sequence's KV) over the
  device's bandwidth;
- a prefill of `--prefill-tokens` tokens (graphs engine only: prefill is eager in both), against
  the FLOPs floor: 2 x matmul parameters per token plus attention's pairs, over peak FLOP/s.
One table: measured ms, floor ms, measured / floor, and measured / the simulator's roofline
profile of the step (sizing/profile.py: the floors at 90 % bandwidth and 50 % FLOPs plus 2 ms a
step; the targets "decode at batch 64 within 1.5x" are against it). `--greedy-check`:
the first model in float32, graphs on, greedy against transformers on the same device (three
prompts, 32 tokens).
`scripts/device_check.sh` (stage `floor`) runs it on the qwen3-0.6b and qwen3-8b shapes.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from pdserve.bench.common import hardware_line, print_table
from pdserve.config import EngineArgs
from pdserve.engine.llm_engine import LLMEngine
from pdserve.model.facts import ModelFacts
from pdserve.sizing.calibrate import _Prompts, decode_sample, prefill_sample
from pdserve.sizing.devices import DeviceSpec, device
from pdserve.sizing.profile import Limits, Placement, roofline


@dataclass(frozen=True, slots=True)
class Row:
    model: str
    step: str  # "decode 16 x 256" or "prefill 8192"
    mode: str  # "graphs" or "eager"
    measured_s: float
    floor_s: float
    bound: str  # "HBM" or "FLOPs"
    roofline_s: float  # the simulator's roofline profile of this step (sizing/profile.py: 2 ms a step, 90 %/50 %)

    @property
    def ratio(self) -> float:
        return self.measured_s / self.floor_s


def decode_floor_s(model: ModelFacts, spec: DeviceSpec, batch: int, context: int, dtype_bytes: int,
                   kv_dtype_bytes: int) -> float:
    """Bytes one decode step must read: every matmul weight once, each sequence's context KV."""
    weights = model.matmul_params * dtype_bytes
    kv = batch * context * model.kv_bytes_per_token(kv_dtype_bytes)
    return (weights + kv) / spec.bandwidth_bytes_per_s


def prefill_floor_s(model: ModelFacts, spec: DeviceSpec, tokens: int, context: int = 0) -> float:
    """FLOPs of one prompt of `tokens` new tokens after `context` cached ones, at peak."""
    pairs = tokens * (context + (tokens + 1) / 2)
    return (2.0 * model.matmul_params * tokens + model.attention_flops_per_pair() * pairs) / spec.flops_per_s


def measure(args: EngineArgs, spec: DeviceSpec, batches: list[int], context: int, prefill_tokens: int
            ) -> list[Row]:
    engine = LLMEngine.from_engine_args(args)
    try:
        cfg = engine.config
        facts = ModelFacts.from_config(Path(cfg.model_path).name,
                                       json.loads((Path(cfg.model_path) / "config.json").read_text()))
        dtype_bytes = torch.empty((), dtype=cfg.dtype).element_size()
        kv_bytes = torch.empty((), dtype=cfg.kv_dtype).element_size()
        mode = "eager" if args.enforce_eager else "graphs"  # NOTE: on CPU neither captures a graph
        graphs = engine.runner.decode_graphs
        print(f"{args.model}: {len(graphs.graphs) if graphs is not None else 0} decode CUDA graphs captured",
              flush=True)
        prompts = _Prompts(cfg.model.vocab_size)
        limits = Limits(cfg.cache.num_kv_blocks, cfg.scheduler.max_num_seqs, cfg.scheduler.max_num_batched_tokens,
                        cfg.cache.block_size)
        profile = roofline(facts, spec, limits, Placement(dtype_bytes=dtype_bytes, kv_dtype_bytes=kv_bytes)).step
        rows = []
        for batch in batches:
            s = decode_sample(engine, prompts, batch, context)
            floor = decode_floor_s(facts, spec, batch, context + 2, dtype_bytes, kv_bytes)
            rows.append(Row(facts.name, f"decode {batch} x {context}", mode, s.seconds, floor, "HBM",
                            profile.step_s(0, 0.0, s.decode_seqs, s.decode_context)))
        if prefill_tokens and mode == "graphs":
            s = prefill_sample(engine, prompts, prefill_tokens, 0)
            rows.append(Row(facts.name, f"prefill {prefill_tokens}", "eager", s.seconds,
                            prefill_floor_s(facts, spec, prefill_tokens), "FLOPs",
                            profile.step_s(s.prefill_tokens, s.prefill_pairs, 0, 0)))
        return rows
    finally:
        engine.close()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def greedy_check(model: str, device_name: str, max_tokens: int = 32) -> tuple[int, int]:
    """(prompts whose greedy continuation equals transformers', prompts), float32, graphs on."""
    from transformers import AutoModelForCausalLM

    from pdserve import LLM, SamplingParams

    prompts = [list(range(100, 100 + n)) for n in (5, 60, 300)]
    llm = LLM(model=model, device=device_name, dtype="float32", max_num_seqs=8, gpu_memory_utilization=0.3)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    del llm
    gc.collect()
    hf: Any = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)  # NOTE: its `to` is mistyped
    hf = hf.to(torch.device(device_name)).eval()
    hf.generation_config.eos_token_id = None  # NOTE: never stop early, as pdserve with ignore_eos
    equal = 0
    with torch.inference_mode():
        for prompt, tokens in zip(prompts, ours, strict=True):
            out = hf.generate(torch.tensor([prompt], device=device_name), max_new_tokens=max_tokens, do_sample=False)
            equal += out[0, len(prompt):].tolist() == list(tokens)
    return equal, len(prompts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", required=True, help="checkpoint directory (repeatable)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--compare-device", default="H200", help="the floors' datasheet (sizing/devices.py)")
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--context", type=int, default=256, help="prompt tokens of each decoding sequence")
    parser.add_argument("--prefill-tokens", type=int, default=8192, help="0: no prefill row")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    parser.add_argument("--greedy-check", action="store_true")
    parser.add_argument("--save", type=Path, default=None)
    ns = parser.parse_args(argv)
    spec = device(ns.compare_device)
    batches = [int(b) for b in ns.batches.split(",")]
    print(hardware_line())
    print(f"floors: {spec.describe()}")
    rows: list[Row] = []
    for model in ns.model:
        for eager in (False, True):
            args = EngineArgs(model=model, device=ns.device, dtype=ns.dtype, max_num_seqs=max(batches),
                              max_num_batched_tokens=max(ns.prefill_tokens, 2048), enforce_eager=eager,
                              gpu_memory_utilization=ns.gpu_memory_utilization,
                              max_model_len=max(ns.context + 64, ns.prefill_tokens + 64))
            start = time.perf_counter()
            rows += measure(args, spec, batches, ns.context, 0 if eager else ns.prefill_tokens)
            print(f"{Path(model).name} {'eager' if eager else 'graphs'}: {time.perf_counter() - start:.1f} s",
                  flush=True)
    with_graphs = {(r.model, r.step): r for r in rows if r.mode == "graphs" or r.bound == "FLOPs"}
    eager_rows = {(r.model, r.step): r for r in rows if r.mode == "eager" and r.bound == "HBM"}
    table = []
    for key, r in with_graphs.items():
        e = eager_rows.get(key)
        table.append([r.model, r.step, f"{r.measured_s * 1e3:.2f}", f"{r.floor_s * 1e3:.3f}", r.bound,
                      f"{r.ratio:.2f}", f"{r.measured_s / r.roofline_s:.2f}", f"{e.measured_s * 1e3:.2f}" if e else "",
                      f"{e.ratio:.2f}" if e else ""])
    print_table(["model", "step", "ms (graphs)", "floor ms", "floor", "x floor", "x roofline profile",
                 "ms (--enforce-eager)", "x floor (eager)"], table)
    result: dict = {"hardware": hardware_line(), "floors": spec.describe(), "rows": [asdict(r) for r in rows]}
    if ns.greedy_check:
        equal, total = greedy_check(ns.model[0], ns.device)
        print(f"greedy float32, graphs on, against transformers: {equal}/{total} prompts equal")
        result["greedy_equal"] = [equal, total]
    if ns.save:
        ns.save.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
