"""Small builders shared by the engine tests: random prompts, model-free schedulers and requests, a
fake-model driver for the scheduler, and the "no block, no request left behind" checks."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve import LLM
from pdserve.config import CacheConfig, SchedulerConfig
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler, SchedulerOutput
from pdserve.engine.sampler import TokenLogprobs

# Qwen3's special tokens start here; random prompts stay below so they are plain text tokens.
FIRST_SPECIAL_TOKEN_ID = 151643
FAKE_TOKEN_ID = 7  # what the fake model "samples" in scheduler-only tests


def random_prompt(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, FIRST_SPECIAL_TOKEN_ID, (length,), generator=gen).tolist()


def token_prompts(prompts: Sequence[list[int]]) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": list(p)} for p in prompts]


def greedy(max_tokens: int, **kwargs: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)  # type: ignore[arg-type]


def generate_token_ids(llm: LLM, prompts: Sequence[list[int]], params: SamplingParams) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(token_prompts(prompts), params)]


# -- model-free scheduler pieces -------------------------------------------------------------------
def make_scheduler(num_blocks: int, block_size: int = 4, *, max_num_seqs: int = 8, max_num_batched_tokens: int = 64,
                   max_model_len: int = 1024, enable_chunked_prefill: bool = True, enable_prefix_caching: bool = True,
                   num_swap_blocks: int = 0, preemption_mode: str = "recompute") -> Scheduler:
    sched = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len, enable_chunked_prefill,
                            "swap" if preemption_mode == "swap" else "recompute")
    return Scheduler(sched, CacheConfig(block_size, num_blocks, num_swap_blocks, enable_prefix_caching))


def make_request(request_id: str, prompt_token_ids: Sequence[int] | int, max_tokens: int = 4,
                 max_model_len: int = 1024, **params: object) -> Request:
    """`prompt_token_ids` may be a length: the prompt is then 100, 101, ... (distinct per position)."""
    ids = list(range(100, 100 + prompt_token_ids)) if isinstance(prompt_token_ids, int) else list(prompt_token_ids)
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params)  # type: ignore[arg-type]
    return Request(request_id, ids, sampling, eos_token_ids=(), max_model_len=max_model_len)


def fake_step(scheduler: Scheduler, token_id: int = FAKE_TOKEN_ID) -> SchedulerOutput:
    """One scheduling step with a fake model that samples `token_id` wherever a chunk samples."""
    out = scheduler.schedule()
    sampled = {c.request.request_id: token_id for c in out.chunks if c.samples}
    scheduler.update(out, sampled)
    return out


def run_to_completion(scheduler: Scheduler, max_steps: int = 10_000) -> list[SchedulerOutput]:
    outputs = []
    while scheduler.requests:
        outputs.append(fake_step(scheduler))
        assert len(outputs) < max_steps, "scheduler made no progress"
    return outputs


# -- leak checks -----------------------------------------------------------------------------------
def assert_kv_clean(kv: KVCacheManager) -> None:
    pool = kv.pool
    assert pool.num_free_blocks == pool.num_blocks, f"{pool.num_used_blocks} KV blocks still in use"
    assert all(count == 0 for count in pool.ref_counts), "a block kept a reference"
    assert sorted(kv.swap._free) == list(range(kv.swap.num_blocks)), "swap blocks leaked or freed twice"


def assert_scheduler_clean(scheduler: Scheduler) -> None:
    assert not scheduler.requests, f"requests left: {sorted(scheduler.requests)}"
    assert not scheduler.running and not scheduler.waiting and not scheduler.swapped
    assert_kv_clean(scheduler.kv)


def assert_no_leak(llm: LLM) -> None:
    """Every engine test ends here: no block, no swap block, no request, no output state left behind."""
    engine = llm.engine
    assert_scheduler_clean(engine.scheduler)
    assert not engine.has_unfinished_requests()
    assert not engine._children, f"engine sequences left: {sorted(engine._children)}"
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_swapped) == (0, 0, 0)
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def top_ids(logprobs: TokenLogprobs) -> list[int]:
    return [token_id for token_id, _ in logprobs.top]
