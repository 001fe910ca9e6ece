"""prompt_logprobs in the engine: every prompt token's logprob (after the first), its rank and the
top alternatives, equal to transformers' on the same weights, with chunked prefill and a prompt
whose prefix is cached (the cache is bypassed: those logits must be computed); then on
/v1/completions, `prompt_logprobs` and `echo` in vLLM's shapes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from conftest import HFReference
from helpers import assert_no_leak, random_prompt, token_prompts
from server_fixtures import ServerHandle, start_server

from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.serving.config import ApiConfig
from pdserve.serving.errors import OpenAIError
from pdserve.serving.limits import check_limits
from pdserve.serving.protocol import CompletionRequest

PROMPT = random_prompt(40, seed=21)  # 3 chunks of 16 with max_num_batched_tokens=16
TOP = 3
MODEL = "tiny"


def test_prompt_logprobs_match_transformers_across_chunks_and_cached_prefix(
        llm_factory: Callable[..., LLM], hf_reference: HFReference) -> None:
    llm = llm_factory("tiny", max_num_batched_tokens=16)
    llm.generate(token_prompts([PROMPT]), SamplingParams(max_tokens=1, temperature=0))  # caches 2 blocks
    out = llm.generate(token_prompts([PROMPT]), SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=TOP))[0]
    assert out.num_cached_tokens == 0  # the cached prefix was not used: its logits are needed
    reference = hf_reference.logprobs("tiny", PROMPT)
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(PROMPT)
    assert out.prompt_logprobs[0] is None
    for position, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert entry is not None and entry.token_id == PROMPT[position]
        row = reference[position - 1]
        assert abs(entry.logprob - float(row[PROMPT[position]])) < 1e-4
        assert entry.rank == int((row > row[PROMPT[position]]).sum()) + 1
        values, ids = row.topk(TOP)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert max(abs(a - b) for (_, a), b in zip(entry.top, values.tolist(), strict=True)) < 1e-4
    plain = llm.generate(token_prompts([PROMPT]), SamplingParams(max_tokens=2, temperature=0))[0]
    assert plain.prompt_logprobs is None and plain.outputs[0].token_ids == out.outputs[0].token_ids
    hits_before = llm.engine.stats().num_prefix_hit_tokens
    two = llm.generate(token_prompts([PROMPT]), SamplingParams(n=2, max_tokens=2, temperature=0, prompt_logprobs=TOP))
    assert two[0].prompt_logprobs == out.prompt_logprobs
    assert llm.engine.stats().num_prefix_hit_tokens > hits_before  # the second sequence took the cached prefix
    assert_no_leak(llm)


def test_a_long_prompts_logits_are_computed_a_chunk_at_a_time(llm_factory: Callable[..., LLM],
                                                              hf_reference: HFReference,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A step holds the logits ([rows, vocab] float32) of at most `prompt_logits_rows` prompt rows
    (what the GPU budget reserves: config.PROMPT_LOGITS_ROWS), not one row per prompt token: the
    40-token prompt in one step, 7 rows a chunk, gives transformers' prompt logprobs and the same
    tokens as in one LM-head call, and no call had more than 7 rows."""
    llm = llm_factory("tiny", max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=TOP)
    whole = llm.generate(token_prompts([PROMPT]), params)[0]
    rows = _lm_head_rows_at_7_a_chunk(llm.engine.runner, monkeypatch)
    chunked = llm.generate(token_prompts([PROMPT]), params)[0]
    assert rows == [1, 7, 7, 7, 7, 7, 4, 1, 1]  # the sampled row alone, the 39 prompt rows by 7, 2 decodes
    assert chunked.outputs[0].token_ids == whole.outputs[0].token_ids
    reference = hf_reference.logprobs("tiny", PROMPT)
    assert chunked.prompt_logprobs is not None and whole.prompt_logprobs is not None
    for position, (entry, one_call) in enumerate(zip(chunked.prompt_logprobs[1:], whole.prompt_logprobs[1:],
                                                     strict=True), start=1):
        assert entry is not None and one_call is not None
        assert (entry.token_id, entry.rank, [t for t, _ in entry.top]) == (
            one_call.token_id, one_call.rank, [t for t, _ in one_call.top])
        assert abs(entry.logprob - float(reference[position - 1][PROMPT[position]])) < 1e-4
    assert_no_leak(llm)


def test_a_failing_chunk_of_prompt_logprobs_skips_no_later_lm_head_call(llm_factory: Callable[..., LLM],
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Under tensor parallelism every rank makes each chunk's LM-head call (an all-gather): should a
    chunk's prompt logprobs fail, the later chunks are still computed, or the other ranks would wait
    forever; the error comes out after them."""
    runner = llm_factory("tiny", max_num_batched_tokens=64).engine.runner
    rows = _lm_head_rows_at_7_a_chunk(runner, monkeypatch)

    def fail(first: int, logits: Any) -> None:
        raise RuntimeError(f"the chunk at {first}")

    with pytest.raises(RuntimeError, match="the chunk at 0"):
        runner._logits(torch.zeros(40, runner.model.cfg.hidden_size), [39], list(range(39)), fail)
    assert rows == [1, 7, 7, 7, 7, 7, 4]


def _lm_head_rows_at_7_a_chunk(runner: Any, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The runner set to 7 prompt rows a chunk; the list it fills with each LM-head call's row count."""
    compute, rows = runner.model.compute_logits, []

    def counted(hidden: torch.Tensor) -> torch.Tensor:
        rows.append(hidden.shape[0])
        return compute(hidden)

    monkeypatch.setattr(runner.model, "compute_logits", counted)
    monkeypatch.setattr(runner, "prompt_logits_rows", 7)
    return rows


@pytest.fixture(scope="module")
def server(model_dirs: dict[str, Path]) -> Iterator[ServerHandle]:
    handle = start_server(model_dirs["tiny"], MODEL, dtype="float32", num_kv_blocks=256)
    yield handle
    handle.stop()


def complete(server: ServerHandle, **body: Any) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/completions", timeout=60,
                      json={"model": MODEL, "max_tokens": 2, "temperature": 0} | body)


@pytest.mark.slow  # a server
def test_completions_prompt_logprobs_in_vllm_shape(server: ServerHandle, hf_reference: HFReference) -> None:
    choice = complete(server, prompt=PROMPT, prompt_logprobs=2).json()["choices"][0]
    reference = hf_reference.logprobs("tiny", PROMPT)
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(PROMPT) and entries[0] is None
    for position, entry in enumerate(entries[1:], start=1):
        row, token = reference[position - 1], PROMPT[position]
        best = row.topk(2).indices.tolist()
        assert set(entry) == {str(t) for t in [token, *best]}
        assert abs(entry[str(token)]["logprob"] - float(row[token])) < 1e-4
        assert entry[str(token)]["rank"] == int((row > row[token]).sum()) + 1
        assert [entry[str(t)]["rank"] for t in best] == [1, 2]
        assert entry[str(token)]["decoded_token"] == server.client.tokenizer.decode([token], skip_special_tokens=False)
    server.wait_until_idle()


@pytest.mark.slow
def test_echo_puts_the_prompt_and_its_logprobs_first(server: ServerHandle, hf_reference: HFReference) -> None:
    text = "The quick brown fox jumps over the lazy dog"
    prompt_ids = server.client.tokenizer.encode(text)
    plain = complete(server, prompt=text, logprobs=1).json()["choices"][0]
    choice = complete(server, prompt=text, logprobs=1, echo=True).json()["choices"][0]
    assert choice["text"] == text + plain["text"] and "prompt_logprobs" not in choice
    logprobs, reference = choice["logprobs"], hf_reference.logprobs("tiny", prompt_ids)
    assert logprobs["tokens"][len(prompt_ids):] == plain["logprobs"]["tokens"]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for position in range(1, len(prompt_ids)):
        assert abs(logprobs["token_logprobs"][position] - float(reference[position - 1, prompt_ids[position]])) < 1e-4
    assert "".join(logprobs["tokens"][:len(prompt_ids)]) == text
    assert logprobs["text_offset"][len(prompt_ids)] == len(text)
    reply = complete(server, prompt=text, prompt_logprobs=1, stream=True)
    assert reply.status_code == 400 and "stream" in reply.json()["error"]["message"]
    server.wait_until_idle()


def test_prompt_logprobs_are_capped_by_max_logprobs() -> None:
    body = CompletionRequest(prompt="hi", prompt_logprobs=3)
    check_limits(body, ApiConfig(max_logprobs=3))
    with pytest.raises(OpenAIError, match="--max-logprobs") as caught:
        check_limits(body, ApiConfig(max_logprobs=2))
    assert caught.value.status == 400
