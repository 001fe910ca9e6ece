"""The FP8 KV cache against bfloat16 (and float32) KV on CPU: blocks per GiB, decode step time, and
how far the FP8 pool's logprobs drift from a float32 pool's.

    python -m pdserve.bench.kv_fp8 [--preset small] [--num-seqs 16] [--context 512] [--steps 8] [--rounds 5]

A random-weight demo checkpoint (`--preset`), written with per-layer K/V scales that are not 1.0
(so the FP8 rows pay for the multiply a real FP8 checkpoint's scales cost), computing in float32.
Per KV dtype, one engine with the same `--kv-cache-memory` (1 GiB): its blocks per GiB; its decode
step time with `--num-seqs` sequences whose contexts are `--context` tokens (after their prefill
and one warm-up step; the default token budget): `--rounds` rounds, each timing `--steps` steps
of every engine in turn (so a load that changes on a shared machine weighs on every row alike),
the median round's mean; and, with an engine of its own (one at a time, 32-token chunks),
against the float32 pool, the teacher-forced drift:
each prompt plus the float32 engine's greedy continuation, prefilled in 32-token chunks with prompt
logprobs, the mean and largest |logprob difference| of the positions past the first chunk (those
read K/V back from the pool). Ratios are against the bfloat16 row of the same run.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from pdserve import LLM, SamplingParams
from pdserve.bench.common import hardware_line, print_table, step_until_prompts_are_in
from pdserve.engine.llm import TokensPrompt
from pdserve.model.demo_checkpoint import PRESETS, write_checkpoint

KV_DTYPES = ("bfloat16", "fp8", "fp8_e5m2", "float32")
_CHUNK = 32  # tokens a step in the drift runs: prompts read their earlier chunks back from the pool
_VOCAB_LOW, _VOCAB_HIGH = 1000, 100_000


def write_model(root: Path, preset: str) -> Path:
    """The preset's random checkpoint, with K/V scales 0.5 and 0.25 in every layer."""
    model_dir = write_checkpoint(root / preset, PRESETS[preset], seed=0)
    scales = {}
    for layer in range(PRESETS[preset].num_hidden_layers):
        scales[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(0.5)
        scales[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(0.25)
    save_file(scales, str(model_dir / "kv_scales.safetensors"))
    return model_dir


def prompts(num: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(_VOCAB_LOW, _VOCAB_HIGH, (num, length), generator=gen).tolist()


def start_decodes(llm: LLM, token_prompts: list[list[int]], max_tokens: int) -> None:
    """The sequences prefilled and one decode step (warm-up) taken: every later step decodes them all."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for index, prompt in enumerate(token_prompts):
        engine.add_request(f"step-{index}", prompt, params)
    step_until_prompts_are_in(engine)
    engine.step()


def mean_step_s(llm: LLM, num_steps: int) -> float:
    start = time.perf_counter()
    for _ in range(num_steps):
        llm.engine.step()
    return (time.perf_counter() - start) / num_steps


def teacher_forced(llm: LLM, sequences: list[list[int]]) -> list[float]:
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences], params)
    return [lp.logprob for out in outs for lp in (out.prompt_logprobs or [])[_CHUNK + 1:] if lp is not None]


def measure_drift(model_dir: Path, kv_dtypes: tuple[str, ...], drift_prompts: list[list[int]],
                  drift_tokens: int) -> tuple[dict[str, tuple[float, float]], int]:
    """Each KV dtype's logprob drift (mean, max) from float32's, teacher-forced on float32's greedy
    continuations (`kv_dtypes` starts with float32); and over how many positions."""
    drift: dict[str, tuple[float, float]] = {}
    sequences: list[list[int]] = []
    reference: list[float] = []
    for kv in kv_dtypes:  # NOTE: one engine at a time, in chunks: what the test bounds (test_kv_fp8.py)
        llm = LLM(model=str(model_dir), dtype="float32", kv_cache_dtype=kv, num_kv_blocks=64,
                  max_num_batched_tokens=_CHUNK, enable_prefix_caching=False)
        if kv == "float32":
            greedy = SamplingParams(temperature=0.0, max_tokens=drift_tokens, ignore_eos=True)
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in drift_prompts], greedy)
            sequences = [p + o.outputs[0].token_ids for p, o in zip(drift_prompts, outs, strict=True)]
            reference = teacher_forced(llm, sequences)
        gaps = [abs(a - b) for a, b in zip(reference, teacher_forced(llm, sequences), strict=True)]
        drift[kv] = (sum(gaps) / len(gaps), max(gaps))
        del llm
    return drift, len(reference)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", choices=sorted(PRESETS))
    parser.add_argument("--num-seqs", type=int, default=16)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8, help="decode steps timed per round and engine")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the engines (on a shared, loaded "
                                                               "machine, two threads wait on each other's barriers)")
    parser.add_argument("--drift-tokens", type=int, default=100, help="greedy tokens per drift prompt (3 prompts)")
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as root:
        model_dir = write_model(Path(root), args.preset)
        step_prompts = prompts(args.num_seqs, args.context, seed=1)
        drift_prompts = prompts(3, 40, seed=2)
        kv_dtypes = ("float32", *[k for k in KV_DTYPES if k != "float32"])
        drift, num_positions = measure_drift(model_dir, kv_dtypes, drift_prompts, args.drift_tokens)
        engines = {kv: LLM(model=str(model_dir), dtype="float32", kv_cache_dtype=kv, kv_cache_memory="1GiB",
                           enable_prefix_caching=False, num_threads=args.threads) for kv in kv_dtypes}
        for llm in engines.values():
            start_decodes(llm, step_prompts, args.rounds * args.steps + 2)
        samples: dict[str, list[float]] = {kv: [] for kv in engines}
        for _ in range(args.rounds):
            for kv, llm in engines.items():
                samples[kv].append(mean_step_s(llm, args.steps))
        rows = {kv: (llm.engine.config.cache.num_kv_blocks, statistics.median(samples[kv]), drift[kv])
                for kv, llm in engines.items()}
        for llm in engines.values():
            while llm.engine.has_unfinished_requests():
                llm.engine.step()
    print(f"{hardware_line()}; preset {args.preset} (float32 compute, K/V scales 0.5/0.25), "
          f"{args.num_seqs} sequences x {args.context} tokens of context, median of {args.rounds} rounds of "
          f"{args.steps} decode steps, engines in turn; drift over {num_positions} teacher-forced positions")
    base_blocks, base_step, _ = rows["bfloat16"]
    table = [[kv, f"{blocks:,}", f"{blocks / base_blocks:.2f}x", f"{1000 * step:.1f}", f"{step / base_step:.2f}x",
              f"{drift[0]:.4f}", f"{drift[1]:.4f}"] for kv, (blocks, step, drift) in rows.items()]
    print_table(["KV dtype", "blocks per GiB", "vs bfloat16", "decode step ms", "vs bfloat16",
                 "logprob drift mean", "max"], table)


if __name__ == "__main__":
    main()
