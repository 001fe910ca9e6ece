"""Decode role: reserve blocks for a request, receive its KV from a prefill worker, decode on.

    router --POST /pd/reserve-->  reserve_remote on the engine thread; receiver.expect(transfer id, blocks)
    prefill worker ==KV layers==>  receiver (validated, written into the reserved blocks)
    KVDone(hand-off record: first token, generator state, ...) -> complete_remote: the first token is emitted at once
    router <--GET /pd/stream---   one NDJSON OutputFrame per engine output until finished (deltas);
                                  or the same frames on the router's one frame stream (frame_mux.py)

Before the first payload: the lease. The job is queued for or computing on a prefill worker
(which the router and the queue watch: a lost prefill worker's job is prefilled again as a new
attempt, POST /pd/retarget), but nothing may hold blocks unvouched for ever: a reservation that
hears neither a payload nor a keepalive for `lease_s` (a retarget starts it again) is ended with
an error and its blocks freed (`lease_expired`). A prefill worker that gives up on the attempt
says so (POST /pd/fail naming the attempt), which ends the request at once. Once payloads flow,
a gap of `transfer_timeout_s` with neither a payload nor a keepalive (POST /pd/alive: the prefill
worker is still computing the attempt) is a timeout: the first one asks the router for a new attempt (the
retry: an OutputFrame with `kv_retry`) and keeps listening to the old one until the new one is
set; a second timeout applies the failure policy: "recompute" prefills here, "fail" ends the
request with an error. Each case is counted and logged with the stable message
`KV cache transfer timed out`.

State: one `_Reserved` record per request (`_requests`, keyed by request id), created when the
reservation succeeds and removed when the request's stream ends or it is aborted; its `state`
moves through attempt_states.RESERVATION (awaiting_kv, receiving, retry_asked, decoding,
prefilling_here, ended), which refuses any other move. Only the KV receiver knows a transfer by
its attempt's id (`_Reserved.transfer_id`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Literal

from pdserve.disagg.attempt_states import RESERVATION, WAITING_FOR_KV, Reservation, State
from pdserve.disagg.control import FrameEncoder, KeepaliveReply, OutputFrame, ReserveReply, ReserveRequest
from pdserve.disagg.handoff import HandOffDone
from pdserve.disagg.phases import TransferMeter
from pdserve.disagg.prompt_logprobs_wire import unpack
from pdserve.disagg.request_ids import request_id_of
from pdserve.disagg.transport.cadence import StepClock
from pdserve.disagg.transport.errors import KVTransferError, KVTransferTimeout
from pdserve.disagg.transport.messages import KVDone, KVRejected
from pdserve.disagg.worker.kv_side import ReceiverView
from pdserve.disagg.worker.stats import DecodeStats
from pdserve.engine.async_llm import EngineClient, EngineDeadError, RequestFailedError
from pdserve.engine.commands import CachedPrefixTokens, CompleteRemote, PrefillLocally, ReserveRemote
from pdserve.engine.output import RequestOutput
from pdserve.logs import bind_request_id
from pdserve.serving.trace import TransferRecord

logger = logging.getLogger(__name__)

FailurePolicy = Literal["recompute", "fail"]
_LIVENESS_POLL_S = 1.0


class _RetrySignal:
    """Queued into a request's output stream: tell the router to prefill it again."""


_RETRY = _RetrySignal()
StreamItem = RequestOutput | BaseException | _RetrySignal


@dataclass(slots=True)
class _Reserved:
    """One request from its reservation until its stream ends. Event-loop only."""

    stream: asyncio.Queue[StreamItem]  # engine outputs, retry signals, or the error that ends it
    block_ids: tuple[int, ...]  # its reservation in this pool: where every attempt's KV goes
    token: str  # random: what every attempt's KV messages must present (ReserveReply.token)
    transfer_id: str | None  # the attempt the KV receiver expects; None once not waiting for KV
    state: State  # where it is in its lifecycle (attempt_states.RESERVATION)
    watcher: asyncio.Task[None] | None = None  # follows that attempt's KV events
    retried: bool = False  # it already asked for its one retry
    streaming: bool = False  # the router reads its stream (else nobody would read an error there)
    ended_reported: str = ""  # the attempt last reported ended (prefill gave up on it): counted once


@dataclass(slots=True)
class _Counts:
    completed: int = 0
    timeouts: int = 0
    retried: int = 0
    recomputed: int = 0
    failed: int = 0
    rejected: int = 0
    prefilled_locally: int = 0
    lease_expired: int = 0


class DecodeService:
    def __init__(self, client: EngineClient, receiver: ReceiverView, failure_policy: FailurePolicy,
                 transfer_timeout_s: float, on_transfer: Callable[[TransferRecord], None] | None = None,
                 lease_s: float = 0.0) -> None:
        """`on_transfer` gets each finished transfer's duration and size (the metrics); `lease_s`
        bounds the time before the first payload (0: no bound)."""
        self.client = client
        self.receiver = receiver
        self.failure_policy = failure_policy
        self.transfer_timeout_s = transfer_timeout_s
        self.lease_s = lease_s
        self.draining = False
        self._requests: dict[str, _Reserved] = {}  # request id -> its record
        self._counts = _Counts()
        self._meter = TransferMeter(receiver.layout, on_transfer)  # per-transfer duration/bytes, TTFT phases
        self.steps = StepClock()  # this engine's recent step time, which keepalive answers announce

    @property
    def num_in_flight(self) -> int:
        return len(self._requests)

    def knows(self, rid: str) -> bool:
        """Whether request `rid` is reserved here (its frames can be streamed)."""
        return rid in self._requests

    def stats(self) -> DecodeStats:
        return DecodeStats(**dataclasses.asdict(self._counts), in_flight=self.num_in_flight,
                           kv_dtype_conversions=self.receiver.num_dtype_conversions)

    async def reserve(self, body: ReserveRequest) -> ReserveReply | None:
        """None when the pool has no room now (or the worker drains). Raises ValueError for a
        request that can never run."""
        rid, tid = body.request_id, body.transfer_id
        bind_request_id(rid)
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already reserved")
        if self.draining:
            return None
        stream: asyncio.Queue[StreamItem] = asyncio.Queue()
        token = secrets.token_hex(16)

        # NOTE: the engine side's receiver expects the transfer as the blocks are reserved, before
        # the router hears of the reservation, so before prefill can send (ReserveRemote)
        reservation = await self.client.send(
            ReserveRemote(rid, body.prompt_token_ids, body.params.build(), transfer_id=tid, token=token), stream)
        if reservation is None:
            return None
        record = self._requests[rid] = _Reserved(stream, reservation.block_ids, token, tid, State(RESERVATION, rid))
        record.watcher = asyncio.create_task(self._watch(rid, tid))
        return ReserveReply(block_ids=list(reservation.block_ids), num_cached_tokens=reservation.num_cached_tokens,
                            kv_address=self.receiver.kv_address, token=token)

    async def cached_prefix_tokens(self, prompt_token_ids: list[int]) -> int:
        """Leading tokens of this prompt the prefix cache holds now (prefix-affinity routing)."""
        return await self.client.send(CachedPrefixTokens(prompt_token_ids))

    def _waiting_for_kv(self, request_id: str) -> _Reserved | None:
        record = self._requests.get(request_id)
        return record if record is not None and record.state.is_in(*WAITING_FOR_KV) else None

    async def retarget(self, request_id: str, transfer_id: str, replaces: str = "") -> bool:
        """Expect a new attempt's KV (same blocks); the current attempt is cancelled. False when
        the request is not waiting for KV any more (finished, aborted, or already recomputing), or
        when it no longer expects `replaces` (given): another copy of this move came first, and
        its sender runs the new attempt. Returns once the receiver expects the new attempt (so
        before the router can send it)."""
        bind_request_id(request_id)  # the new watcher's log lines name the request
        record = self._waiting_for_kv(request_id)
        if record is None or record.transfer_id is None:
            return False
        if replaces and record.transfer_id != replaces:
            logger.info("request %s: attempt %s no longer expected (now %s); not replaced by %s", request_id,
                        replaces, record.transfer_id, transfer_id)
            return False
        if record.transfer_id == transfer_id:
            return True
        self.receiver.cancel(record.transfer_id)
        self.receiver.expect(transfer_id, list(record.block_ids), record.token)
        record.transfer_id = transfer_id
        record.state.move(Reservation.AWAITING_KV)
        if record.watcher is not None:
            record.watcher.cancel()
        record.watcher = asyncio.create_task(self._watch(request_id, transfer_id))
        logger.info("request %s: expecting KV from attempt %s", request_id, transfer_id)
        # NOTE: the engine process's receiver may not have it yet: the router dispatches the new
        # attempt once this answers, and its KV must find the receiver expecting it
        await self.receiver.settled()
        return True

    def keepalive_reply(self) -> KeepaliveReply:
        """The answer to a prefill worker's keepalive: this engine's recent step time. Its acks come
        from the KV receiver beside this engine, late when the engine's steps are long: the prefill
        side's waits on this worker scale with it (transport/cadence.py)."""
        self.steps.sample(self.client.last_step_s, self._computing())
        return KeepaliveReply(step_s=self.steps.step_s())

    def _computing(self) -> bool:
        """Some request here is decoding or being prefilled here: the engine steps."""
        return any(record.state.is_in(Reservation.DECODING, Reservation.PREFILLING_HERE)
                   for record in self._requests.values())

    def _busy(self) -> None:
        """A request is about to run in the engine: if none did, its first step runs from now, not
        from the end of the last one (idle since)."""
        if not self._computing():
            self.steps.busy()

    def touch(self, transfer_ids: list[str], step_s: float | None = None) -> None:
        """Keepalives from prefill workers: these attempts are still being computed, by an engine
        whose recent step time is `step_s` (None: not said), which scales their deadlines. The
        receiver ignores ids it does not expect (finished, cancelled or superseded attempts)."""
        for tid in transfer_ids:
            self.receiver.touch(tid, step_s)

    async def attempts_ended(self, transfer_ids: list[str]) -> None:
        """Attempts their prefill worker gave up on (its hand-off timed out): a request still
        waiting for one asks for a new attempt, as at its own transfer timeout (before any payload
        arrived only the lease would end the wait), or, having asked once, gets its failure policy."""
        for tid in transfer_ids:
            rid = request_id_of(tid)
            record = self._requests.get(rid)
            if record is None or record.transfer_id != tid or record.ended_reported == tid:
                continue  # done, superseded or ended meanwhile; or told already (its router and its prefill worker)
            record.ended_reported = tid
            bind_request_id(rid)
            if not self._retry_once(rid, tid, "its prefill worker gave up on the hand-off"):
                await self._apply_failure_policy(rid, "KV cache transfer timed out on the prefill side")

    async def fail(self, request_id: str, reason: str, transfer_id: str = "") -> bool:
        """End a request that is still waiting for its KV with an error (its prefill job was
        dead-lettered, or the prefill side gave up on attempt `transfer_id`; "": whatever attempt).
        False when it is not waiting any more, or for another attempt."""
        record = self._waiting_for_kv(request_id)
        if record is None or transfer_id not in ("", record.transfer_id):
            return False
        logger.warning("request %s: ended by its prefill side: %s", request_id, reason)
        self._counts.failed += 1
        self._end_with_error(request_id, reason)
        return True

    async def prefill_here(self, request_id: str) -> bool:
        """Conditional disaggregation: this worker computes the (short) uncached rest itself."""
        if (record := self._waiting_for_kv(request_id)) is None:
            return False
        self._busy()
        record.state.move(Reservation.PREFILLING_HERE)
        self._stop_receiving(request_id)
        self._counts.prefilled_locally += 1
        logger.info("request %s: prefilling its uncached rest on this decode worker (conditional disaggregation)",
                    request_id)  # NOTE: as counted (`pdserve:decode_local_prefills`)
        await self.receiver.settled()  # NOTE: no late payload of the attempt lands where this computes
        await self.client.send(PrefillLocally(request_id))
        return True

    async def stream(self, request_id: str) -> AsyncIterator[OutputFrame]:
        """The request's outputs; leaving early (router gone) aborts it and frees its blocks."""
        record = self._requests.get(request_id)
        if record is None:
            raise KeyError(request_id)
        record.streaming = True
        finished = False
        frames = FrameEncoder()  # what this stream sent: each frame is a delta (control.OutputFrame)
        try:
            while not finished:
                item = await record.stream.get()
                if isinstance(item, _RetrySignal):
                    yield frames.signal(kv_retry=True)
                    continue
                if isinstance(item, BaseException):
                    finished = True
                    if isinstance(item, EngineDeadError):
                        # NOTE: the worker goes away (its engine died): a stream broken off, so that the
                        # router resumes the request on another decode worker (or this one restarted)
                        logger.warning("request %s: the engine died; breaking its stream off", request_id)
                        return
                    yield frames.signal(error=str(item), finish_reason="abort")
                    return
                finished = item.finished
                frame = frames.frame(item)
                yield self._meter.annotate(request_id, frame)
        finally:
            if not finished:
                self.client.abort(request_id)
            self._forget(request_id)

    async def abort(self, request_id: str) -> None:
        record = self._requests.get(request_id)
        self._forget(request_id)  # NOTE: ended there
        self.client.abort(request_id)
        if record is not None:
            # NOTE: a request still waiting for its KV is not in the engine yet: no output would
            # ever end a stream of it that waits (GET /pd/stream, whose reader may be gone)
            record.stream.put_nowait(RequestFailedError(f"request {request_id}: aborted"))

    def close(self) -> None:
        self.receiver.close()

    def _stop_receiving(self, request_id: str) -> None:
        record = self._requests.get(request_id)
        if record is None:
            return
        if record.transfer_id is not None:
            self.receiver.cancel(record.transfer_id)
            record.transfer_id = None
        if record.watcher is not None and record.watcher is not asyncio.current_task():
            record.watcher.cancel()
        record.watcher = None

    def _forget(self, request_id: str) -> None:
        self._stop_receiving(request_id)
        if (record := self._requests.pop(request_id, None)) is not None and not record.state.ended:
            record.state.move(Reservation.ENDED)
        self._meter.forget(request_id)

    def _expects(self, rid: str, tid: str) -> bool:
        """Whether the request still waits for the KV of attempt `tid`."""
        record = self._waiting_for_kv(rid)
        return record is not None and record.transfer_id == tid

    async def _watch(self, rid: str, tid: str) -> None:
        started = False
        while True:
            try:
                # NOTE: before the first payload the job may be queued for, or computing on, a
                # prefill worker: only the (much longer) lease runs, and keepalives extend it.
                event = await self.receiver.wait(tid, self.transfer_timeout_s if started else
                                                 self.lease_s or _LIVENESS_POLL_S)
            except KVTransferTimeout as exc:
                if await self._keeps_watching_after_timeout(rid, tid, started, exc.limit_s):
                    continue
                return
            except KVTransferError:
                return  # cancelled: the request was aborted or retargeted
            if not self._expects(rid, tid):
                # NOTE: superseded (retargeted) or ended meanwhile, though this task may not have seen
                # its cancel: acting on the old attempt's KVDone would start decoding in blocks the
                # new attempt still writes into
                logger.info("request %s: ignoring %s of attempt %s, which it no longer expects", rid,
                            type(event).__name__, tid)
                return
            started = True
            if (record := self._requests.get(rid)) is not None and record.state.is_in(Reservation.AWAITING_KV):
                record.state.move(Reservation.RECEIVING)
            if isinstance(event, KVDone):
                await self._complete(rid, event)
                return
            self._meter.on_event(rid, event)
            if isinstance(event, KVRejected):
                self._counts.rejected += 1
                logger.warning("KV payload rejected for request %s: %s", rid, event.reason)
                await self._apply_failure_policy(rid, f"KV transfer rejected: {event.reason}")
                return

    async def _keeps_watching_after_timeout(self, rid: str, tid: str, started: bool, waited_s: float = 0.0) -> bool:
        """`_watch`'s wait timed out: whether it waits again (before the first payload with no lease,
        or a retried attempt), else the lease expired or the transfer failed."""
        if not self._expects(rid, tid):
            return False
        if not started:
            if self.lease_s:
                self._expire_lease(rid, tid)
                return False
            return True
        if self._retry_once(rid, tid, f"no progress for {1000 * (waited_s or self.transfer_timeout_s):.0f} ms"):
            return True
        await self._apply_failure_policy(rid, "KV cache transfer timed out")
        return False

    def _expire_lease(self, rid: str, tid: str) -> None:
        """No payload and no keepalive for the lease: nobody is computing this attempt (a lost job,
        a hung prefill worker, a router gone before it read the stream). Free the blocks."""
        self._counts.lease_expired += 1
        logger.warning("request %s: no KV and no keepalive from attempt %s for %g s (reservation lease); "
                       "freeing its blocks", rid, tid, self.lease_s)
        record = self._requests.get(rid)
        self._end_with_error(rid, f"no KV arrived within the reservation lease ({self.lease_s:g} s)")
        if record is not None and not record.streaming:
            self._forget(rid)  # nobody reads the error: drop the record too

    def _retry_once(self, rid: str, tid: str, why: str = "") -> bool:
        """A timeout: the first asks the router for a new attempt (True: keep listening meanwhile)."""
        self._counts.timeouts += 1
        record = self._requests.get(rid)
        retry = record is None or not record.retried
        why = why or f"no progress for {1000 * self.transfer_timeout_s:.0f} ms"
        logger.warning("KV cache transfer timed out: request %s (%s), %s%s", rid, tid, why,
                       "; asking for a new attempt" if retry else "")
        if not retry:
            return False
        self._counts.retried += 1
        if record is not None:
            record.retried = True
            record.state.move(Reservation.RETRY_ASKED)
            record.stream.put_nowait(_RETRY)
        return True

    async def _complete(self, rid: str, done: KVDone) -> None:
        self._counts.completed += 1
        record = self._requests.get(rid)
        self._busy()
        if record is not None:
            record.state.move(Reservation.DECODING)
            record.transfer_id = None  # received: nothing to cancel any more
            record.watcher = None
        try:
            handoff = HandOffDone.decode(done.record)  # HandOffError: malformed, or a newer version
            self._meter.on_done(rid, handoff.prefill_phases)
            prompt_logprobs = None if handoff.prompt_logprobs is None else unpack(handoff.prompt_logprobs)
            await self.client.send(CompleteRemote(rid, handoff.first_token_id, handoff.generator_state,
                                                   handoff.prefill_cached_tokens, prompt_logprobs,
                                                   handoff.lora_name, handoff.lora_digest))
        except ValueError as exc:  # the hand-off record is one this engine cannot take
            logger.warning("request %s: invalid hand-off: %s", rid, exc)
            await self._apply_failure_policy(rid, f"invalid hand-off: {exc}")

    async def _apply_failure_policy(self, rid: str, reason: str) -> None:
        self._stop_receiving(rid)
        if self.failure_policy == "recompute":
            self._busy()
            if (record := self._requests.get(rid)) is not None:
                record.state.move(Reservation.PREFILLING_HERE)
            self._counts.recomputed += 1
            logger.warning("request %s: %s; prefilling it on this decode worker", rid, reason)
            await self.receiver.settled()  # NOTE: no late payload of the attempt lands where this computes
            await self.client.send(PrefillLocally(rid))
            return
        self._counts.failed += 1
        self._end_with_error(rid, reason)

    def _end_with_error(self, rid: str, reason: str) -> None:
        self._stop_receiving(rid)
        record = self._requests.get(rid)
        self.client.abort(rid)
        if record is not None:
            if not record.state.ended:
                record.state.move(Reservation.ENDED)
            record.stream.put_nowait(KVTransferError(f"request {rid}: {reason}"))
