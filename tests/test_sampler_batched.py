"""The sampler's optional paths are batched (one copy to the host per tensor, not a sync per row
or per prompt token); these tests hold their values to a per-row reference."""

from __future__ import annotations

import torch
from helpers import make_request

from pdserve.engine.sampler import Sampler, prompt_logprobs

VOCAB = 97


def test_pick_logprobs_equals_per_row_topk() -> None:
    torch.manual_seed(0)
    logprobs = torch.log_softmax(torch.randn(5, VOCAB), dim=-1)
    requests = [make_request(f"r{i}", 4, logprobs=k) for i, k in enumerate([None, 0, 3, None, 7])]
    tokens = [1, 2, 3, 4, 5]
    picked = Sampler._pick_logprobs(logprobs, tokens, requests)
    for row, (request, token, got) in enumerate(zip(requests, tokens, picked, strict=True)):
        k = request.params.logprobs
        if k is None:
            assert got is None
            continue
        assert got is not None and got.token_id == token
        assert got.logprob == float(logprobs[row, token])
        values, ids = logprobs[row].topk(k) if k else (torch.empty(0), torch.empty(0))
        assert got.top == tuple(zip(ids.tolist(), values.tolist(), strict=True))


def test_prompt_logprobs_equal_per_token_values() -> None:
    torch.manual_seed(1)
    a = make_request("a", 6, prompt_logprobs=2)
    b = make_request("b", 4, prompt_logprobs=0)
    targets = [(a, 1), (b, 1)]
    logits = torch.randn(2, VOCAB)
    # prompt ids inside this test's vocabulary
    a.prompt_token_ids[1] = 5
    b.prompt_token_ids[1] = 90
    prompt_logprobs(logits, targets)
    reference = torch.log_softmax(logits, dim=-1)
    for row, (request, position) in enumerate(targets):
        assert request.prompt_logprobs is not None
        got = request.prompt_logprobs[position]
        assert got is not None
        token = request.prompt_token_ids[position]
        assert got.token_id == token and got.logprob == float(reference[row, token])
        assert got.rank == int((reference[row] > reference[row, token]).sum()) + 1
        k = request.params.prompt_logprobs or 0
        values, ids = reference[row].topk(k) if k else (torch.empty(0), torch.empty(0))
        assert got.top == tuple(zip(ids.tolist(), values.tolist(), strict=True))


def test_penalties_touch_only_seen_tokens() -> None:
    logits = torch.randn(1, VOCAB)
    request = make_request("p", [3, 3, 8], max_tokens=8, repetition_penalty=2.0, frequency_penalty=0.5)
    request.append_token(8)
    request.append_token(5)
    out = Sampler._apply_penalties_and_masks(logits, [request])
    seen = set(request.all_token_ids)
    counts = torch.zeros(VOCAB)
    for t in request.output_token_ids:
        counts[t] += 1
    for t in range(VOCAB):
        value = float(logits[0, t])
        if t in seen:
            value = value / 2.0 if value > 0 else value * 2.0
        value -= 0.5 * float(counts[t])
        assert abs(float(out[0, t]) - value) < 1e-6, t
