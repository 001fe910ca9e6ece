"""Prefix-affinity placement of prefill jobs (memory queue) and the router's count of recoveries
after a decode loss: a job put with `prefix_affinity` goes to the prefill worker caching most of its
prompt (a worker that does not answer in time counts as caching nothing; with one prefill worker
ready nobody is asked), a job without it to the least loaded; a resumed request's hand-off is
counted by whether prefill reused cached KV. The workers are stubbed at the WorkerClient boundary."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from helpers import mark_ready, until
from pd_fixtures import StubPrefillClient

from pdserve.disagg.config import RouterConfig
from pdserve.disagg.control import FirstToken, HandOff, PrefillJob, WireSamplingParams
from pdserve.disagg.queue import Refusal
from pdserve.disagg.router import memory_queue as memory
from pdserve.disagg.router.core import PDRouter, ServedModel
from pdserve.disagg.router.memory_queue import MemoryPrefillQueue
from pdserve.disagg.router.pool import WorkerPool
from pdserve.engine.sampling_params import SamplingParams
from pdserve.model.qwen3_config import Qwen3ModelConfig
from pdserve.tokenizer import load_tokenizer

COLD, WARM, WARMER, SLOW = "http://cold", "http://warm", "http://warmer", "http://slow"
DECODE = "http://decode"
PROMPT = list(range(1, 80))
PARAMS = SamplingParams(max_tokens=2)


class StubWorkers(StubPrefillClient):
    """Prefill workers that cache a fixed part of any prompt (SLOW answers too late) and hand each
    job off at once, reporting that part as taken from their cache."""

    CACHED = {COLD: 0, WARM: 32, WARMER: 64, SLOW: 78}

    def __init__(self) -> None:
        super().__init__(timeout_s=1.0)
        self.asked: list[str] = []
        self.prefilled: list[str] = []

    async def prefix(self, url: str, prompt_token_ids: list[int]) -> int | None:
        self.asked.append(url)
        if url == SLOW:
            await asyncio.sleep(10)
        return self.CACHED[url]

    async def prefill_job(self, url: str, job: PrefillJob, on_first_token: Any = None) -> HandOff | None:
        self.prefilled.append(url)
        if job.request_id == "stalls" and job.transfer_id.endswith("@0"):
            await asyncio.sleep(10)  # superseded by a retry (cancelled) before it ends
        return HandOff(transfer_id=job.transfer_id, status="handed_off", prefill_cached_tokens=self.CACHED[url])

    async def retarget(self, url: str, request_id: str, transfer_id: str, replaces: str = "") -> bool:
        return True

    async def abort(self, url: str, request_id: str) -> None:
        pass


class Heard:
    """An attempt's listener (queue/base.py AttemptListener) that keeps what it heard."""

    wants_first_token = False

    def __init__(self) -> None:
        self.handed_off_with: list[int] = []
        self.refusals: list[Refusal] = []

    def first_token(self, first: FirstToken) -> None:
        raise AssertionError("not asked for")

    def handed_off(self, prefill_cached_tokens: int) -> None:
        self.handed_off_with.append(prefill_cached_tokens)

    def refused(self, refusal: Refusal) -> None:
        self.refusals.append(refusal)


def _job(rid: str) -> PrefillJob:
    return PrefillJob(request_id=rid, transfer_id=f"{rid}@0", decode_url=DECODE, prompt_token_ids=PROMPT,
                      params=WireSamplingParams.of(PARAMS), kv_address="a:1", block_ids=[0],
                      num_cached_tokens=0)


def _pool(workers: StubWorkers, prefill: list[str]) -> WorkerPool:
    pool = WorkerPool(workers, prefill, [DECODE])
    for worker in pool.members("prefill") + pool.members("decode"):
        mark_ready(worker)
    return pool


def test_a_job_with_prefix_affinity_goes_where_its_prompt_is_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "_PREFIX_QUERY_TIMEOUT_S", 0.2)

    async def scenario() -> None:
        workers = StubWorkers()
        queue = MemoryPrefillQueue(_pool(workers, [COLD, SLOW, WARMER, WARM]), workers)
        try:
            heard = Heard()
            await queue.put(_job("a"), prefix_affinity=True, listener=heard)
            await until(lambda: heard.handed_off_with, "the hand-off")
            # SLOW caches the most but did not answer in time: counted as caching nothing
            assert sorted(workers.asked) == sorted([COLD, SLOW, WARMER, WARM])
            assert workers.prefilled == [WARMER] and heard.handed_off_with == [64]
            workers.asked.clear()
            await queue.put(_job("b"))  # no affinity: nobody asked, the least loaded (first) takes it
            await until(lambda: len(workers.prefilled) == 2, "the second job")
            assert workers.asked == [] and workers.prefilled[1] == COLD
        finally:
            await queue.close()

    asyncio.run(scenario())


def test_one_ready_prefill_worker_is_not_asked() -> None:
    async def scenario() -> None:
        workers = StubWorkers()
        queue = MemoryPrefillQueue(_pool(workers, [WARM]), workers)
        try:
            await queue.put(_job("a"), prefix_affinity=True)
            await until(lambda: workers.prefilled, "the job")
            assert workers.asked == [] and workers.prefilled == [WARM]
        finally:
            await queue.close()

    asyncio.run(scenario())


def test_resumed_jobs_are_counted_by_where_their_prompt_kv_came_from(model_dirs: dict[str, Path]) -> None:
    async def scenario() -> None:
        workers = StubWorkers()
        pool = _pool(workers, [COLD, WARM])
        queue = MemoryPrefillQueue(pool, workers)
        model_dir = model_dirs["tiny"]
        router = PDRouter(RouterConfig(prefill=(COLD, WARM), decode=(DECODE,)),
                          ServedModel(load_tokenizer(str(model_dir)), Qwen3ModelConfig.from_dir(model_dir),
                                      str(model_dir), 1024),
                          pool=pool, queue=queue,
                          client=workers)
        try:
            await router.run("first", PROMPT, PARAMS).dispatch(_job("first"))  # a first run: least loaded, not counted
            await router.run("resumed", PROMPT, PARAMS, 1).dispatch(_job("resumed"))  # a resume: affinity, counted
            await until(lambda: len(workers.prefilled) == 2, "both hand-offs")
            assert workers.prefilled == [COLD, WARM]
            assert router.stats().recoveries.prefill_cache == 1 and router.stats().recoveries.recompute == 0
            pool.members("prefill")[1].info = None  # WARM gone: only COLD, which caches nothing, is left
            await router.run("resumed2", PROMPT, PARAMS, 1).dispatch(_job("resumed2"))
            await until(lambda: len(workers.prefilled) == 3, "the third hand-off")
            assert router.stats().recoveries.recompute == 1 and router.stats().recoveries.prefill_cache == 1
            # a resume whose transfer stalls is counted once, by its first attempt: the retry would find
            # what the stalled attempt computed
            job = _job("stalls")
            run = router.run("stalls", PROMPT, PARAMS, 1)
            await run.dispatch(job)
            await until(lambda: len(workers.prefilled) == 4, "the stalled attempt")
            run.decode = pool.members("decode")[0]
            await run.retry_prefill()
            await until(lambda: len(workers.prefilled) == 5, "the retry")
            await asyncio.sleep(0.05)
            assert router.stats().recoveries.recompute == 2 and router.stats().recoveries.prefill_cache == 1
        finally:
            await router.close()

    asyncio.run(scenario())
