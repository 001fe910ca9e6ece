"""Offline throughput: pdserve `LLM.generate` vs transformers' batched `generate`, same random
model, same prompts, same greedy decoding; plus scheduler time per step at a full batch.

    python -m pdserve.bench.offline_throughput [--model DIR] [--num-requests 64]

Workload: `num_requests` prompts of random token ids with lengths uniform in --input-len, each
asking for a number of tokens uniform in --output-len (ignore_eos). transformers runs them as
left-padded batches of up to --max-num-seqs with max_new_tokens = the batch's largest request,
the way vLLM's benchmark_throughput runs its HF backend; only requested tokens count as output.

transformers runs twice: in a fresh process, as its users run it (default host allocator), and in
this process after pdserve, where it inherits the allocator tuning pdserve's engine applies at
start-up (`engine/host_memory.py`), which speeds transformers up too.
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pdserve import LLM, SamplingParams
from pdserve.bench.common import hardware_line, print_table, step_until_prompts_are_in
from pdserve.model.demo_checkpoint import default_model_dir

_PAD_ID = 151643


@dataclass(frozen=True, slots=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(num_requests: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(0, _PAD_ID) for _ in range(rng.randint(*input_len))] for _ in range(num_requests)]
    return Workload(prompts, [rng.randint(*output_len) for _ in range(num_requests)])


def run_pdserve(llm: LLM, work: Workload) -> tuple[float, list[list[int]]]:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in work.output_lens]
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in work.prompts], params)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outputs]


def run_transformers(model_dir: str, work: Workload, batch_size: int) -> tuple[float, list[list[int]]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    _hf_batch(model, [p[:8] for p in work.prompts[:2]], 4)  # warm-up
    tokens: list[list[int]] = []
    start = time.perf_counter()
    for first in range(0, len(work.prompts), batch_size):
        batch = work.prompts[first:first + batch_size]
        lens = work.output_lens[first:first + batch_size]
        generated = _hf_batch(model, batch, max(lens))
        tokens.extend(g[:n] for g, n in zip(generated, lens, strict=True))
    return time.perf_counter() - start, tokens


def run_transformers_fresh_process(model_dir: str, work: Workload, batch_size: int) -> tuple[float, list[list[int]]]:
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(run_transformers, (model_dir, work, batch_size))


class _Generator(Protocol):
    """What we call on a transformers causal LM (transformers is a test-only dependency)."""

    def generate(self, **kwargs: Any) -> torch.Tensor: ...


def _hf_batch(model: _Generator, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), _PAD_ID)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                             do_sample=False, pad_token_id=_PAD_ID, eos_token_id=None)
    return out[:, width:].tolist()


def scheduler_share(llm: LLM, num_seqs: int, num_steps: int, seed: int) -> tuple[float, float]:
    """Mean step time and the share spent in schedule()+update(), over decode steps with
    `num_seqs` sequences running."""
    engine = llm.engine
    work = make_workload(num_seqs, (64, 256), (num_steps * 4, num_steps * 4), seed)
    params = SamplingParams(temperature=0.0, max_tokens=num_steps * 4, ignore_eos=True)
    for index, prompt in enumerate(work.prompts):
        engine.add_request(f"sched-{index}", prompt, params)
    step_until_prompts_are_in(engine)
    before = engine.stats()
    for _ in range(num_steps):
        engine.step()
        assert len(engine.scheduler.running) == num_seqs
    after = engine.stats()
    for index in range(num_seqs):
        engine.abort_request(f"sched-{index}")
    step_s = (after.step_time_s - before.step_time_s) / num_steps
    return step_s, (after.schedule_time_s - before.schedule_time_s) / (after.step_time_s - before.step_time_s)


def print_roofline_fraction(model_dir: str, work: Workload, seconds: float, batch: int) -> None:
    """The run's useful FLOPs per second against the best fp32 torch.mm rate on the model's shapes,
    measured now (bench/matmul_rate.py)."""
    import json
    from pathlib import Path

    from pdserve.bench.matmul_rate import gemm_ceiling_s, matmul_rates, workload_flops
    from pdserve.model.facts import ModelFacts

    facts = ModelFacts.from_config(Path(model_dir).name, json.loads((Path(model_dir) / "config.json").read_text()))
    flops = workload_flops(facts, [len(p) for p in work.prompts], work.output_lens)
    rates = matmul_rates(facts, batch=batch, chunk=512)
    best = max(rates, key=lambda r: r.flops_per_s)
    engine = flops / seconds
    print(f"useful work {flops / 1e9:.1f} GFLOP in {seconds:.1f} s = {engine / 1e9:.1f} GFLOP/s; torch.mm fp32 on "
          f"the model's shapes: best {best.flops_per_s / 1e9:.1f} GFLOP/s ({best.label}), worst "
          f"{min(r.flops_per_s for r in rates) / 1e9:.1f}; fraction of the best: {engine / best.flops_per_s:.2f} "
          f"(target >= 0.8)")
    floor_s = gemm_ceiling_s(facts, rates, [len(p) for p in work.prompts], work.output_lens, batch, 512)
    print(f"torch.mm alone at the run's own shapes (prompt tokens at M = 512, later tokens at M = {batch}) needs "
          f"{floor_s:.1f} s = {flops / floor_s / 1e9:.1f} GFLOP/s; fraction of that: {floor_s / seconds:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint dir (default: the random 'small' demo preset)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, nargs=2, default=(16, 1024), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--kv-cache-prefault", action=argparse.BooleanOptionalAction, default=True,
                        help="commit the KV pool at start-up (default), so the timed run pays no first-touch "
                             "page faults for it")
    parser.add_argument("--kv-cache-memory", default="4GiB",
                        help="the KV pool's size: room for every running sequence's context means no preemption "
                             "(recomputed tokens are not counted as useful work)")
    ns = parser.parse_args()
    model_dir = ns.model or str(default_model_dir("small"))
    work = make_workload(ns.num_requests, tuple(ns.input_len), tuple(ns.output_len), ns.seed)
    print(f"hardware: {hardware_line()}")
    print(f"model: {model_dir}; workload: {ns.num_requests} requests, input {ns.input_len[0]}-{ns.input_len[1]} "
          f"tokens, output {ns.output_len[0]}-{ns.output_len[1]} tokens, greedy, float32, seed {ns.seed}")

    llm = LLM(model_dir, dtype="float32", max_num_seqs=ns.max_num_seqs, kv_cache_memory=ns.kv_cache_memory,
              kv_cache_prefault=ns.kv_cache_prefault)
    run_pdserve(llm, make_workload(4, (16, 64), (4, 8), ns.seed + 1))  # warm-up
    pd_s, pd_tokens = run_pdserve(llm, work)
    print_roofline_fraction(model_dir, work, pd_s, min(ns.max_num_seqs, ns.num_requests))
    step_s, sched_share = scheduler_share(llm, ns.max_num_seqs, 30, ns.seed + 2)
    rows = [["pdserve LLM.generate", f"{pd_s:.1f}", f"{work.num_output_tokens / pd_s:.1f}", "1.00"]]
    if not ns.skip_transformers:
        for label, runner in (("transformers generate, fresh process", run_transformers_fresh_process),
                              ("transformers generate, same process", run_transformers)):
            hf_s, hf_tokens = runner(model_dir, work, ns.max_num_seqs)
            same = sum(a == b for a, b in zip(pd_tokens, hf_tokens, strict=True))
            rows.append([label, f"{hf_s:.1f}", f"{work.num_output_tokens / hf_s:.1f}", f"{hf_s / pd_s:.2f}x slower"])
            print(f"{label}: greedy outputs identical to pdserve for {same}/{len(pd_tokens)} requests")
    print_table(["system", "time s", "output tok/s", "vs pdserve"], rows)
    print(f"scheduler share at {ns.max_num_seqs} running sequences: {100 * sched_share:.2f}% of a "
          f"{1000 * step_s:.1f} ms decode step (target <= 10%)")


if __name__ == "__main__":
    main()
