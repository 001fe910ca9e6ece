"""Decode role: reserve blocks for a request, receive its KV from a prefill worker, decode on.

    router --POST /pd/reserve-->  reserve_remote on the engine thread; receiver.expect(transfer id, blocks)
    prefill worker ==KV layers==>  receiver (validated, written into the reserved blocks)
    KVDone(first token, generator state) -> complete_remote: the first token is emitted at once
    router <--GET /pd/stream---   one NDJSON OutputFrame per engine output until finished

Time without progress: the clock starts with the transfer's first payload. Before it the job is
queued for or computing on a prefill worker, which the router and the queue watch (a lost
prefill worker's job is prefilled again, as a new attempt: POST /pd/retarget). Once payloads flow,
a gap of `transfer_timeout_s` with neither a payload nor a keepalive (POST /pd/alive: the prefill
worker is still computing the attempt) is a timeout: the first one asks the router for a new attempt (the
retry: an OutputFrame with `kv_retry`) and keeps listening to the old one until the new one is
set; a second timeout applies the failure policy: "recompute" prefills here, "fail" ends the
request with an error. Each case is counted and logged with the stable message
`KV cache transfer timed out`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import AsyncIterator
from typing import Literal

from pdserve.disagg.control import OutputFrame, ReserveReply, ReserveRequest
from pdserve.disagg.phases import TransferMeter
from pdserve.disagg.transport.base import KVReceiver
from pdserve.disagg.transport.errors import KVTransferError, KVTransferTimeout
from pdserve.disagg.transport.messages import KVDone, KVRejected
from pdserve.engine.async_llm import AsyncLLM
from pdserve.engine.commands import CompleteRemote, PrefillLocally, ReserveRemote
from pdserve.engine.llm_engine import RemoteReservation
from pdserve.engine.output import RequestOutput
from pdserve.logs import bind_request_id

logger = logging.getLogger(__name__)

FailurePolicy = Literal["recompute", "fail"]


class _RetrySignal:
    """Queued into a request's output stream: tell the router to prefill it again."""


_RETRY = _RetrySignal()
StreamItem = RequestOutput | BaseException | _RetrySignal


class DecodeService:
    def __init__(self, client: AsyncLLM, receiver: KVReceiver, failure_policy: FailurePolicy,
                 transfer_timeout_s: float) -> None:
        self.client = client
        self.receiver = receiver
        self.failure_policy = failure_policy
        self.transfer_timeout_s = transfer_timeout_s
        self.counters: Counter[str] = Counter()  # completed, timeouts, retried, recomputed, failed, rejected
        self.draining = False
        self._streams: dict[str, asyncio.Queue[StreamItem]] = {}
        self._blocks: dict[str, tuple[int, ...]] = {}  # request id -> its reserved blocks
        self._transfers: dict[str, str] = {}  # request id -> the transfer id the receiver expects
        self._watchers: dict[str, asyncio.Task[None]] = {}
        self._retried: set[str] = set()  # requests that already asked for their one retry
        self.transfers = TransferMeter(receiver.layout)  # per-transfer duration/bytes, TTFT phases

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    async def reserve(self, body: ReserveRequest) -> ReserveReply | None:
        """None when the pool has no room now (or the worker drains). Raises ValueError for a
        request that can never run."""
        rid, tid = body.request_id, body.transfer_id
        bind_request_id(rid)
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already reserved")
        if self.draining:
            return None
        stream: asyncio.Queue[StreamItem] = asyncio.Queue()

        def expect_transfer(reservation: RemoteReservation) -> None:
            self.receiver.expect(tid, list(reservation.block_ids))

        reservation = await self.client.send(
            ReserveRemote(rid, body.prompt_token_ids, body.params.build(), on_reserved=expect_transfer), stream)
        if reservation is None:
            return None
        self._streams[rid] = stream
        self._blocks[rid] = tuple(reservation.block_ids)
        self._transfers[rid] = tid
        self._watchers[rid] = asyncio.create_task(self._watch(rid, tid))
        return ReserveReply(block_ids=list(reservation.block_ids), num_cached_tokens=reservation.num_cached_tokens,
                            kv_address=self.receiver.address)

    def retarget(self, request_id: str, transfer_id: str) -> bool:
        """Expect a new attempt's KV (same blocks); the current attempt is cancelled. False when
        the request is not waiting for KV any more (finished, aborted, or already recomputing)."""
        bind_request_id(request_id)  # the new watcher's log lines name the request
        old = self._transfers.get(request_id)
        if old is None:
            return False
        if old == transfer_id:
            return True
        self.receiver.cancel(old)
        self.receiver.expect(transfer_id, list(self._blocks[request_id]))
        self._transfers[request_id] = transfer_id
        watcher = self._watchers.pop(request_id, None)
        if watcher is not None:
            watcher.cancel()
        self._watchers[request_id] = asyncio.create_task(self._watch(request_id, transfer_id))
        logger.info("request %s: expecting KV from attempt %s", request_id, transfer_id)
        return True

    def touch(self, transfer_ids: list[str]) -> None:
        """Keepalives from prefill workers: these attempts are still being computed. The receiver
        ignores ids it does not expect (finished, cancelled or superseded attempts)."""
        for tid in transfer_ids:
            self.receiver.touch(tid)

    async def fail(self, request_id: str, reason: str) -> bool:
        """End a request that is still waiting for its KV with an error (e.g. its prefill job was
        dead-lettered). False when it is not waiting any more."""
        if request_id not in self._transfers:
            return False
        self.counters["failed"] += 1
        self._end_with_error(request_id, reason)
        return True

    async def prefill_here(self, request_id: str) -> bool:
        """Conditional disaggregation: this worker computes the (short) uncached rest itself."""
        if request_id not in self._transfers:
            return False
        self._stop_receiving(request_id)
        self.counters["prefilled_locally"] += 1
        await self.client.send(PrefillLocally(request_id))
        return True

    async def stream(self, request_id: str) -> AsyncIterator[OutputFrame]:
        """The request's outputs; leaving early (router gone) aborts it and frees its blocks."""
        stream = self._streams.get(request_id)
        if stream is None:
            raise KeyError(request_id)
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, _RetrySignal):
                    yield OutputFrame(kv_retry=True)
                    continue
                if isinstance(item, BaseException):
                    finished = True
                    yield OutputFrame(error=str(item), finish_reason="abort")
                    return
                finished = item.finished
                yield self.transfers.annotate(request_id, OutputFrame.of(item))
        finally:
            if not finished:
                self.client.abort(request_id)
            self._forget(request_id)

    async def abort(self, request_id: str) -> None:
        self._forget(request_id)
        self.client.abort(request_id)

    def close(self) -> None:
        self.receiver.close()

    def _stop_receiving(self, request_id: str) -> None:
        tid = self._transfers.pop(request_id, None)
        if tid is not None:
            self.receiver.cancel(tid)
        watcher = self._watchers.pop(request_id, None)
        if watcher is not None and watcher is not asyncio.current_task():
            watcher.cancel()

    def _forget(self, request_id: str) -> None:
        self._stop_receiving(request_id)
        self._streams.pop(request_id, None)
        self._blocks.pop(request_id, None)
        self._retried.discard(request_id)
        self.transfers.forget(request_id)

    async def _watch(self, rid: str, tid: str) -> None:
        started = False
        while True:
            try:
                # NOTE: no transfer clock before the first payload: the job may be queued for, or
                # computing on, a prefill worker; the router and the queue watch those.
                event = await self.receiver.wait(tid, self.transfer_timeout_s if started else _LIVENESS_POLL_S)
                self.transfers.on_event(rid, event)
            except KVTransferTimeout:
                if not started:
                    continue
                self.counters["timeouts"] += 1
                logger.warning("KV cache transfer timed out: request %s (%s), no progress for %.0f ms%s", rid, tid,
                               1000 * self.transfer_timeout_s,
                               "" if rid in self._retried else "; asking for a new attempt")
                if rid not in self._retried:
                    self._retried.add(rid)
                    self.counters["retried"] += 1
                    stream = self._streams.get(rid)
                    if stream is not None:
                        stream.put_nowait(_RETRY)
                    continue
                await self._apply_failure_policy(rid, "KV cache transfer timed out")
                return
            except KVTransferError:
                return  # cancelled: the request was aborted or retargeted
            started = True
            if isinstance(event, KVRejected):
                self.counters["rejected"] += 1
                logger.warning("KV payload rejected for request %s: %s", rid, event.reason)
                await self._apply_failure_policy(rid, f"KV transfer rejected: {event.reason}")
                return
            if isinstance(event, KVDone):
                self.counters["completed"] += 1
                self._transfers.pop(rid, None)
                self._watchers.pop(rid, None)
                await self.client.send(CompleteRemote(rid, event.first_token_id, event.generator_state))
                return

    async def _apply_failure_policy(self, rid: str, reason: str) -> None:
        self._stop_receiving(rid)
        if self.failure_policy == "recompute":
            self.counters["recomputed"] += 1
            logger.warning("request %s: %s; prefilling it on this decode worker", rid, reason)
            await self.client.send(PrefillLocally(rid))
            return
        self.counters["failed"] += 1
        self._end_with_error(rid, reason)

    def _end_with_error(self, rid: str, reason: str) -> None:
        self._stop_receiving(rid)
        stream = self._streams.get(rid)
        self.client.abort(rid)
        if stream is not None:
            stream.put_nowait(KVTransferError(f"request {rid}: {reason}"))


_LIVENESS_POLL_S = 1.0
