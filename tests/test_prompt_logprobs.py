"""prompt_logprobs in the engine: every prompt token's logprob (after the first), its rank and the
top alternatives, equal to transformers' on the same weights, with chunked prefill and a prompt
whose prefix is cached (the cache is bypassed: those logits must be computed)."""

from __future__ import annotations

from collections.abc import Callable

from conftest import HFReference
from helpers import assert_no_leak, random_prompt, token_prompts

from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams

PROMPT = random_prompt(40, seed=21)  # 3 chunks of 16 with max_num_batched_tokens=16
TOP = 3


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
    assert_no_leak(llm)
