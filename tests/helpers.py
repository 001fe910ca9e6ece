"""Small builders shared by the engine tests: random prompts, model-free schedulers and requests (with
a fake clock), a fake-model driver for the scheduler, the "no block, no request left behind" checks, and
a checkpoint copy with FP8 KV scales."""

from __future__ import annotations

import asyncio
import shutil
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from pdserve import LLM
from pdserve.config import CacheConfig, SchedulerConfig
from pdserve.disagg.control import WorkerInfo
from pdserve.disagg.router.pool import Worker
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.llm import TokensPrompt
from pdserve.engine.logprobs import TokenLogprobs
from pdserve.engine.request import ModelContext, Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.scheduler_output import SchedulerOutput

# Qwen3's special tokens start here; random prompts stay below so they are plain text tokens.
FIRST_SPECIAL_TOKEN_ID = 151643
FAKE_TOKEN_ID = 7  # what the fake model "samples" in scheduler-only tests


def random_prompt(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, FIRST_SPECIAL_TOKEN_ID, (length,), generator=gen).tolist()


def token_prompts(prompts: Sequence[list[int]]) -> list[TokensPrompt]:
    return [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]


def greedy(max_tokens: int, **kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def generate_token_ids(llm: LLM, prompts: Sequence[list[int]],
                       params: SamplingParams | Sequence[SamplingParams]) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(token_prompts(prompts), params)]


def generate_texts(llm: LLM, prompts: Sequence[list[int]], params: SamplingParams) -> list[str]:
    """The texts a reference engine gives these token prompts (what a served answer must equal)."""
    return [out.outputs[0].text for out in llm.generate(token_prompts(prompts), params)]


class FakeClock:
    """A `time.monotonic` stand-in that moves only when told: timed logic without sleeping."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


def make_scheduler(num_blocks: int, block_size: int = 4, *, max_num_seqs: int = 8, max_num_batched_tokens: int = 64,
                   max_model_len: int = 1024, enable_chunked_prefill: bool = True, enable_prefix_caching: bool = True,
                   num_swap_blocks: int = 0, preemption_mode: str = "recompute",
                   remote_kv_quarantine_s: float = 0.0, clock: Callable[[], float] = time.monotonic) -> Scheduler:
    sched = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len, enable_chunked_prefill,
                            "swap" if preemption_mode == "swap" else "recompute")
    return Scheduler(sched, CacheConfig(block_size, num_blocks, num_swap_blocks, enable_prefix_caching),
                     remote_kv_quarantine_s, clock)


def make_request(request_id: str, prompt_token_ids: Sequence[int] | int, max_tokens: int = 4,
                 max_model_len: int = 1024, **params: Any) -> Request:
    """`prompt_token_ids` may be a length: the prompt is then consecutive ids starting from a point
    derived from `request_id`, so prompts built this way share no prefix."""
    if isinstance(prompt_token_ids, int):
        start = 1000 * (zlib.crc32(request_id.encode()) % 100_000)
        prompt_token_ids = range(start, start + prompt_token_ids)
    ids = list(prompt_token_ids)
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params)
    return Request(request_id, ids, sampling, ModelContext((), max_model_len))


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


class KVOracle:
    """The model runner's KV tensors without a model: every slot records which token prefix it holds.

    A step writes the new tokens' slots, then checks that every position each chunk attends to holds
    that request's own prefix, so a stale, missing, shared-but-overwritten or mis-swapped block is
    caught the way wrong KV would be. Sampling is a pure function of the prefix (like greedy), so
    identical prefixes produce identical continuations and share cached blocks.
    """

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.block_size = scheduler.kv.block_size
        self.device: dict[int, list[int | None]] = {}
        self.swap: dict[int, list[int | None]] = {}

    @staticmethod
    def next_token(token_ids: list[int]) -> int:
        return hash(tuple(token_ids)) % 1000

    def step(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        bs = self.block_size
        empty: list[int | None] = [None] * bs
        for device_block, swap_block in out.blocks_to_swap_out:  # the runner's order: out, then in
            self.swap[swap_block] = list(self.device.get(device_block, empty))
        for swap_block, device_block in out.blocks_to_swap_in:
            self.device[device_block] = list(self.swap[swap_block])
        for chunk in out.chunks:
            request, start = chunk.request, chunk.request.num_computed_tokens
            assert len(request.block_ids) * bs >= start + chunk.num_new_tokens, "no slot for a new token"
            for pos in range(start, start + chunk.num_new_tokens):
                block = self.device.setdefault(request.block_ids[pos // bs], list(empty))
                block[pos % bs] = hash(tuple(request.all_token_ids[:pos + 1]))
        for chunk in out.chunks:  # attention reads after all writes of the step
            request = chunk.request
            for pos in range(request.num_computed_tokens + chunk.num_new_tokens):
                held = self.device.get(request.block_ids[pos // bs], empty)[pos % bs]
                assert held == hash(tuple(request.all_token_ids[:pos + 1])), (
                    f"request {request.request_id} reads wrong KV at position {pos}")
        sampled = {c.request.request_id: self.next_token(c.request.all_token_ids) for c in out.chunks if c.samples}
        self.scheduler.update(out, sampled)
        return out


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


def mark_ready(worker: Worker) -> None:
    """A router-side worker that last said it is ready, idle, with 64 free KV blocks."""
    worker.info = WorkerInfo(role=worker.role, model="m", kv_layout={}, kv_transport="tcp", kv_address="a:1",
                             ready=True, num_running=0, num_waiting=0, num_free_kv_blocks=64, num_kv_blocks=64,
                             max_num_batched_tokens=2048)


async def until(condition: Callable[[], object], what: str) -> None:
    """Polls `condition` on the event loop for up to 2 s (AssertionError naming `what` after that)."""
    for _ in range(200):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def with_scales(src: Path, dst: Path, k: list[float], v: list[float], *, name: str = "self_attn.{}_scale") -> Path:
    """A copy of checkpoint `src` with per-layer KV scales in a file of their own (vLLM's names)."""
    shutil.copytree(src, dst)
    tensors = {}
    for layer, (k_scale, v_scale) in enumerate(zip(k, v, strict=True)):
        tensors[f"model.layers.{layer}.{name.format('k')}"] = torch.tensor(k_scale)
        tensors[f"model.layers.{layer}.{name.format('v')}"] = torch.tensor(v_scale)
    save_file(tensors, str(dst / "kv_scales.safetensors"))
    return dst
