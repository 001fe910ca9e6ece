"""Tensor parallelism offline: TP=2 (two ranks, one thread each) against TP=1 (one process, two
threads), same random model, same prompts, greedy; plus the all-reduce's share of a TP=2 step, and
TP=1 on one thread for scale.

    python -m pdserve.bench.tp [--preset small] [--num-requests 16] [--reps 2]

Workload: --num-requests prompts of random token ids, lengths uniform in --input-len, each asking
for --output-len tokens (ignore_eos), float32. Each configuration warms up on the first two
requests, then runs the whole workload --reps times; the table gives the best run, as a ratio to
TP=1 measured in the same run. The all-reduce share is rank 0's time inside all-reduces over its
step time: it includes waiting for the slower rank, not only moving bytes.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

from pdserve.bench.common import hardware_line, print_table
from pdserve.engine.llm import LLM, TokensPrompt
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tensor_parallel import TPModelRunner
from pdserve.model.demo_checkpoint import default_model_dir

_FIRST_SPECIAL_TOKEN = 151643


@dataclass(frozen=True, slots=True)
class Result:
    name: str
    best_s: float
    tokens: list[list[int]]
    reduce_share: float | None  # all-reduce time / step time on rank 0 (TP > 1)


def _prompts(num: int, input_len: tuple[int, int], seed: int) -> list[TokensPrompt]:
    rng = random.Random(seed)
    return [TokensPrompt(prompt_token_ids=[rng.randrange(_FIRST_SPECIAL_TOKEN) for _ in range(rng.randint(*input_len))])
            for _ in range(num)]


def run(name: str, model: str, tp: int, threads: int, prompts: list[TokensPrompt], output_len: int,
        reps: int) -> Result:
    llm = LLM(model=model, dtype="float32", tensor_parallel_size=tp, num_threads=threads, kv_cache_memory="512MiB")
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    try:
        llm.generate(prompts[:2], params)  # warm-up
        runner, engine = llm.engine.runner, llm.engine
        reduce_s0 = runner.group.reduce_s if isinstance(runner, TPModelRunner) else 0.0
        step_s0 = engine.stats().step_time_s
        times, tokens = [], []
        for _ in range(reps):
            start = time.perf_counter()
            outputs = llm.generate(prompts, params)
            times.append(time.perf_counter() - start)
            tokens = [o.outputs[0].token_ids for o in outputs]
        share = None
        if isinstance(runner, TPModelRunner):
            share = (runner.group.reduce_s - reduce_s0) / (engine.stats().step_time_s - step_s0)
        return Result(name, min(times), tokens, share)
    finally:
        llm.engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", help="demo checkpoint preset (tiny, small, qwen3-0.6b)")
    parser.add_argument("--model", default=None, help="a checkpoint directory instead of --preset")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--input-len", type=int, nargs=2, default=(48, 240))
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    model = args.model or str(default_model_dir(args.preset))
    prompts = _prompts(args.num_requests, tuple(args.input_len), seed=0)
    num_tokens = args.num_requests * args.output_len
    print(hardware_line())
    print(f"model {args.model or args.preset}, float32, {args.num_requests} requests, prompts "
          f"{args.input_len[0]}-{args.input_len[1]} tokens, {args.output_len} output tokens each, best of {args.reps}")
    base = run("TP=1, 2 threads", model, 1, 2, prompts, args.output_len, args.reps)
    one = run("TP=1, 1 thread", model, 1, 1, prompts, args.output_len, args.reps)
    tp2 = run("TP=2, 1 thread per rank", model, 2, 1, prompts, args.output_len, args.reps)
    rows = [[r.name, f"{r.best_s:.2f}", f"{num_tokens / r.best_s:.1f}", f"{base.best_s / r.best_s:.2f}",
             "-" if r.reduce_share is None else f"{100 * r.reduce_share:.1f}%"] for r in (base, one, tp2)]
    print_table(["configuration", "time s", "output tok/s", "speed vs TP=1", "all-reduce share of step"], rows)
    same = tp2.tokens == base.tokens == one.tokens
    print(f"same greedy tokens in all three: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
