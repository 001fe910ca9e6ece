"""The sampler's optional paths are batched (one copy to the host per tensor, not a sync per row
or per prompt token); these tests hold their values to a per-row reference."""

from __future__ import annotations

import pytest
import torch
from helpers import make_request

from pdserve.bench.penalties import penalize_one_row_at_a_time
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
    out = Sampler(0, torch.device("cpu"))._apply_penalties_and_masks(logits, [request])
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


@pytest.mark.parametrize("batched", [False, True], ids=["row by row (CPU)", "every row at once (GPU)"])
def test_batched_penalty_tables_equal_the_per_row_history_every_step(batched: bool) -> None:
    """Requests join, leave, come back as new objects (a preemption's re-admission keeps the id), each
    step appends a token to each: every step's penalized logits equal the per-row reference exactly,
    while the tables only ever read the tokens added since the last step."""
    gen = torch.Generator().manual_seed(3)
    kinds = [{"repetition_penalty": 1.3}, {"frequency_penalty": 0.7}, {"presence_penalty": -0.4},
             {"repetition_penalty": 0.8, "frequency_penalty": 0.2, "presence_penalty": 0.3},
             {"min_tokens": 3, "stop_token_ids": [5, 9]}, {}]
    pool = {f"r{i}": make_request(f"r{i}", [int(t) for t in torch.randint(0, VOCAB, (3 + i,), generator=gen)],
                                  max_tokens=64, **kinds[i % len(kinds)]) for i in range(9)}
    sampler = Sampler(0, torch.device("cpu"))
    sampler.penalties.batched = batched
    batches = [["r0", "r1", "r2", "r3"], ["r0", "r1", "r2", "r3", "r4", "r5"], ["r1", "r3", "r5", "r6"],
               ["r0", "r3", "r7", "r8", "r6"], ["r8"], ["r5"], ["r0", "r1", "r2", "r3", "r4", "r5", "r6", "r7", "r8"]]
    for step, names in enumerate(batches * 2):
        if step == 9:  # r3 comes back as a new object with the same id and tokens
            old = pool["r3"]
            pool["r3"] = make_request("r3", old.prompt_token_ids, max_tokens=64, repetition_penalty=0.8,
                                      frequency_penalty=0.2, presence_penalty=0.3)
            for token in old.output_token_ids:
                pool["r3"].append_token(token)
        requests = [pool[name] for name in names]
        logits = torch.randn(len(requests), VOCAB, generator=gen)
        rows = [i for i, r in enumerate(requests) if not r.plain_greedy and (
            r.params.needs_penalties or r.num_output_tokens < r.params.min_tokens)]
        got = sampler._apply_penalties_and_masks(logits, requests, rows)
        assert torch.equal(got, penalize_one_row_at_a_time(logits, requests, rows)), step
        assert len(sampler.penalties) == sum(r.params.needs_penalties for r in requests)
        for request in requests:
            request.append_token(int(torch.randint(0, VOCAB, (1,), generator=gen)))
    assert sampler.penalties.seen.shape[0] <= 16  # rows given back are reused: the tables stay small


def test_a_steady_step_copies_only_its_new_tokens() -> None:
    """After a request's first step, its rows take the tokens added since (one each step here), not
    its history: the index tensors a step builds stay as long as the batch, whatever the context."""
    sampler = Sampler(0, torch.device("cpu"))
    requests = [make_request(f"s{i}", 500, max_tokens=64, repetition_penalty=1.2, frequency_penalty=0.1)
                for i in range(3)]
    for request in requests:
        request.prompt_token_ids[:] = request.all_token_ids[:] = [t % VOCAB for t in request.all_token_ids]
    lengths: list[list[int]] = []
    built = sampler.penalties._tensor

    def recording(values: list[int]) -> torch.Tensor:
        lengths[-1].append(len(values))
        return built(values)

    sampler.penalties._tensor = recording  # type: ignore[method-assign]
    for _ in range(4):
        lengths.append([])
        sampler._apply_penalties_and_masks(torch.zeros(3, VOCAB), requests, [0, 1, 2])
        for request in requests:
            request.append_token(7)
    assert max(lengths[0]) >= 3 * 500  # the first step marks each prompt once
    assert all(max(step) <= 3 for step in lengths[1:]), lengths


def test_the_penalties_bench_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m pdserve.bench.penalties` at a tiny shape: both ways timed, their ratio printed."""
    from pdserve.bench import penalties

    penalties.main(["--shapes", "2x16", "--steps", "2"])
    row = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 2x16")]
    assert len(row) == 1 and float(row[0].split("|")[4]) > 0, row


def test_a_finished_request_is_not_kept_alive_by_its_penalty_row() -> None:
    """A row outlives its request until the next step that samples with penalties: it holds the
    request weakly (not its tokens, matcher, generator); `clear` frees the tables' memory too."""
    import gc
    import weakref

    sampler = Sampler(0, torch.device("cpu"))
    request = make_request("gone", [1, 2, 3], max_tokens=8, repetition_penalty=1.5)
    sampler._apply_penalties_and_masks(torch.zeros(1, VOCAB), [request], [0])
    held = weakref.ref(request)
    del request
    gc.collect()
    assert held() is None
    storage = sampler.penalties.seen.untyped_storage()
    sampler.penalties.clear()
    assert sampler.penalties.seen.untyped_storage().nbytes() == 0 and storage.nbytes() > 0
    assert sampler.penalties.seen.untyped_storage().data_ptr() != storage.data_ptr()


def test_argmax_alone_is_what_the_sampler_gives_plain_greedy_rows() -> None:
    """`Sampler.argmax` (a steady step whose rows are all plain greedy): the tokens `__call__` gives
    those rows (ties and all), no logprobs, and it leaves the sampler as `__call__` does: penalty
    tables of requests no longer sampled cleared, no grammar masks pending."""
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(0))
    logits[2, 5] = logits[2, 40] = logits[2].max() + 1  # a tie: the first best
    requests = [make_request(f"g{i}", [1, 2], max_tokens=8, temperature=0.0) for i in range(6)]
    assert all(r.plain_greedy for r in requests)
    general, alone = Sampler(0, torch.device("cpu")), Sampler(0, torch.device("cpu"))
    for sampler in (general, alone):  # a penalized request sampled last step, gone since
        penalized = make_request("p", [1, 2, 3], max_tokens=8, repetition_penalty=1.5)
        sampler._apply_penalties_and_masks(torch.zeros(1, VOCAB), [penalized], [0])
        assert len(sampler.penalties)
    want = general(logits, requests)
    got = alone.argmax(logits)
    assert got.token_ids == want.token_ids and got.token_ids[2] == 5
    assert got.logprobs == want.logprobs == [None] * 6
    assert len(alone.penalties) == len(general.penalties) == 0 and alone._pending is None
