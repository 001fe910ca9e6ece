"""A decode step's time at each batch size, with the packed linears' row floor and without it.

The floor (`model/packed_linear.py`, `_MIN_ROWS`): fewer than 4 rows run as 4, because oneDNN's
kernels for 1 and 2 rows read a weight that does not fit the caches more slowly than its 4-row
kernel. This runs the same engine both ways in one process, one after the other, and prints the
median decode step (after the prompts are in) and the ratio, per batch size.

    python -m pdserve.bench.decode_step --model DIR [--batches 1,2,3,4,8] [--tokens 10]
        [--prompt-len 40] [--num-threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pdserve import LLM, SamplingParams
from pdserve.bench.common import hardware_line, print_table, step_until_prompts_are_in
from pdserve.model import packed_linear


def median_decode_step_ms(llm: LLM, batch: int, tokens: int, prompt_len: int, tag: str) -> float:
    """`batch` requests of `prompt_len` tokens prefilled, then the median of their decode steps."""
    engine = llm.engine
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{tag}-{batch}-{i}", [100 + i + j for j in range(prompt_len)], params)
    step_until_prompts_are_in(engine)
    times = []
    while engine.scheduler.requests:
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a checkpoint directory (make-model writes one)")
    parser.add_argument("--batches", default="1,2,3,4,8", help="decode batch sizes, comma-separated")
    parser.add_argument("--tokens", type=int, default=10, help="tokens each request generates")
    parser.add_argument("--prompt-len", type=int, default=40)
    parser.add_argument("--num-threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(model=args.model, num_kv_blocks=max(64, 4 * max(batches) * (args.prompt_len + args.tokens) // 16),
              max_model_len=args.prompt_len + args.tokens + 16, max_num_seqs=max(batches),
              num_threads=args.num_threads, kv_cache_prefault=True)
    floor = packed_linear._MIN_ROWS
    with_floor, without = {}, {}
    try:
        for b in batches:  # NOTE: alternated per batch, so a drift in the machine's speed hits both alike
            packed_linear._MIN_ROWS = 1
            without[b] = median_decode_step_ms(llm, b, args.tokens, args.prompt_len, "exact")
            packed_linear._MIN_ROWS = floor
            with_floor[b] = median_decode_step_ms(llm, b, args.tokens, args.prompt_len, "floor")
    finally:
        packed_linear._MIN_ROWS = floor
        llm.engine.close()
    print(hardware_line())
    print(f"model {args.model}, {args.num_threads} thread(s), prompts of {args.prompt_len}, "
          f"median of {args.tokens - 1} decode steps")
    print_table(["batch", "rows as they are ms", f"at least {floor} rows ms", "ratio"],
                [[str(b), f"{without[b]:.1f}", f"{with_floor[b]:.1f}", f"{with_floor[b] / without[b]:.2f}"]
                 for b in batches])


if __name__ == "__main__":
    main()
