"""Sampling: seeded requests are reproducible whatever else is in the batch, and every sampling
parameter does what it says (lengths, stops, logprobs, penalties, filters)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from conftest import HFReference
from helpers import assert_no_leak, generate_token_ids, greedy, make_request, random_prompt, token_prompts

from pdserve import LLM, SamplingParams
from pdserve.engine.sampler import Sampler
from pdserve.tokenizer import Tokenizer

MODEL = "tiny"
MAX_TOKENS = 16
PROMPT = random_prompt(24, seed=2)
SEEDED = SamplingParams(seed=1234, temperature=0.8, top_p=0.9, top_k=50, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture
def llm(llm_factory: Callable[..., LLM]) -> LLM:
    return llm_factory(MODEL)


@pytest.fixture
def chunked_llm(llm_factory: Callable[..., LLM]) -> LLM:
    return llm_factory(MODEL, max_num_batched_tokens=64)


@pytest.fixture
def greedy_tokens(llm: LLM, hf_reference: HFReference) -> list[int]:
    tokens = generate_token_ids(llm, [PROMPT], greedy(MAX_TOKENS))[0]
    assert tokens == hf_reference.greedy(MODEL, PROMPT, MAX_TOKENS)
    return tokens


def first_new_index(tokens: list[int], start: int) -> int:
    """Index of the first token at or after `start` that does not occur before it."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


@pytest.mark.slow
def test_seeded_sampling_is_batch_invariant(llm: LLM, chunked_llm: LLM) -> None:
    alone = generate_token_ids(llm, [PROMPT], SEEDED)[0]
    assert len(alone) == MAX_TOKENS and alone != generate_token_ids(llm, [PROMPT], greedy(MAX_TOKENS))[0]

    others = [random_prompt(length, seed=100 + length) for length in (1, 300, 7, 64, 129, 33)]
    other_params = [
        SamplingParams(seed=7, temperature=1.0, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=1.2, top_k=10, max_tokens=MAX_TOKENS + 3, ignore_eos=True),
        greedy(2),
        SamplingParams(seed=1234, temperature=0.5, max_tokens=9, ignore_eos=True),  # same seed, other prompt
        SamplingParams(temperature=0.7, top_p=0.5, max_tokens=MAX_TOKENS, ignore_eos=True, n=2),
        SamplingParams(seed=99, temperature=0.9, min_p=0.1, max_tokens=11, ignore_eos=True),
    ]
    prompts = others[:3] + [PROMPT] + others[3:]
    params = other_params[:3] + [SEEDED] + other_params[3:]
    for engine in (llm, chunked_llm):  # chunked: the prompt is computed in other pieces and other steps
        outputs = engine.generate(token_prompts(prompts), params)
        assert outputs[3].outputs[0].token_ids == alone
        assert_no_leak(engine)


def test_different_seeds_give_different_tokens(llm: LLM) -> None:
    outputs = generate_token_ids(llm, [PROMPT] * 3, [SEEDED, replace(SEEDED, seed=1235),
                                                     replace(SEEDED, seed=None)])
    assert outputs[0] != outputs[1] and outputs[0] != outputs[2] and outputs[1] != outputs[2]
    assert generate_token_ids(llm, [PROMPT], SEEDED) == outputs[:1]
    assert_no_leak(llm)


def test_n_with_seed_gives_distinct_reproducible_completions(llm: LLM) -> None:
    params = replace(SEEDED, n=2)
    first = llm.generate(token_prompts([PROMPT]), params)[0]
    second = llm.generate(token_prompts([PROMPT]), params)[0]
    completions = [c.token_ids for c in first.outputs]
    assert [c.index for c in first.outputs] == [0, 1]
    assert len(completions) == 2 and completions[0] != completions[1]
    assert [c.token_ids for c in second.outputs] == completions
    assert all(c.finish_reason == "length" and len(c.token_ids) == MAX_TOKENS for c in first.outputs)
    assert_no_leak(llm)


def test_max_tokens(llm: LLM, greedy_tokens: list[int]) -> None:
    out = llm.generate(token_prompts([PROMPT]), greedy(5))[0].outputs[0]
    assert out.token_ids == greedy_tokens[:5]
    assert (out.finish_reason, out.stop_reason) == ("length", None)
    assert_no_leak(llm)


def test_max_model_len_caps_the_output(llm_factory: Callable[..., LLM], greedy_tokens: list[int]) -> None:
    llm = llm_factory(MODEL, max_model_len=len(PROMPT) + MAX_TOKENS)
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    out = llm.generate(token_prompts([PROMPT]), params)[0].outputs[0]
    assert out.token_ids == greedy_tokens and out.finish_reason == "length"
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(token_prompts([PROMPT + greedy_tokens]), params)
    assert_no_leak(llm)


def test_stop_token_ids(llm: LLM, greedy_tokens: list[int]) -> None:
    stop_at = first_new_index(greedy_tokens, 3)
    stop_token = greedy_tokens[stop_at]
    out = llm.generate(token_prompts([PROMPT]), greedy(MAX_TOKENS, stop_token_ids=[stop_token]))[0].outputs[0]
    assert out.token_ids == greedy_tokens[:stop_at + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_token)
    assert_no_leak(llm)


def test_min_tokens_bans_stop_tokens_before_it(llm: LLM, greedy_tokens: list[int]) -> None:
    stop_at = first_new_index(greedy_tokens, 3)
    stop_token = greedy_tokens[stop_at]
    min_tokens = stop_at + 3
    params = greedy(MAX_TOKENS, stop_token_ids=[stop_token], min_tokens=min_tokens)
    out = llm.generate(token_prompts([PROMPT]), params)[0].outputs[0]
    assert out.token_ids[:stop_at] == greedy_tokens[:stop_at]
    assert out.token_ids[stop_at] != stop_token  # banned, so the runner-up was chosen
    assert len(out.token_ids) >= min_tokens and stop_token not in out.token_ids[:min_tokens]
    assert_no_leak(llm)


def test_eos_stops_unless_ignored_and_min_tokens_bans_it(llm: LLM, greedy_tokens: list[int],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # The random model never picks Qwen3's real EOS; declare one of its greedy tokens the EOS instead.
    stop_at = first_new_index(greedy_tokens, 2)
    eos = greedy_tokens[stop_at]
    monkeypatch.setattr(llm.engine.tokenizer, "eos_token_ids", (eos,))

    stopped, ignored, delayed = llm.generate(token_prompts([PROMPT] * 3), [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
        greedy(MAX_TOKENS),
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=stop_at + 2),
    ])
    assert stopped.outputs[0].token_ids == greedy_tokens[:stop_at + 1]
    assert (stopped.outputs[0].finish_reason, stopped.outputs[0].stop_reason) == ("stop", None)
    assert ignored.outputs[0].token_ids == greedy_tokens
    assert ignored.outputs[0].finish_reason == "length"
    assert delayed.outputs[0].token_ids[:stop_at] == greedy_tokens[:stop_at]
    assert eos not in delayed.outputs[0].token_ids[:stop_at + 2]
    assert_no_leak(llm)


def _clean_pieces(tokenizer: Tokenizer, tokens: list[int]) -> list[str]:
    """Per-token text, or "" where a token is special or not whole ASCII (so text offsets are exact)."""
    pieces = [tokenizer.decode([t]) for t in tokens]
    return [p if p.isascii() and p.strip() else "" for p in pieces]


def stop_across_tokens(tokenizer: Tokenizer, tokens: list[int]) -> tuple[int, str]:
    """(i, stop): the last two characters of token i and the first two of token i + 1, a stop
    string that only token i + 1 completes."""
    text = tokenizer.decode(tokens)
    pieces = _clean_pieces(tokenizer, tokens)
    index = next(i for i in range(1, len(tokens) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2 and
                 text.find(pieces[i][-2:] + pieces[i + 1][:2]) == len(tokenizer.decode(tokens[:i + 1])) - 2)
    return index, pieces[index][-2:] + pieces[index + 1][:2]


def single_token_stop(tokenizer: Tokenizer, tokens: list[int]) -> tuple[int, str]:
    """(i, text of token i) such that the text first occurs exactly where token i starts."""
    text = tokenizer.decode(tokens)
    pieces = _clean_pieces(tokenizer, tokens)
    index = next(i for i in range(2, len(tokens)) if pieces[i] and
                 text.find(pieces[i]) == len(tokenizer.decode(tokens[:i])))
    return index, pieces[index]


def test_stop_string_truncates_text(llm: LLM, greedy_tokens: list[int]) -> None:
    text = llm.get_tokenizer().decode(greedy_tokens)
    index, stop = single_token_stop(llm.get_tokenizer(), greedy_tokens)
    at = text.find(stop)
    for include, want_text in ((False, text[:at]), (True, text[:at + len(stop)])):
        params = greedy(MAX_TOKENS, stop=[stop, "never appears \x00"], include_stop_str_in_output=include)
        out = llm.generate(token_prompts([PROMPT]), params)[0].outputs[0]
        assert out.token_ids == greedy_tokens[:index + 1]
        assert out.text == want_text
        assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert_no_leak(llm)


def test_min_tokens_delays_stop_strings(llm: LLM, greedy_tokens: list[int]) -> None:
    """Regression: stop strings ended the output before `min_tokens` (vLLM checks none before it)."""
    index, stop = single_token_stop(llm.get_tokenizer(), greedy_tokens)
    min_tokens = index + 3
    out = llm.generate(token_prompts([PROMPT]), greedy(MAX_TOKENS, stop=stop, min_tokens=min_tokens))[0].outputs[0]
    assert len(out.token_ids) >= min_tokens
    assert out.token_ids == greedy_tokens[:len(out.token_ids)]  # stop strings never change sampling
    assert_no_leak(llm)


def test_stop_string_across_tokens(llm: LLM, greedy_tokens: list[int]) -> None:
    tokenizer = llm.get_tokenizer()
    text = tokenizer.decode(greedy_tokens)
    index, stop = stop_across_tokens(tokenizer, greedy_tokens)
    out = llm.generate(token_prompts([PROMPT]), greedy(MAX_TOKENS, stop=stop))[0].outputs[0]
    assert out.token_ids == greedy_tokens[:index + 2]
    assert out.text == text[:text.find(stop)]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert_no_leak(llm)


def test_logprobs_match_transformers(llm: LLM, greedy_tokens: list[int], hf_reference: HFReference) -> None:
    num_top = 5
    out = llm.generate(token_prompts([PROMPT]), greedy(MAX_TOKENS, logprobs=num_top))[0].outputs[0]
    assert out.token_ids == greedy_tokens
    assert out.logprobs is not None and len(out.logprobs) == MAX_TOKENS
    reference = hf_reference.logprobs(MODEL, PROMPT + greedy_tokens[:-1])[len(PROMPT) - 1:]
    for position, (token, entry) in enumerate(zip(greedy_tokens, out.logprobs, strict=True)):
        assert entry.token_id == token
        assert entry.logprob <= 0.0
        assert entry.logprob == pytest.approx(reference[position, token].item(), abs=1e-4)
        assert len(entry.top) == num_top
        top_values, top_ids = reference[position].topk(num_top)
        assert [t for t, _ in entry.top] == top_ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(top_values.tolist(), abs=1e-4)
        assert entry.top[0] == (token, pytest.approx(entry.logprob))  # greedy: the sampled token is the best
    assert_no_leak(llm)


def test_logprobs_zero_and_sampled(llm: LLM) -> None:
    only_sampled, sampled = llm.generate(token_prompts([PROMPT] * 2), [
        greedy(4, logprobs=0), replace(SEEDED, logprobs=3)])
    assert only_sampled.outputs[0].logprobs is not None
    assert all(entry.top == () and entry.logprob <= 0.0 for entry in only_sampled.outputs[0].logprobs)
    entries = sampled.outputs[0].logprobs
    assert entries is not None and len(entries) == MAX_TOKENS
    for token, entry in zip(sampled.outputs[0].token_ids, entries, strict=True):
        assert entry.token_id == token and entry.logprob <= 0.0 and len(entry.top) == 3
        assert entry.top[0][1] >= entry.logprob  # the sampled token is never more likely than the best
    assert_no_leak(llm)


def test_repetition_penalty_forbids_repeats(llm: LLM, greedy_tokens: list[int]) -> None:
    assert len(set(greedy_tokens)) < len(greedy_tokens), "the baseline should repeat itself"
    out = generate_token_ids(llm, [PROMPT], greedy(MAX_TOKENS, repetition_penalty=1e4))[0]
    assert len(set(out)) == len(out)
    assert not set(out) & set(PROMPT)  # the prompt's tokens are penalised too
    assert_no_leak(llm)


@pytest.mark.parametrize("penalty", ["presence_penalty", "frequency_penalty"])
def test_presence_and_frequency_penalties(llm: LLM, greedy_tokens: list[int], penalty: str) -> None:
    discouraged, encouraged = generate_token_ids(llm, [PROMPT] * 2, [
        greedy(MAX_TOKENS, **{penalty: 2.0}), greedy(MAX_TOKENS, **{penalty: -2.0})])
    assert len(set(discouraged)) == MAX_TOKENS > len(set(greedy_tokens))
    # A negative penalty makes the first token win forever (this model's logits span far less than 2).
    assert encouraged == [greedy_tokens[0]] * MAX_TOKENS
    assert_no_leak(llm)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=1, max_tokens=MAX_TOKENS, ignore_eos=True),
    SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=MAX_TOKENS, ignore_eos=True),
    SamplingParams(temperature=1.0, min_p=1.0, max_tokens=MAX_TOKENS, ignore_eos=True, seed=3),
], ids=["top_k=1", "top_p=tiny", "min_p=1"])
def test_filters_that_keep_one_token_equal_greedy(llm: LLM, greedy_tokens: list[int], params: SamplingParams) -> None:
    assert generate_token_ids(llm, [PROMPT], params)[0] == greedy_tokens
    assert_no_leak(llm)


def test_unseeded_sampling_varies(llm: LLM) -> None:
    params = replace(SEEDED, seed=None)
    first, second = generate_token_ids(llm, [PROMPT] * 2, params)
    assert first != second
    assert_no_leak(llm)


A, B, SEEN_IN_PROMPT = 1, 2, 3


def penalised_choice(logit_a: float, logit_b: float, **penalty: float) -> int:
    """Greedy choice between A (generated twice before) and B (never seen)."""
    logits = torch.full((1, 8), -10.0)
    logits[0, A], logits[0, B] = logit_a, logit_b
    request = make_request("r", [SEEN_IN_PROMPT], max_tokens=8, temperature=0.0, **penalty)
    request.append_token(A)
    request.append_token(A)
    return Sampler(0, torch.device("cpu"))(logits, [request]).token_ids[0]


@pytest.mark.parametrize(("logit_a", "logit_b", "penalty", "chosen"), [
    (3.0, 2.2, {"frequency_penalty": 0.5}, B),  # 3 - 2 x 0.5 = 2.0: proportional to the count
    (3.0, 2.2, {"frequency_penalty": 0.3}, A),  # 3 - 2 x 0.3 = 2.4
    (3.0, 2.2, {"presence_penalty": 0.5}, A),  # 3 - 0.5 = 2.5: once, whatever the count
    (3.0, 2.2, {"presence_penalty": 0.9}, B),  # 2.1
    (3.0, 2.2, {"repetition_penalty": 1.5}, B),  # positive logits are divided: 2.0
    (3.0, 2.2, {"repetition_penalty": 1.3}, A),  # 2.31
    (-1.0, -1.4, {"repetition_penalty": 1.5}, B),  # negative logits are multiplied: -1.5
    (3.0, 2.2, {"frequency_penalty": -0.5}, A),
    (2.2, 3.0, {"presence_penalty": -0.9}, A),  # a negative penalty favours what was seen
], ids=lambda v: str(v) if not isinstance(v, dict) else ",".join(f"{k}={x}" for k, x in v.items()))
def test_penalty_arithmetic(logit_a: float, logit_b: float, penalty: dict[str, float], chosen: int) -> None:
    assert penalised_choice(logit_a, logit_b, **penalty) == chosen


def test_repetition_penalty_covers_the_prompt() -> None:
    logits = torch.full((1, 8), -10.0)
    logits[0, SEEN_IN_PROMPT], logits[0, B] = 3.0, 2.2
    request = make_request("r", [SEEN_IN_PROMPT], max_tokens=8, temperature=0.0, repetition_penalty=1.5)
    assert Sampler(0, torch.device("cpu"))(logits, [request]).token_ids == [B]


PROBS = [0.5, 0.3, 0.2, 0.0]


@pytest.mark.parametrize(("params", "expected_probs"), [
    ({}, PROBS),
    ({"temperature": 0.5}, [p * p / 0.38 for p in PROBS]),
    ({"top_k": 2}, [0.625, 0.375, 0.0, 0.0]),
    ({"top_p": 0.6}, [0.625, 0.375, 0.0, 0.0]),  # the smallest set reaching 0.6: {0, 1}
    ({"top_p": 0.5}, [1.0, 0.0, 0.0, 0.0]),
    ({"min_p": 0.5}, [0.625, 0.375, 0.0, 0.0]),  # drops p < 0.5 x 0.5
], ids=lambda v: ",".join(f"{k}={x}" for k, x in v.items()) if isinstance(v, dict) else "")
def test_sampled_frequencies(params: dict[str, float], expected_probs: list[float]) -> None:
    num_rows = 4000
    logits = torch.tensor(PROBS).log().expand(num_rows, -1).contiguous()
    requests = [make_request(str(i), [0], **params) for i in range(num_rows)]
    tokens = Sampler(0, torch.device("cpu"))(logits, requests).token_ids
    frequencies = [tokens.count(t) / num_rows for t in range(len(PROBS))]
    assert frequencies == pytest.approx(expected_probs, abs=0.03)


def test_seeded_rows_ignore_their_neighbours() -> None:
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0))

    def sample(rows: list[int], seeds: list[int | None]) -> list[int]:
        requests = [make_request(str(i), [0], temperature=1.0, seed=seed) for i, seed in enumerate(seeds)]
        return Sampler(123, torch.device("cpu"))(logits[rows], requests).token_ids

    alone = sample([1], [42])[0]
    assert sample([0, 1, 2], [None, 42, 7])[1] == alone
    assert sample([2, 1], [None, 42])[1] == alone


def test_a_resumed_request_finds_a_stop_string_across_the_resume(llm: LLM, greedy_tokens: list[int]) -> None:
    """The router resumes a request on another decode worker after the tokens its client got: the
    text held back as a possible stop string travels with it (SamplingParams.text_prefix), so a
    stop string that starts before the resume and ends after it still ends the output there."""
    from pdserve.disagg.router.core import continuation

    tokenizer = llm.get_tokenizer()
    text = tokenizer.decode(greedy_tokens)
    index, stop = stop_across_tokens(tokenizer, greedy_tokens)
    sent = greedy_tokens[:index + 1]  # the lost worker had made these, then died
    made = tokenizer.decode(sent)
    sent_text = made[:len(made) - (len(stop) - 1)]  # what its client got: the rest was held back
    params = continuation(tokenizer, greedy(MAX_TOKENS, stop=stop), sent, sent_text)
    assert params.text_prefix == made[len(sent_text):] and params.max_tokens == MAX_TOKENS - len(sent)
    out = llm.generate(token_prompts([PROMPT + sent]), params)[0].outputs[0]
    assert sent_text + out.text == text[:text.find(stop)]
    assert out.token_ids == greedy_tokens[index + 1:index + 2] and out.stop_reason == stop
    assert_no_leak(llm)


def test_a_resumed_seeded_request_samples_what_the_lost_worker_would_have(llm: LLM) -> None:
    """A seeded request resumed after k tokens (its prompt now the prompt + those k) continues the
    same random stream: its generator skips the k draws those tokens made (SamplingParams.
    seed_draws_done, set by the router's `continuation`), so nothing in the output repeats the start."""
    from pdserve.disagg.router.core import continuation

    whole = generate_token_ids(llm, [PROMPT], SEEDED)[0]
    tokenizer = llm.get_tokenizer()
    for k in (1, 5):
        sent = whole[:k]
        params = continuation(tokenizer, SEEDED, sent, tokenizer.decode(sent))
        assert params.seed_draws_done == k and params.max_tokens == MAX_TOKENS - k
        assert generate_token_ids(llm, [PROMPT + sent], params)[0] == whole[k:]
        # resumed twice: the draws add up
        again = continuation(tokenizer, params, whole[k:k + 2], tokenizer.decode(whole[k:k + 2]))
        assert again.seed_draws_done == k + 2
        assert generate_token_ids(llm, [PROMPT + whole[:k + 2]], again)[0] == whole[k + 2:]
    assert_no_leak(llm)
