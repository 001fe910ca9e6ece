"""Decode role: reserve blocks for a request, receive its KV from a prefill worker, decode on.

    router --POST /pd/reserve-->  reserve_remote on the engine thread; receiver.expect(blocks)
    prefill worker ==KV layers==>  receiver (validated, written into the reserved blocks)
    KVDone(first token, generator state) -> complete_remote: the first token is emitted at once
    router <--GET /pd/stream---   one NDJSON OutputFrame per engine output until finished

A transfer that makes no progress for `transfer_timeout_s` is waited on once more (the retry),
then the failure policy applies: "recompute" prefills here, "fail" ends the request with an error.
Each case is counted and logged with the stable message `KV cache transfer timed out`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import AsyncIterator
from functools import partial
from typing import Literal

from pdserve.disagg.control import OutputFrame, ReserveReply, ReserveRequest
from pdserve.disagg.phases import TransferMeter, generator_state_of
from pdserve.disagg.transport.base import KVReceiver
from pdserve.disagg.transport.errors import KVTransferError, KVTransferTimeout
from pdserve.disagg.transport.messages import KVDone, KVRejected
from pdserve.engine.llm_engine import LLMEngine, RemoteReservation
from pdserve.engine.output import RequestOutput
from pdserve.logs import bind_request_id
from pdserve.serving.async_engine import AsyncLLM

logger = logging.getLogger(__name__)

FailurePolicy = Literal["recompute", "fail"]


class DecodeService:
    def __init__(self, client: AsyncLLM, receiver: KVReceiver, failure_policy: FailurePolicy,
                 transfer_timeout_s: float) -> None:
        self.client = client
        self.receiver = receiver
        self.failure_policy = failure_policy
        self.transfer_timeout_s = transfer_timeout_s
        self.counters: Counter[str] = Counter()  # completed, retried, recomputed, failed, rejected
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._watchers: dict[str, asyncio.Task[None]] = {}
        self.transfers = TransferMeter(receiver.layout)  # per-transfer duration/bytes, TTFT phases

    async def reserve(self, body: ReserveRequest) -> ReserveReply | None:
        """None when the pool has no room now. Raises ValueError for a request that can never run."""
        rid, prompt, params = body.request_id, body.prompt_token_ids, body.params.build()
        bind_request_id(rid)
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already reserved")
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        receiver = self.receiver

        def reserve_on_engine(engine: LLMEngine) -> RemoteReservation | None:
            reservation = engine.reserve_remote(rid, prompt, params)
            if reservation is not None:
                receiver.expect(rid, list(reservation.block_ids))  # before prefill can possibly send
            return reservation

        reservation = await self.client.call(reserve_on_engine, stream_for=rid, stream=stream)
        if reservation is None:
            return None
        self._streams[rid] = stream
        self._watchers[rid] = asyncio.create_task(self._watch(rid))
        return ReserveReply(block_ids=list(reservation.block_ids), num_cached_tokens=reservation.num_cached_tokens,
                            kv_address=self.receiver.address)

    async def stream(self, request_id: str) -> AsyncIterator[OutputFrame]:
        """The request's outputs; leaving early (router gone) aborts it and frees its blocks."""
        stream = self._streams.get(request_id)
        if stream is None:
            raise KeyError(request_id)
        try:
            async for output in self.client.consume(request_id, stream):
                yield self.transfers.annotate(request_id, OutputFrame.of(output))
        except KVTransferError as exc:
            yield OutputFrame(error=str(exc), finish_reason="abort")
        finally:
            self._forget(request_id)

    async def abort(self, request_id: str) -> None:
        self._forget(request_id)
        self.client.abort(request_id)

    def close(self) -> None:
        self.receiver.close()

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self.transfers.forget(request_id)
        watcher = self._watchers.pop(request_id, None)
        if watcher is not None and watcher is not asyncio.current_task():
            watcher.cancel()
        self.receiver.cancel(request_id)

    async def _watch(self, rid: str) -> None:
        retried = False
        while True:
            try:
                event = await self.receiver.wait(rid, self.transfer_timeout_s)
                self.transfers.on_event(rid, event)
            except KVTransferTimeout:
                self.counters["timeouts"] += 1
                logger.warning("KV cache transfer timed out: request %s, no progress for %.0f ms%s", rid,
                               1000 * self.transfer_timeout_s, "" if retried else "; waiting once more")
                if not retried:
                    retried = True
                    self.counters["retried"] += 1
                    continue
                await self._apply_failure_policy(rid, "KV cache transfer timed out")
                return
            except KVTransferError:
                return  # cancelled: the request was aborted
            if isinstance(event, KVRejected):
                self.counters["rejected"] += 1
                logger.warning("KV payload rejected for request %s: %s", rid, event.reason)
                await self._apply_failure_policy(rid, f"KV transfer rejected: {event.reason}")
                return
            if isinstance(event, KVDone):
                self.counters["completed"] += 1
                await self.client.call(partial(_complete, rid=rid, done=event))
                return

    async def _apply_failure_policy(self, rid: str, reason: str) -> None:
        self.receiver.cancel(rid)
        if self.failure_policy == "recompute":
            self.counters["recomputed"] += 1
            logger.warning("request %s: %s; prefilling it on this decode worker", rid, reason)
            await self.client.call(lambda e: e.prefill_locally(rid))
            return
        self.counters["failed"] += 1
        stream = self._streams.get(rid)
        self.client.abort(rid)
        if stream is not None:
            stream.put_nowait(KVTransferError(f"request {rid}: {reason}"))


def _complete(engine: LLMEngine, rid: str, done: KVDone) -> RequestOutput:
    return engine.complete_remote(rid, done.first_token_id, generator_state_of(done.extra))
