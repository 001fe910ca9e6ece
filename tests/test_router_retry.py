"""Prefill attempts the router and its memory queue number between them: no two attempts of a
request may share a transfer id (the decode worker tells attempts apart by it, and rejects the late
bytes of a superseded one). The workers are stubbed at the WorkerClient boundary."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from helpers import mark_ready, until
from pd_fixtures import StubPrefillClient

from pdserve.disagg.client import WorkerUnreachable
from pdserve.disagg.config import RouterConfig
from pdserve.disagg.control import HandOff, PrefillJob, WireSamplingParams
from pdserve.disagg.router.core import PDRouter, ServedModel
from pdserve.disagg.router.memory_queue import MemoryPrefillQueue
from pdserve.disagg.router.pool import WorkerPool
from pdserve.engine.sampling_params import SamplingParams
from pdserve.model.qwen3_config import Qwen3ModelConfig
from pdserve.tokenizer import load_tokenizer

PREFILL, DECODE = "http://prefill", "http://decode"


class StubWorkers(StubPrefillClient):
    """The first prefill POST finds the worker gone; later ones compute until released. The
    decode worker always accepts a retarget."""

    def __init__(self) -> None:
        super().__init__(timeout_s=1.0)
        self.prefilled: list[str] = []
        self.retargeted: list[str] = []
        self.aborted: list[str] = []
        self.release = asyncio.Event()

    async def prefill_job(self, url: str, job: PrefillJob, on_first_token: Any = None) -> HandOff | None:
        self.prefilled.append(job.transfer_id)
        if len(self.prefilled) == 1:
            raise WorkerUnreachable(url, OSError("connection reset"))
        await self.release.wait()
        return HandOff(transfer_id=job.transfer_id, status="aborted")

    async def retarget(self, url: str, request_id: str, transfer_id: str, replaces: str = "") -> bool:
        self.retargeted.append(transfer_id)
        return True

    async def abort(self, url: str, request_id: str) -> None:
        self.aborted.append(request_id)


def test_a_retry_after_a_requeue_gets_a_new_attempt(model_dirs: dict[str, Path]) -> None:
    async def scenario() -> None:
        workers = StubWorkers()
        pool = WorkerPool(workers, [PREFILL], [DECODE])
        for worker in pool.members("prefill") + pool.members("decode"):
            mark_ready(worker)
        queue = MemoryPrefillQueue(pool, workers)
        model_dir = model_dirs["tiny"]
        router = PDRouter(RouterConfig(prefill=(PREFILL,), decode=(DECODE,)),
                          ServedModel(load_tokenizer(str(model_dir)), Qwen3ModelConfig.from_dir(model_dir),
                                      str(model_dir), 1024),
                          pool=pool, queue=queue,
                          client=workers)
        job = PrefillJob(request_id="r", transfer_id="r@0", decode_url=DECODE, prompt_token_ids=[1, 2, 3],
                         params=WireSamplingParams.of(SamplingParams(max_tokens=2)), kv_address="a:1",
                         block_ids=[0], num_cached_tokens=0)
        try:
            run = router.run("r", [1, 2, 3], SamplingParams(max_tokens=2))
            ticket = await run.dispatch(job)
            # the prefill worker was lost with attempt @0: the queue re-queues it as @1, and once the
            # worker is back in the pool, @1 runs there
            await until(lambda: workers.retargeted == ["r@1"], "the re-queue")
            mark_ready(pool.members("prefill")[0])
            await queue.refresh()
            await until(lambda: workers.prefilled == ["r@0", "r@1"], "attempt @1 to start")
            assert ticket.job.transfer_id == "r@1"
            # then decode reports a stalled transfer: the retry must be a new attempt, not @1 again
            run.decode = pool.members("decode")[0]
            await run.retry_prefill()
            assert run.ticket is not None and run.ticket.job.transfer_id == "r@2"
            assert workers.retargeted == ["r@1", "r@2"]
            # the superseded attempt is stopped where it runs; so is @0, whose answer was cut (best effort)
            assert workers.aborted == ["r@0", "r@1"]
            await until(lambda: workers.prefilled == ["r@0", "r@1", "r@2"], "attempt @2 to start")
        finally:
            workers.release.set()
            await asyncio.sleep(0)
            await router.close()

    asyncio.run(scenario())


class TimingOut(StubPrefillClient):
    """Every hand-off times out on the prefill worker; the decode worker hears of attempts that ended."""

    def __init__(self) -> None:
        super().__init__(timeout_s=1.0)
        self.ended: list[tuple[str, list[str]]] = []

    async def prefill_job(self, url: str, job: PrefillJob, on_first_token: Any = None) -> HandOff | None:
        return HandOff(transfer_id=job.transfer_id, status="timed_out", reason="no decode reservation named")

    async def alive(self, url: str, transfer_ids: list[str], ended: list[str] | None = None,
                    timeout_s: float | None = None) -> None:
        self.ended.append((url, list(ended or [])))


def test_a_placed_attempt_that_times_out_on_prefill_is_reported_ended_to_its_decode_worker() -> None:
    """A placement that reached the queue while its attempt was ending on the prefill worker (which
    answered it 404, so never heard where the KV was to go, and could not tell decode itself) left
    decode waiting for KV that never came, for its whole lease (60 s). The queue tells decode the
    attempt ended; decode counts that once, whoever tells it (tests/test_pd_deadlines.py: the retry)."""

    async def scenario() -> None:
        workers = TimingOut()
        pool = WorkerPool(workers, [PREFILL], [DECODE])
        for worker in pool.members("prefill") + pool.members("decode"):
            mark_ready(worker)
        queue = MemoryPrefillQueue(pool, workers)
        placed = PrefillJob(request_id="r", transfer_id="r@0", decode_url=DECODE, prompt_token_ids=[1, 2, 3],
                            params=WireSamplingParams.of(SamplingParams(max_tokens=2)), kv_address="a:1",
                            block_ids=[0], num_cached_tokens=0)
        unplaced = PrefillJob(request_id="u", transfer_id="u@0", prompt_token_ids=[1, 2, 3],
                              params=WireSamplingParams.of(SamplingParams(max_tokens=2)))
        try:
            await queue.put(placed)
            await queue.put(unplaced)
            await until(lambda: workers.ended == [(DECODE, ["r@0"])], "the report to decode")
            await asyncio.sleep(0.05)
            assert workers.ended == [(DECODE, ["r@0"])], "an unplaced job has no decode worker to tell"
        finally:
            await queue.close()

    asyncio.run(scenario())


class OneDraining(StubPrefillClient):
    """The first prefill worker answers every job 503 (draining: `prefill` returns None, the worker
    still answers); the second computes it. Decode accepts every retarget."""

    def __init__(self) -> None:
        super().__init__(timeout_s=1.0)
        self.prefilled: list[tuple[str, str]] = []
        self.aborted: list[str] = []

    async def prefill_job(self, url: str, job: PrefillJob, on_first_token: Any = None) -> HandOff | None:
        self.prefilled.append((url, job.transfer_id))
        if url == PREFILL:
            return None
        return HandOff(transfer_id=job.transfer_id, status="handed_off")

    async def retarget(self, url: str, request_id: str, transfer_id: str, replaces: str = "") -> bool:
        return True

    async def abort(self, url: str, request_id: str) -> None:
        self.aborted.append(request_id)


def test_a_job_a_draining_prefill_worker_refuses_goes_to_another_and_the_worker_gets_no_more() -> None:
    """A 503 (draining) re-queued the job, and the queue picked the same worker again at once, until
    its next poll or its port closing (`up`'s Ctrl-C: one job sent five times in 20 ms, then a
    WARNING that the worker was unreachable). Now the worker leaves new work at its first 503."""
    other = "http://prefill-2"

    async def scenario() -> None:
        workers = OneDraining()
        pool = WorkerPool(workers, [PREFILL, other], [DECODE])
        for worker in pool.members("prefill") + pool.members("decode"):
            mark_ready(worker)
        queue = MemoryPrefillQueue(pool, workers)
        jobs = [PrefillJob(request_id=name, transfer_id=f"{name}@0", decode_url=DECODE, prompt_token_ids=[1, 2, 3],
                           params=WireSamplingParams.of(SamplingParams(max_tokens=2)), kv_address="a:1",
                           block_ids=[0], num_cached_tokens=0) for name in ("r", "s")]
        try:
            await queue.put(jobs[0])
            await until(lambda: (other, "r@1") in workers.prefilled, "the job on the other worker")
            await queue.put(jobs[1])
            await until(lambda: (other, "s@0") in workers.prefilled, "the next job on the other worker")
            assert workers.prefilled == [(PREFILL, "r@0"), (other, "r@1"), (other, "s@0")]
            draining = pool.find("prefill", PREFILL)
            assert draining is not None and not draining.ready and draining.going
            assert workers.aborted == [], "a job refused with 503 was never taken: nothing to abort"
        finally:
            await queue.close()

    asyncio.run(scenario())
