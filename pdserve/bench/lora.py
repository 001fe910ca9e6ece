"""The cost of LoRA on CPU: a decode step of a batch mixing two rank-16 adapters with the base
model, against the same batch on the base model alone, in one run.

    python -m pdserve.bench.lora [--preset small] [--num-seqs 24] [--rank 16]

Workload: `--num-seqs` random prompts of `--prompt-len` tokens, greedy, `--output-len` tokens each,
float32; the mixed batch gives a third of them to each adapter and leaves a third on the base model.
Adapters: random PEFT-format adapters over every target (q, k, v, o, gate, up, down) of rank
`--rank`. Rows: the base engine (no LoRA), the LoRA engine with every request on the base model
(what the wrapped projections cost when unused), and the mixed batch on the torch path's two ways
(`segments`: one matmul pair per adapter over its rows; `gather`: each row's A and B gathered, one
batched matmul pair). Step time: the median of the engine's steps (decode steps: the prompts take
one step), after one warm-up run of the same workload; the cases take turns `--rounds` times and
each row is its best round.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from pdserve import LLM, LoRARequest, SamplingParams
from pdserve.bench.common import hardware_line, print_table
from pdserve.model.demo_checkpoint import PRESETS, write_checkpoint
from pdserve.model.lora import TARGETS, target_shapes
from pdserve.model.qwen3_config import Qwen3ModelConfig


def write_random_adapter(model_dir: Path, out: Path, rank: int, seed: int) -> Path:
    """A PEFT-format adapter over every target of every layer, weights drawn at random."""
    cfg = Qwen3ModelConfig.from_dir(model_dir)
    shapes = target_shapes(cfg)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for target, (block, _, _) in TARGETS.items():
            in_features, out_features = shapes[target]
            prefix = f"base_model.model.model.layers.{layer}.{block}.{target}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=gen) * in_features**-0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=gen) * rank**-0.5 * 0.1
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS), "bias": "none"}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def median_step_s(llm: LLM, prompts: list[list[int]], params: SamplingParams,
                  loras: list[LoRARequest | None]) -> float:
    """The median wall time of the engine's steps running `prompts` to completion."""
    engine = llm.engine
    for index, (prompt, lora) in enumerate(zip(prompts, loras, strict=True)):
        engine.add_request(f"r{index}", prompt,
                           params if lora is None else dataclasses.replace(params, lora_name=lora.lora_name))
    times = []
    while engine.has_runnable_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", choices=sorted(p for p, s in PRESETS.items() if not s.is_moe))
    parser.add_argument("--num-seqs", type=int, default=24)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=24)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 150_000, (args.prompt_len,), generator=gen).tolist() for _ in range(args.num_seqs)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = write_checkpoint(root / "model", PRESETS[args.preset], seed=0)
        adapters = [write_random_adapter(model_dir, root / f"adapter{i}", args.rank, seed=i) for i in range(2)]
        engine_args = {"dtype": "float32", "num_kv_blocks": 512, "max_num_seqs": args.num_seqs,
                       "max_num_batched_tokens": args.num_seqs * args.prompt_len, "enable_prefix_caching": False}
        base = LLM(model=str(model_dir), **engine_args)
        lora = LLM(model=str(model_dir), **engine_args, enable_lora=True, max_loras=2, max_lora_rank=args.rank,
                   lora_modules=tuple(f"a{i}={path}" for i, path in enumerate(adapters)))
        assert lora.engine.lora is not None
        batch = lora.engine.lora.batch
        names = [None, LoRARequest("a0"), LoRARequest("a1")]
        mixed = [names[i % 3] for i in range(args.num_seqs)]
        none: list[LoRARequest | None] = [None] * args.num_seqs
        cases: list[tuple[str, LLM, list[LoRARequest | None], str]] = [
            ("base model, no LoRA", base, none, "segments"),
            ("LoRA engine, every request on the base", lora, none, "segments"),
            ("mixed: 2 adapters + base, segments", lora, mixed, "segments"),
            ("mixed: 2 adapters + base, gather", lora, mixed, "gather")]
        for _, llm, loras, path in cases:  # warm-up
            batch.torch_path = path
            median_step_s(llm, prompts, params, loras)
        # NOTE: the cases take turns, `--rounds` times, and each keeps its least disturbed round: on
        # a shared machine another process's burst then spoils one round of one case, not a row
        best = [float("inf")] * len(cases)
        for _ in range(args.rounds):
            for index, (_, llm, loras, path) in enumerate(cases):
                batch.torch_path = path
                best[index] = min(best[index], median_step_s(llm, prompts, params, loras))
        batch.torch_path = "segments"
        results = [(label, seconds) for (label, *_), seconds in zip(cases, best, strict=True)]
    print(hardware_line())
    print(f"model {args.preset} (random weights, float32), {args.num_seqs} sequences, prompts of {args.prompt_len} "
          f"tokens, {args.output_len} generated, adapters of rank {args.rank} on q/k/v/o/gate/up/down, "
          f"{args.threads} threads")
    base_s = results[0][1]
    print_table(["batch", "median step ms", "x base"],
                [[label, f"{seconds * 1000:.2f}", f"{seconds / base_s:.2f}"] for label, seconds in results])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
