"""Greedy outputs are token-identical to Hugging Face transformers, whatever the engine does on the way:
mixed batches, chunked prefill, prefix-cache hits, preemption (recompute and swap), block sizes."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from conftest import MODEL_NAMES, HFReference
from helpers import assert_no_leak, generate_token_ids, greedy, random_prompt, token_prompts

from pdserve import LLM

MAX_TOKENS = 16
# Mixed lengths: a single token, around one and two block boundaries, and a long prompt that takes
# more than ten chunks at a 64-token budget. Submitted out of order so admission order is mixed too.
PROMPT_LENS = (129, 1, 720, 16, 2, 300, 17, 33, 15, 64)
PROMPTS = [random_prompt(length, seed=1000 + length) for length in PROMPT_LENS]

# Small enough that the whole batch does not fit (it needs ~100 blocks of 16), large enough that the
# longest request alone does (720 + 16 tokens = 46 blocks).
SMALL_POOL_BLOCKS = 50

CONFIGS: dict[str, dict[str, object]] = {
    "default": {},
    "block32": {"block_size": 32},
    "chunked": {"max_num_batched_tokens": 64},
    "preempt-recompute": {"num_kv_blocks": SMALL_POOL_BLOCKS, "preemption_mode": "recompute",
                          "enable_prefix_caching": False},
    "preempt-recompute-cached": {"num_kv_blocks": SMALL_POOL_BLOCKS, "preemption_mode": "recompute",
                                 "max_num_batched_tokens": 128},
    "preempt-swap": {"num_kv_blocks": SMALL_POOL_BLOCKS, "preemption_mode": "swap", "swap_space": 0.01},
}


def expected(hf_reference: HFReference, model: str, prompts: list[list[int]]) -> list[list[int]]:
    return [hf_reference.greedy(model, prompt, MAX_TOKENS) for prompt in prompts]


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("model", MODEL_NAMES)
def test_greedy_matches_transformers(model: str, config: str, llm_factory: Callable[..., LLM],
                                     hf_reference: HFReference, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = llm_factory(model, **CONFIGS[config])
    scheduler = llm.engine.scheduler
    preemptions_before = scheduler.num_preemptions
    swap_outs: list[int] = []
    schedule = scheduler.schedule

    def spy_schedule():  # type: ignore[no-untyped-def]
        out = schedule()
        swap_outs.append(len(out.blocks_to_swap_out))
        assert out.num_batched_tokens <= scheduler.config.max_num_batched_tokens
        return out

    monkeypatch.setattr(scheduler, "schedule", spy_schedule)

    outputs = generate_token_ids(llm, PROMPTS, greedy(MAX_TOKENS))

    for length, got, want in zip(PROMPT_LENS, outputs, expected(hf_reference, model, PROMPTS), strict=True):
        assert got == want, f"prompt of {length} tokens"
    if config.startswith("preempt"):
        assert scheduler.num_preemptions > preemptions_before, "the small pool should force preemptions"
    if config == "preempt-swap":
        assert sum(swap_outs) > 0, "preemptions should have swapped blocks out"
    if config == "chunked":
        assert len(swap_outs) >= max(PROMPT_LENS) // 64, "the long prompt should take many chunks"
    assert_no_leak(llm)


def prefix_sharing_prompts(first_round_outputs: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Second-round prompts that share long prefixes with the first round, and the number of prompt
    tokens each should find in the prefix cache (block size 16)."""
    by_len = {length: prompt for length, prompt in zip(PROMPT_LENS, PROMPTS, strict=True)}
    out720 = first_round_outputs[PROMPT_LENS.index(720)]
    prompts = [
        by_len[720][:700] + random_prompt(30, seed=1),  # shares 43 full blocks
        by_len[129][:128] + random_prompt(3, seed=2),  # shares exactly 8 blocks, then diverges
        list(by_len[300]),  # identical: 18 blocks hit, the last 12 tokens are recomputed
        # A follow-up turn: the prompt plus the generated tokens, which were cached too. The last
        # sampled token was never computed, so 720 + 15 = 735 tokens = 45 full blocks are cached.
        by_len[720] + out720 + random_prompt(4, seed=3),
        random_prompt(40, seed=4),  # shares nothing
    ]
    hit_tokens = [43 * 16, 8 * 16, 18 * 16, 45 * 16, 0]
    return prompts, hit_tokens


@pytest.mark.parametrize("config", ["default", "chunked"])
@pytest.mark.parametrize("model", MODEL_NAMES)
def test_prefix_cache_hits_keep_outputs_identical(model: str, config: str, llm_factory: Callable[..., LLM],
                                                  hf_reference: HFReference) -> None:
    llm = llm_factory(model, **CONFIGS[config])
    first = generate_token_ids(llm, PROMPTS, greedy(MAX_TOKENS))
    assert first == expected(hf_reference, model, PROMPTS)

    prompts, hit_tokens = prefix_sharing_prompts(first)
    hits_before = llm.engine.stats().num_prefix_hit_tokens
    outputs = llm.generate(token_prompts(prompts), greedy(MAX_TOKENS))

    assert [o.num_cached_tokens for o in outputs] == hit_tokens
    assert llm.engine.stats().num_prefix_hit_tokens - hits_before == sum(hit_tokens)
    assert [o.outputs[0].token_ids for o in outputs] == expected(hf_reference, model, prompts)
    assert_no_leak(llm)


def test_prefix_hit_of_a_whole_prompt_still_computes_its_last_token(llm_factory: Callable[..., LLM],
                                                                    hf_reference: HFReference) -> None:
    """A prompt of exactly two blocks seen before: one block is reused, the second is recomputed
    because the step that computes the last prompt token is the one that samples."""
    llm = llm_factory("tiny")
    prompt = random_prompt(32, seed=5)
    first = generate_token_ids(llm, [prompt], greedy(MAX_TOKENS))
    again = llm.generate(token_prompts([prompt]), greedy(MAX_TOKENS))[0]
    assert again.num_cached_tokens == 16
    assert first == [again.outputs[0].token_ids] == [hf_reference.greedy("tiny", prompt, MAX_TOKENS)]
    assert_no_leak(llm)


def test_eviction_under_pressure_keeps_outputs_identical(llm_factory: Callable[..., LLM],
                                                         hf_reference: HFReference) -> None:
    """A pool that cannot keep every cached block: later rounds evict earlier blocks and must not
    read stale KV from them."""
    llm = llm_factory("tiny", num_kv_blocks=SMALL_POOL_BLOCKS)
    evictions_before = llm.engine.stats().num_evictions
    for prompts in (PROMPTS[:5], PROMPTS[5:], PROMPTS[:5]):
        assert generate_token_ids(llm, prompts, greedy(MAX_TOKENS)) == expected(hf_reference, "tiny", prompts)
    assert llm.engine.stats().num_evictions > evictions_before
    assert_no_leak(llm)
