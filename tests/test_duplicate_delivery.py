"""Every delivery of a prefill job is idempotent: a copy of an attempt that runs or ran on a prefill
worker is not run again and never ends the request, and of two copies of a move to a new attempt
(a router's retry and a queue consumer's re-delivery) only the first is run."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from helpers import greedy, random_prompt

from pdserve.config import EngineArgs
from pdserve.disagg.client import WorkerClient
from pdserve.disagg.control import HandOff, PrefillJob, ReserveRequest, WireSamplingParams
from pdserve.disagg.kv_layout import KVLayout
from pdserve.disagg.transport.errors import KVTransferError
from pdserve.disagg.transport.fake import FakeKVReceiver
from pdserve.disagg.worker.decode_service import DecodeService
from pdserve.disagg.worker.prefill_service import PrefillService
from pdserve.disagg.worker.queue_consumer import ConsumerOptions, RedisJobConsumer
from pdserve.engine.async_llm import AsyncLLM
from pdserve.engine.commands import AddPrefillOnly
from pdserve.engine.llm_engine import KVTransferSetup, LLMEngine
from pdserve.engine.sampling_params import SamplingParams


class _SlowEngine:
    """An engine client whose prefill-only requests run until `finish` is set (and end without a
    first token: the hand-off ends 'aborted', nothing is sent)."""

    def __init__(self) -> None:
        self.added: list[str] = []
        self.finish = asyncio.Event()
        self.last_step_s = time.monotonic()

    async def send(self, command: Any, stream: Any = None) -> Any:
        if isinstance(command, AddPrefillOnly):
            self.added.append(command.request_id)
        return True

    async def consume(self, request_id: str, stream: Any) -> AsyncIterator[Any]:
        await self.finish.wait()
        for _ in ():
            yield _


class _NoKV:
    """Unplaced jobs that end without a first token send nothing."""

    def close(self) -> None:
        pass


def _job(tid: str = "r@1", decode_url: str = "") -> PrefillJob:
    return PrefillJob(request_id="r", transfer_id=tid, decode_url=decode_url, prompt_token_ids=[1, 2, 3],
                      params=WireSamplingParams.of(SamplingParams(max_tokens=2)), kv_address="", block_ids=[],
                      num_cached_tokens=0)


def test_a_copy_of_a_running_or_ended_attempt_is_not_run_again() -> None:
    async def scenario() -> None:
        engine = _SlowEngine()
        service = PrefillService(engine, _NoKV(), transfer_timeout_s=5.0)  # type: ignore[arg-type]
        first = await service.submit(_job())
        copy = await service.submit(_job())  # delivered again while it runs: no error, the same attempt
        assert copy is first and engine.added == ["r@1"]
        assert service.holds("r@1") and service.num_in_flight == 1
        engine.finish.set()
        ended = await first
        late = await service.run(_job())  # delivered again after it ended: its outcome, nothing run
        assert late == ended and engine.added == ["r@1"]
        assert (await service.first_token("r@1")) is None  # a late copy's NDJSON answer has no first token
        assert service.stats().duplicates == 2 and service.num_in_flight == 0
        await service.run(_job("r@2"))  # another attempt runs
        assert engine.added == ["r@1", "r@2"]
        service.close()

    asyncio.run(scenario())


class _Recording(WorkerClient):
    def __init__(self) -> None:
        super().__init__(timeout_s=1.0)
        self.calls: list[str] = []

    async def fail(self, url: str, request_id: str, reason: str, transfer_id: str = "") -> bool:
        self.calls.append(f"fail {transfer_id}")
        return True


class _Holding:
    """A prefill service that runs attempt r@1 already."""

    secret = None

    def __init__(self) -> None:
        self.ran: list[str] = []

    def holds(self, transfer_id: str) -> bool:
        return transfer_id == "r@1"

    async def run(self, job: PrefillJob) -> HandOff:
        self.ran.append(job.transfer_id)
        return HandOff(transfer_id=job.transfer_id, status="failed", reason="decode refused it")


def test_the_queue_consumer_acknowledges_a_copy_without_running_or_failing_it() -> None:
    async def scenario() -> tuple[_Holding, _Recording, list[str], Any]:
        service, workers, acked = _Holding(), _Recording(), []
        consumer = RedisJobConsumer(service, "redis://127.0.0.1:1/0", options=ConsumerOptions(token_budget=64))  # type: ignore[arg-type]
        await consumer._workers.close()
        consumer._workers = workers

        class _Redis:
            async def exists(self, key: str) -> int:
                return 0

        async def ack(entry_id: str) -> None:
            acked.append(entry_id)

        consumer._redis = _Redis()  # type: ignore[assignment]
        consumer._ack = ack  # type: ignore[method-assign]
        await consumer._handle("2-0", {"job": _job("r@1", "http://decode").model_dump_json()}, reclaimed=False)
        await consumer._handle("3-0", {"job": _job("r@2", "http://decode").model_dump_json()}, reclaimed=False)
        return service, workers, acked, consumer.stats()

    service, workers, acked, stats = asyncio.run(scenario())
    assert service.ran == ["r@2"] and acked == ["2-0", "3-0"]
    assert workers.calls == ["fail r@2"]  # the copy of r@1 touched nothing; r@2's own failure is told
    assert stats.duplicates == 1


def test_of_two_copies_of_a_move_to_a_new_attempt_only_the_first_is_expected(model_dirs: dict[str, Path]) -> None:
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(model_dirs["tiny"]), dtype="float32", num_kv_blocks=16))
    receiver = FakeKVReceiver(KVLayout.from_pool("tiny", engine.runner.kv_cache), engine.runner.kv_cache)
    client = AsyncLLM(engine, KVTransferSetup(expectations=receiver))
    service = DecodeService(client, receiver, "fail", transfer_timeout_s=30.0)

    async def scenario() -> list[bool]:
        prompt = random_prompt(20, seed=5)
        reply = await service.reserve(ReserveRequest(request_id="r", transfer_id="r@0", prompt_token_ids=prompt,
                                                     params=WireSamplingParams.of(greedy(4))))
        assert reply is not None
        moves = [await service.retarget("r", "r@1", replaces="r@0"),  # the queue consumer's re-delivery
                 await service.retarget("r", "r@1", replaces="r@0"),  # the router's retry of the same attempt
                 await service.retarget("r", "r@1"),  # a plain repeat (no claim to what it replaces)
                 await service.retarget("r", "r@2", replaces="r@0")]  # a stale move
        await service.abort("r")
        return moves

    try:
        assert asyncio.run(scenario()) == [True, False, True, False]
    finally:
        client.shutdown()
        service.close()


def test_a_hand_off_that_fails_while_the_worker_stops_is_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    """Up's stop: a decode worker drops an attempt its router cancelled while this prefill worker
    drained ("rejected by decode: unknown request"). Counted as failed either way; a WARNING only
    while the worker serves."""
    async def scenario() -> None:
        service = PrefillService(_SlowEngine(), _NoKV(), transfer_timeout_s=5.0)  # type: ignore[arg-type]
        rejected = KVTransferError("rejected by decode: unknown request (never reserved, cancelled or finished)")
        with caplog.at_level(logging.INFO, logger="pdserve.disagg.worker.prefill_service"):
            assert service._failed("r@1", "failed", rejected).status == "failed"
            service.draining = True
            assert service._failed("r@2", "failed", rejected).status == "failed"
        levels = {r.getMessage().split(":")[0]: r.levelname for r in caplog.records}
        assert levels == {"request r@1": "WARNING", "request r@2": "INFO"}, levels
        assert "(this worker is stopping)" in caplog.records[1].getMessage()
        assert service.stats().failed == 2
        service.close()

    asyncio.run(scenario())
