"""Greedy outputs are token-identical to Hugging Face transformers, whatever the engine does on the way:
mixed batches, chunked prefill, prefix-cache hits, preemption (recompute and swap), block sizes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import MODEL_NAMES, HFReference
from helpers import assert_no_leak, generate_token_ids, greedy, random_prompt, token_prompts

from pdserve import LLM, SamplingParams
from pdserve.engine.scheduler_output import SchedulerOutput

MAX_TOKENS = 16
FIRST_OUT_OF_VOCAB = 151936  # Qwen3's vocab_size
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
    # Chunked prefill admits many prompts at once with part of their blocks; as they grow the pool
    # runs out and the newest running request is preempted.
    "preempt-recompute": {"num_kv_blocks": SMALL_POOL_BLOCKS, "max_num_batched_tokens": 128,
                          "preemption_mode": "recompute", "enable_prefix_caching": False},
    "preempt-recompute-cached": {"num_kv_blocks": SMALL_POOL_BLOCKS, "max_num_batched_tokens": 128,
                                 "preemption_mode": "recompute"},
    "preempt-swap": {"num_kv_blocks": SMALL_POOL_BLOCKS, "max_num_batched_tokens": 128, "preemption_mode": "swap",
                     "swap_space": 0.01},
}


def expected(hf_reference: HFReference, model: str, prompts: list[list[int]]) -> list[list[int]]:
    return [hf_reference.greedy(model, prompt, MAX_TOKENS) for prompt in prompts]


# Every config on the tiny model, the other model's variants (untied head, one KV head, shards) in
# its default config; the rest of the cross product only in the full suite.
GREEDY_CASES = [pytest.param(model, config, marks=[] if model == "tiny" or config == "default" else [pytest.mark.slow])
                for model in MODEL_NAMES for config in CONFIGS]


@pytest.mark.parametrize(("model", "config"), GREEDY_CASES)
def test_greedy_matches_transformers(model: str, config: str, llm_factory: Callable[..., LLM],
                                     hf_reference: HFReference, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = llm_factory(model, **CONFIGS[config])
    scheduler = llm.engine.scheduler
    preemptions_before = scheduler.num_preemptions
    num_swapped_blocks = 0
    num_long_prefill_chunks = 0
    schedule = scheduler.schedule

    def spy_schedule() -> SchedulerOutput:
        nonlocal num_swapped_blocks, num_long_prefill_chunks
        out = schedule()
        assert out.num_batched_tokens <= scheduler.config.max_num_batched_tokens
        num_swapped_blocks += len(out.blocks_to_swap_out)
        num_long_prefill_chunks += sum(1 for c in out.chunks
                                       if c.request.num_prompt_tokens == max(PROMPT_LENS) and c.num_new_tokens > 1)
        return out

    monkeypatch.setattr(scheduler, "schedule", spy_schedule)

    outputs = generate_token_ids(llm, PROMPTS, greedy(MAX_TOKENS))

    for length, got, want in zip(PROMPT_LENS, outputs, expected(hf_reference, model, PROMPTS), strict=True):
        assert got == want, f"prompt of {length} tokens"
    if config.startswith("preempt"):
        assert scheduler.num_preemptions > preemptions_before, "the small pool should force preemptions"
    if config == "preempt-swap":
        assert num_swapped_blocks > 0, "preemptions should have swapped blocks out"
    if config == "chunked":
        assert num_long_prefill_chunks >= 10, "the long prompt should take many chunks"
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


def test_kv_pool_starts_zeroed_on_reused_memory(model_dirs: dict[str, Path], hf_reference: HFReference) -> None:
    """Regression: the pool used to be `torch.empty`. A small pool lands on freed heap memory, and
    decode attention reads whole blocks (masked slots still contribute 0 * value), so stale NaN bytes
    turned every output into token 0."""
    pool_bytes = SMALL_POOL_BLOCKS * 16 * 2 * 2 * 2 * 32 * 4  # tiny: 2 layers, k|v, 2 KV heads, head_dim 32, fp32
    junk = torch.full((pool_bytes // 4,), float("nan"))
    del junk  # the next allocation of this size is likely to reuse these NaN bytes
    llm = LLM(model=str(model_dirs["tiny"]), dtype="float32", num_kv_blocks=SMALL_POOL_BLOCKS)
    assert not llm.engine.runner.kv_cache.any()
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[4]]
    assert generate_token_ids(llm, prompts, greedy(MAX_TOKENS)) == expected(hf_reference, "tiny", prompts)
    assert_no_leak(llm)


@pytest.mark.parametrize("bad_prompt", [[], [FIRST_OUT_OF_VOCAB], list(range(5000))],
                         ids=["empty", "out-of-vocab", "longer-than-max_model_len"])
def test_rejected_prompt_leaves_nothing_behind(llm_factory: Callable[..., LLM], hf_reference: HFReference,
                                               bad_prompt: list[int]) -> None:
    """Regression: `LLM.generate` added the prompts before its try/finally, so the prompts accepted
    before a rejected one stayed in the engine forever."""
    llm = llm_factory("tiny")
    with pytest.raises(ValueError):
        llm.generate(token_prompts([PROMPTS[1], PROMPTS[4], bad_prompt, PROMPTS[3]]), greedy(MAX_TOKENS))
    assert_no_leak(llm)
    assert generate_token_ids(llm, PROMPTS[3:4], greedy(MAX_TOKENS)) == expected(hf_reference, "tiny", PROMPTS[3:4])
    assert_no_leak(llm)


def test_out_of_vocab_stop_token_id_is_rejected_before_it_reaches_the_sampler(llm_factory: Callable[..., LLM]) -> None:
    """Regression: the sampler masks stop ids under min_tokens by indexing the logits, so an id past
    the vocabulary raised inside step() and stopped the engine for every request."""
    llm = llm_factory("tiny")
    bad = SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[llm.engine.config.model.vocab_size])
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate(token_prompts([PROMPTS[1], PROMPTS[2]]), [greedy(MAX_TOKENS), bad])
    assert_no_leak(llm)


def test_abort_in_every_state_leaves_nothing_behind(llm_factory: Callable[..., LLM],
                                                    hf_reference: HFReference) -> None:
    llm = llm_factory("tiny", **CONFIGS["preempt-swap"])
    engine, scheduler = llm.engine, llm.engine.scheduler
    request_ids = [f"abort-{n}" for n in range(len(PROMPTS))]
    for request_id, prompt in zip(request_ids, PROMPTS, strict=True):
        engine.add_request(request_id, prompt, greedy(MAX_TOKENS))
    engine.add_request("abort-n2", PROMPTS[0], SamplingParams(n=2, seed=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    finished = set()
    for _ in range(100):
        finished |= {output.request_id for output in engine.step() if output.finished}
        if scheduler.swapped and scheduler.running and scheduler.waiting:
            break
    assert scheduler.swapped and scheduler.running and scheduler.waiting
    for request_id in [*request_ids, "abort-n2"]:
        output = engine.abort_request(request_id)
        if request_id in finished:
            assert output is None
        else:
            assert output is not None and output.finished
            assert {c.finish_reason for c in output.outputs} <= {"abort", "length"}
            assert "abort" in {c.finish_reason for c in output.outputs}
    assert_no_leak(llm)
    # The engine is fully usable afterwards, and what it computes is still right.
    assert generate_token_ids(llm, PROMPTS, greedy(MAX_TOKENS)) == expected(hf_reference, "tiny", PROMPTS)
    assert_no_leak(llm)
