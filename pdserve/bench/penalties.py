"""The sampler's time per step with penalties, two ways in one run: the penalty tables kept across
steps (engine/penalties.py), and every row penalized from its whole history as the sampler did
before (`penalize_one_row_at_a_time`, kept here as the reference its tests hold the tables to).

Every request of a batch asks for repetition, frequency and presence penalties, at a real
vocabulary's width (151,936), greedy (sampling's own draws would dominate the time). Each shape
(requests x context) starts from prompts of that length; the median of `--steps` sampler calls is
printed, each after one more token was appended to every request (a decode step's sampling, the
model left out).

    python -m pdserve.bench.penalties [--shapes 8x2048,64x2048,64x256] [--steps 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pdserve.bench.common import hardware_line, print_table
from pdserve.engine.request import ModelContext, Request
from pdserve.engine.sampler import Sampler
from pdserve.engine.sampling_params import SamplingParams

_VOCAB = 151_936


def penalize_one_row_at_a_time(logits: torch.Tensor, requests: list[Request], rows: list[int]) -> torch.Tensor:
    """The penalties and `min_tokens` as the sampler applied them before its tables: each row from its
    request's whole history, built on the host and copied to the device, every step."""
    logits = logits.clone()
    for row in rows:
        request = requests[row]
        params = request.params
        if params.repetition_penalty != 1.0:
            seen = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
            seen[torch.tensor(request.all_token_ids, dtype=torch.long, device=logits.device)] = True
            values = logits[row]
            penalized = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
            logits[row] = torch.where(seen, penalized, values)
        if params.presence_penalty or params.frequency_penalty:
            output = torch.tensor(request.output_token_ids, dtype=torch.long, device=logits.device)
            counts = torch.zeros(logits.shape[-1], dtype=logits.dtype, device=logits.device)
            counts.scatter_add_(0, output, torch.ones_like(output, dtype=logits.dtype))
            logits[row] -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
        if request.num_output_tokens < params.min_tokens:
            banned = list(params.stop_token_ids) + ([] if params.ignore_eos else list(request.eos_token_ids))
            logits[row, banned] = float("-inf")
    return logits


class _PerRowSampler(Sampler):
    def _apply_penalties_and_masks(self, logits: torch.Tensor, requests: list[Request],
                                   rows: list[int] | None = None) -> torch.Tensor:
        return penalize_one_row_at_a_time(logits, requests, rows or []) if rows else logits


def measure(sampler: Sampler, num_requests: int, context_len: int, num_steps: int) -> float:
    """Median ms of one `sampler` call over `num_requests` penalized requests at `context_len`."""
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=num_steps + 4, repetition_penalty=1.1, frequency_penalty=0.2,
                            presence_penalty=0.1, temperature=0.0)
    requests = [Request(f"r{i}", torch.randint(0, _VOCAB, (context_len,), generator=gen).tolist(), params,
                        ModelContext((), context_len + num_steps + 8)) for i in range(num_requests)]
    logits = torch.randn(num_requests, _VOCAB, generator=gen)
    times = []
    for _ in range(num_steps + 2):
        start = time.perf_counter()
        tokens = sampler(logits, requests).token_ids
        times.append(time.perf_counter() - start)
        for request, token in zip(requests, tokens, strict=True):
            request.append_token(token)
    return statistics.median(times[2:]) * 1e3  # NOTE: the first calls build what later ones reuse


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="8x2048,64x2048,64x256", help="requests x context, comma-separated")
    parser.add_argument("--steps", type=int, default=10, help="sampler calls timed per shape and way")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    print(hardware_line())
    print(f"workload: repetition 1.1, frequency 0.2, presence 0.1 penalties on every request, vocabulary {_VOCAB}, "
          f"greedy; median of {args.steps} sampler calls, a token appended to each request between calls")
    rows = []
    for shape in args.shapes.split(","):
        num_requests, context_len = (int(n) for n in shape.split("x"))
        per_row = measure(_PerRowSampler(0, torch.device("cpu")), num_requests, context_len, args.steps)
        tables = measure(Sampler(0, torch.device("cpu")), num_requests, context_len, args.steps)
        rows.append([shape, f"{per_row:.2f}", f"{tables:.2f}", f"{tables / per_row:.2f}"])
    print_table(["requests x context", "per row ms / step", "tables ms / step", "tables / per row"], rows)


if __name__ == "__main__":
    main()
