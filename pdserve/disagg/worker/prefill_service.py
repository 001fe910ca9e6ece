"""Prefill role: take a job, compute the prompt in chunks, stream each layer's KV into the decode
worker's reservation as soon as it is computed, send the first token (and the seeded sampler's
state) with the final message, then release the blocks once decode acknowledged everything.

While it holds a job, the service tells the job's decode worker every `transfer_timeout_s / 2`
that the attempt is still being worked on, and how long the engine's steps take lately (POST
/pd/alive: worker/prefill_keepalives.py), so a long chunk on a busy machine is not taken for a
dead peer.

Each job is one attempt (`job.transfer_id`): the id the engine, the streamer and the transport use
here, so a retried request never collides with its earlier attempt. One `PrefillAttempt` record per
attempt (`_attempts`, keyed by transfer id), created when the engine took the job and removed when
its hand-off ended; its `state` moves through attempt_states.ATTEMPT (computing, handing_off,
then how it ended: handed_off, timed_out, failed, aborted). `run` returns how the hand-off ended
(`HandOff`), which is what the router, or the queue consumer, acknowledges. The first token is
known before that (`first_token`): POST /pd/prefill streams it to a router that asked, before the
final message goes to decode.

The streaming itself is the engine's layer observer (`KVStreamer`), called on the engine thread
right after each layer; the transport moves the bytes on its own I/O thread meanwhile. Where an
attempt's KV goes (its sender, its decode blocks) lives in the streamer, on the engine side: the
service names it in the engine commands (`KVTarget`, its sender by handle) and drives the hand-off
through `SenderHandles` (disagg/worker/kv_side.py), the same calls whether the engine runs on a thread of
this process or in an engine process of its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

from pdserve.disagg.attempt_states import ATTEMPT, Attempt, State
from pdserve.disagg.auth import ClusterSecret, verify_job, verify_placement
from pdserve.disagg.control import FirstToken, HandOff, Placement, PrefillJob
from pdserve.disagg.handoff import HandOffDone
from pdserve.disagg.phases import PrefillPhases
from pdserve.disagg.prompt_logprobs_wire import pack
from pdserve.disagg.transport.cadence import FIRST_CONTACT_S, Cadence
from pdserve.disagg.transport.errors import KVTransferError, KVTransferTimeout
from pdserve.disagg.transport.progress import TIMEOUT_MESSAGE
from pdserve.disagg.worker.kv_side import SenderHandles
from pdserve.disagg.worker.prefill_attempt import PrefillAttempt
from pdserve.disagg.worker.prefill_keepalives import DecodeKeepalives
from pdserve.disagg.worker.stats import PrefillStats
from pdserve.engine.async_llm import EngineClient, EngineDeadError, OutputStream, RequestFailedError
from pdserve.engine.commands import AddPrefillOnly, CachedPrefixTokens, GeneratorState, ListLoRAs, PlaceKV, ReleaseKV
from pdserve.engine.kv_transfer import KVTarget
from pdserve.engine.lora_manager import lora_info
from pdserve.engine.output import RequestOutput
from pdserve.logs import bind_request_id

logger = logging.getLogger(__name__)
_CONNECT_WAIT_S = 10.0  # a named placement whose sender connects to its decode worker (`_placement`)
HELD_PLACEMENT_S = 30.0  # an unplaced job whose router still listens (`held_open`): the router's reserve deadline
_MAX_ABORTS_KEPT = 1024  # aborts of attempts not running here, kept for one that is still coming (`abort`)


@dataclass(slots=True)
class _Counts:
    handed_off: int = 0
    failed: int = 0
    aborted: int = 0
    duplicates: int = 0
    timed_out: int = 0


_ENDED_KEPT = 4096  # ended attempts remembered, so a late copy of one is recognised (not run again)


class PrefillService:
    def __init__(self, client: EngineClient, kv: SenderHandles, transfer_timeout_s: float,
                 secret: ClusterSecret | None = None, *, placement_timeout_s: float = 1.0) -> None:
        """`kv` must be the engine side of `client`'s engine (`KVTransferSetup.stream_targets`); with
        a cluster `secret`, a job must carry the router's signature (auth.py) and keepalives are signed.
        `placement_timeout_s`: how long a job sent unplaced waits for its decode reservation."""
        self.client = client
        self.secret = secret
        self.kv = kv
        self.transfer_timeout_s = transfer_timeout_s
        self.placement_timeout_s = max(placement_timeout_s, transfer_timeout_s)  # NOTE: never less than that
        # how long unplaced jobs wait for their placement lately (before the first: FIRST_CONTACT_S)
        self.placements = Cadence(first_contact_s=FIRST_CONTACT_S)
        self.draining = False
        self._attempts: dict[str, PrefillAttempt] = {}  # transfer id -> its record
        self._submitting: dict[str, str] = {}  # transfer id -> its decode URL, while the engine takes the job
        self._aborts_kept: OrderedDict[str, None] = OrderedDict()  # aborted transfer ids with no record, oldest first
        self._ended: OrderedDict[str, HandOff] = OrderedDict()  # how recent attempts ended, oldest first
        self._counts = _Counts()
        # the keepalives, and the step times decode workers answer them with: the floor of the waits
        # on each (its acknowledgements, a placement)
        self.keepalives = DecodeKeepalives(client, transfer_timeout_s, secret,
                                           (lambda: bool(self._attempts or self._submitting),
                                            self._keepalive_targets, self._computing))

    @property
    def num_in_flight(self) -> int:
        return len(self._attempts)

    @property
    def num_in_flight_tokens(self) -> int:
        """Prompt tokens of the jobs taken and not yet handed off (what a queue consumer budgets)."""
        return sum(attempt.num_uncomputed_tokens for attempt in self._attempts.values())

    def stats(self) -> PrefillStats:
        return PrefillStats(**dataclasses.asdict(self._counts), in_flight=self.num_in_flight)

    async def run(self, job: PrefillJob) -> HandOff:
        """Accept a job and wait until its hand-off ended. Raises ValueError (bad job) or
        KVLayoutMismatch/KVTransferError (decode worker unusable) before anything is computed."""
        task = await self.submit(job)
        return await asyncio.shield(task)

    async def submit(self, job: PrefillJob) -> asyncio.Task[HandOff]:
        """Accept a job: raises ValueError (bad job) or KVLayoutMismatch/KVTransferError (decode
        worker unusable) before anything is computed. The task ends with the hand-off. A copy of
        an attempt that runs or ended here (`holds`) gets that attempt's task: nothing runs twice."""
        bind_request_id(job.request_id)
        verify_job(self.secret, job)  # NOTE: before anything connects to an address the job names
        params = job.params.build()
        tid = job.transfer_id
        if self.holds(tid):
            return self._again(tid)
        sender = await self.kv.connect(job.kv_address) if job.placed else None
        stream: OutputStream = asyncio.Queue()
        # NOTE: the streamer learns where the attempt's KV goes on the engine side just before the
        # engine takes the request (an unplaced job: that it has nowhere to go yet, `place`), and
        # forgets it there after its blocks are released (`_release`): every layer the engine
        # computes of it is streamed, and never after it is forgotten.
        target = None if sender is None else KVTarget(tuple(job.block_ids), job.num_cached_tokens, sender,
                                                      job.kv_address, job.token)
        lora = None if params.lora_name is None else asyncio.ensure_future(self._lora_of(params.lora_name))
        if lora is not None:  # NOTE: a job the engine refuses leaves it to end on its own, quietly
            lora.add_done_callback(lambda done: done.cancelled() or done.exception())
        if not self._computing():
            self.keepalives.steps.busy()  # NOTE: its first step runs from now, not from the last one's end (idle since)
        # NOTE: an engine process answers a command after the step that follows it (core_proc.py): the
        # job's first chunk (a short prompt: all of it) is computed while this awaits, and the
        # keepalives, with the running step's age, must flow meanwhile
        self._submitting[tid] = job.decode_url
        self.keepalives.start()
        try:
            await self.client.send(AddPrefillOnly(tid, job.prompt_token_ids, params, target), stream)
        finally:
            del self._submitting[tid]
        task = asyncio.create_task(self._finish(tid, stream))
        attempt = self._attempts[tid] = PrefillAttempt(task, job.decode_url,
                                                       len(job.prompt_token_ids) - job.num_cached_tokens, job.token,
                                                       State(ATTEMPT, tid), seeded=params.seed is not None, lora=lora)
        if tid in self._aborts_kept:  # NOTE: its abort came first (while the engine took it, or before)
            del self._aborts_kept[tid]
            attempt.aborted = True
        if sender is not None:
            attempt.placed.set_result(sender)
        self.keepalives.start()
        return task

    def holds(self, transfer_id: str) -> bool:
        """Whether this attempt runs here or ended here lately: another delivery of it is a copy."""
        return transfer_id in self._attempts or transfer_id in self._ended

    def _again(self, tid: str) -> asyncio.Task[HandOff]:
        """A copy of an attempt that runs or ended here (a re-delivered or duplicated job): nothing
        runs again; the copy's task ends as the attempt does (did)."""
        self._counts.duplicates += 1
        logger.info("attempt %s was delivered again; it %s here, not run twice", tid,
                    "runs" if tid in self._attempts else "ended")
        if tid in self._attempts:
            return self._attempts[tid].task
        ended = self._ended[tid]

        async def same() -> HandOff:
            return ended
        return asyncio.create_task(same())

    async def place(self, placement: Placement) -> None:
        """An unplaced job's decode reservation: its KV computed so far goes now, the rest as it is
        computed. Raises KeyError (no such attempt here any more), ValueError (bad or repeated
        placement), KVLayoutMismatch/KVTransferError (decode worker unusable)."""
        tid = placement.transfer_id
        bind_request_id(tid)  # NOTE: its log lines (and a 500) name the attempt
        verify_placement(self.secret, placement)
        attempt = self._attempts.get(tid)
        if attempt is None:
            raise KeyError(tid)
        if attempt.placed.done():
            raise ValueError(f"attempt {tid!r} is placed already")
        attempt.connecting = asyncio.ensure_future(self.kv.connect(placement.kv_address))
        try:
            sender = await attempt.connecting
        finally:
            attempt.connecting = None
        target = KVTarget(tuple(placement.block_ids), placement.num_cached_tokens, sender, placement.kv_address,
                          placement.token)
        if self._attempts.get(tid) is not attempt or attempt.placed.done():
            raise KeyError(tid)  # NOTE: it ended (or was placed) while the sender connected
        attempt.placing = sender
        if not await self.client.send(PlaceKV(tid, target)) \
                or self._attempts.get(tid) is not attempt or attempt.placed.done():
            # NOTE: it ended before the engine took the placement, or while the answer came back
            # (an abort): its end released its blocks through `placing`
            raise KeyError(tid)
        attempt.decode_url, attempt.token = placement.decode_url, placement.token
        attempt.num_uncomputed_tokens = max(0, attempt.num_uncomputed_tokens - placement.num_cached_tokens)
        attempt.placed.set_result(sender)

    def _computing(self) -> bool:
        """Some attempt here is still being computed (its first token not out yet, or the engine not
        done taking it): a step runs."""
        return bool(self._submitting) or any(not attempt.first_token.done() for attempt in self._attempts.values())

    def _keepalive_targets(self) -> dict[str, list[str]]:
        """The attempts to keep alive, by their decode worker's URL (taking the job, or taken)."""
        by_decode: dict[str, list[str]] = {}
        for tid, attempt in self._attempts.items():
            if attempt.decode_url:
                by_decode.setdefault(attempt.decode_url, []).append(tid)
        for tid, decode_url in self._submitting.items():
            if decode_url:
                by_decode.setdefault(decode_url, []).append(tid)
        return by_decode

    def first_token(self, transfer_id: str) -> asyncio.Future[FirstToken | None]:
        """The attempt's first token, as soon as it is sampled (None: it ended without one: see its
        hand-off). Ask before the first await after `submit` (the record goes when the hand-off ends;
        an attempt that ended already, delivered again, has none to give: None)."""
        attempt = self._attempts.get(transfer_id)
        if attempt is not None:
            return attempt.first_token
        none: asyncio.Future[FirstToken | None] = asyncio.get_running_loop().create_future()
        none.set_result(None)
        return none

    def held_open(self, transfer_id: str) -> asyncio.Future[None]:
        """A future to complete once the router's stream of the job closes. Until then an unplaced
        attempt waits for its placement past the placement timeout, at most HELD_PLACEMENT_S: a router
        that listens is still reserving (a busy decode worker answers late) and places or cancels."""
        held = asyncio.get_running_loop().create_future()
        if (attempt := self._attempts.get(transfer_id)) is not None:
            attempt.held = held
        return held

    async def cached_prefix_tokens(self, prompt_token_ids: list[int]) -> int:
        """Leading tokens of this prompt the prefix cache (pool, disk tier) holds now (prefix-affinity
        placement of prefill jobs: memory queue)."""
        return await self.client.send(CachedPrefixTokens(prompt_token_ids))

    async def abort(self, transfer_id: str) -> None:
        """End the attempt as aborted, its blocks released, wherever it is in its life.
        NOTE: a task cancelled before its first step never runs its body, the `finally` that
        releases included: the engine request and its blocks stayed held for good, and POST
        /pd/prefill's answer was cut short. Until then the abort is noted, and the task, when it
        starts, ends at once as a cancelled one does. An abort of an attempt with no record here
        is kept (the last `_MAX_ABORTS_KEPT`): its job may still come (two POSTs from the router,
        on two connections, in either order) or be handed to the engine now (`submit`)."""
        attempt = self._attempts.get(transfer_id)
        if attempt is None:
            self._aborts_kept[transfer_id] = None
            while len(self._aborts_kept) > _MAX_ABORTS_KEPT:
                self._aborts_kept.popitem(last=False)
        elif attempt.started:
            attempt.task.cancel()
        else:
            attempt.aborted = True

    async def _finish(self, tid: str, stream: OutputStream) -> HandOff:
        """`_hand_off_when_done`, the attempt's state moved to how it ended (attempt_states.ATTEMPT)."""
        attempt = self._attempts.get(tid)  # NOTE: made in the same turn as this task: there
        if attempt is not None:
            attempt.started = True
        hand_off = await self._hand_off_when_done(tid, stream, attempt is not None and attempt.aborted)
        if attempt is not None:
            attempt.state.move(Attempt(hand_off.status))
        self._ended[tid] = hand_off
        while len(self._ended) > _ENDED_KEPT:
            self._ended.popitem(last=False)
        return hand_off

    async def _hand_off_when_done(self, tid: str, stream: OutputStream, aborted: bool) -> HandOff:
        """Wait for the first token (and tell whoever follows the attempt), for the placement of
        an unplaced job, send the final message, wait for decode's acknowledgement, release the
        blocks. Whatever happens (abort, rejection, timeout), the blocks are released when it
        ends: the lease is the transfer timeout (a placement that does not come within it too).
        `aborted`: aborted before it started (`abort`): it ends as a cancelled one does."""
        try:
            if aborted:
                raise asyncio.CancelledError
            final = None
            async for output in self.client.consume(tid, stream):
                final = output
            if final is None or final.outputs[0].finish_reason == "abort" or not final.outputs[0].token_ids:
                return HandOff(transfer_id=tid, status="aborted")
            attempt = self._attempts.get(tid)
            # NOTE: an unseeded request has no generator (Request.generator): no round trip to the
            # engine thread for its state on the first token's path
            state = await self.client.send(GeneratorState(tid)) if attempt is None or attempt.seeded else None
            self._first_token_out(tid, final)  # NOTE: once all is known that decode needs to go on from it
            handle = await self._placement(tid)
            if attempt is not None:
                attempt.state.move(Attempt.HANDING_OFF)
            await self._hand_off(tid, handle, final, state)
            self._counts.handed_off += 1
            return HandOff(transfer_id=tid, status="handed_off", prefill_cached_tokens=final.num_cached_tokens)
        except KVTransferTimeout as exc:  # decode is told: it may have no clock running (nothing arrived)
            self._report_ended(tid)
            return self._failed(tid, "timed_out", exc)
        except (KVTransferError, RequestFailedError, EngineDeadError) as exc:  # decode is told at once
            return self._failed(tid, "failed", exc)
        except Exception as exc:  # unexpected, but reported like the others: never lost in this task
            logger.exception("request %s: prefill failed", tid)
            return self._failed(tid, "failed", exc)
        except asyncio.CancelledError:
            self._counts.aborted += 1
            return HandOff(transfer_id=tid, status="aborted")
        finally:
            await asyncio.shield(self._release(tid, self._settle_attempt(tid)))

    def _settle_attempt(self, tid: str) -> int | None:
        """The attempt ended: forget it, settle its futures, and say which sender (if any) its
        blocks wait on."""
        attempt = self._attempts.pop(tid, None)
        sender = None
        if attempt is not None:
            if not attempt.first_token.done():
                attempt.first_token.set_result(None)
            if attempt.placed.done():
                sender = attempt.placed.result()
            else:
                attempt.placed.cancel()
                sender = attempt.placing
        return sender

    def _report_ended(self, tid: str) -> None:
        """The attempt will not hand off (its blocks go now, and with them what was not sent): its
        decode worker stops waiting for it, told beside the release."""
        attempt = self._attempts.get(tid)
        if attempt is not None and attempt.decode_url:
            self.keepalives.report_ended(attempt.decode_url, tid)

    def _first_token_out(self, tid: str, final: RequestOutput) -> None:
        """Whoever follows the attempt (POST /pd/prefill's streamed answer) learns its first token now."""
        attempt = self._attempts.get(tid)
        if attempt is None or attempt.first_token.done():
            return
        phases = PrefillPhases.of(final.metrics)
        attempt.first_token.set_result(FirstToken(
            transfer_id=tid, token_id=final.outputs[0].token_ids[0], prefill_cached_tokens=final.num_cached_tokens,
            prefill_queue_s=None if phases is None else phases.queue_s,
            prefill_compute_s=None if phases is None else phases.compute_s))

    def _failed(self, tid: str, status: Literal["failed", "timed_out"], exc: Exception) -> HandOff:
        """Counted, logged, answered. While this worker drains (stopped on purpose: it left the
        pool, its routers fail its jobs over, and a decode worker drops an attempt the router
        cancelled for it) a failed hand-off is INFO, not a WARNING; it is counted all the same."""
        self._counts.failed += 1
        self._counts.timed_out += status == "timed_out"
        logger.log(logging.INFO if self.draining else logging.WARNING, "request %s: %s%s", tid, exc,
                   " (this worker is stopping)" if self.draining else "")
        return HandOff(transfer_id=tid, status=status, reason=str(exc) or repr(exc))

    async def _placement(self, tid: str) -> int:
        """The attempt's sender once it is placed (KVTransferTimeout: not named within the placement
        timeout of the first token, or while its router listens (`held_open`); a reservation that
        takes longer, its router waiting for room, has the router send the job again, placed)."""
        attempt = self._attempts.get(tid)
        if attempt is None:
            raise KVTransferError(f"request {tid}: ended before it was placed")
        placed = attempt.placed
        # NOTE: a reservation waits for a step boundary of the decode engine: its step time counts
        limit_s = self.placements.timeout_s(self.keepalives.floor_s(self.placement_timeout_s))
        if not placed.done():
            waited = time.monotonic()
            await asyncio.wait((placed,), timeout=limit_s)
            if not placed.done() and attempt.held is not None and not attempt.held.done():
                await asyncio.wait((placed, attempt.held), timeout=HELD_PLACEMENT_S,
                                   return_when=asyncio.FIRST_COMPLETED)
            # NOTE: how long placements take lately (a busy decode worker reserves slowly) sets the
            # next wait, the configured timeout only its floor (transport/cadence.py)
            self.placements.saw(time.monotonic() - waited)
        if not placed.done() and (connecting := attempt.connecting) is not None:
            # NOTE: the reservation was named in time, and its sender still connects: the first
            # placement to a decode worker (at start-up) does the KV handshake, which took the
            # transfer timeout and more on a loaded machine and failed the first request. The
            # handshake has its bound; the engine then takes the placement within the timeout.
            await asyncio.wait((connecting,), timeout=_CONNECT_WAIT_S)
            await asyncio.wait((placed,), timeout=self.transfer_timeout_s)
        if not placed.done() or placed.cancelled():
            # NOTE: the stable message, as every timeout this worker counts (`pdserve:kv_transfer_timeouts`)
            raise KVTransferTimeout(f"{TIMEOUT_MESSAGE}: no decode reservation named for request {tid} "
                                    f"within {limit_s:g} s", limit_s)
        return placed.result()

    async def _hand_off(self, tid: str, sender: int, final: RequestOutput, state: bytes | None) -> None:
        """The first token is out: send the final message, wait until decode acknowledged it all."""
        attempt = self._attempts.get(tid)
        if attempt is not None:
            attempt.num_uncomputed_tokens = 0
        lora_name, lora_digest = (None, "") if attempt is None or attempt.lora is None else await attempt.lora
        record = HandOffDone(final.outputs[0].token_ids[0], state, PrefillPhases.of(final.metrics),
                             prefill_cached_tokens=final.num_cached_tokens,
                             prompt_logprobs=None if final.prompt_logprobs is None else pack(final.prompt_logprobs),
                             lora_name=lora_name, lora_digest=lora_digest)
        self.kv.send_done(sender, tid, record.encode(), token="" if attempt is None else attempt.token)
        # NOTE: decode acknowledges from beside its engine: late when its steps are long (a floor of
        # FACTOR times the step time it announced), not gone
        decode_url = "" if attempt is None else attempt.decode_url
        await self.kv.flush(sender, tid, self.keepalives.floor_s(self.transfer_timeout_s, decode_url))

    async def _lora_of(self, name: str) -> tuple[str | None, str]:
        """LoRA adapter `name` and its weights' digest in this engine."""
        infos = [lora_info(value) for value in await self.client.send(ListLoRAs())]
        return name, next((info.digest for info in infos if info.name == name), "")

    async def _release(self, tid: str, sender: int | None) -> None:
        """Free the attempt's blocks, but only once the transport no longer reads them: after a
        failed or abandoned hand-off, a send still queued must not read blocks that another
        request reuses (decode would get wrong KV and never know). No sender: nothing was sent."""
        try:
            if sender is not None:
                await self.kv.release(sender, tid)
        except KVTransferError as exc:  # a send stuck reading them: better to leak than to corrupt
            logger.error("request %s: not freeing its KV blocks: %s", tid, exc)
            return
        try:
            await self.client.send(ReleaseKV(tid))
        except EngineDeadError:  # nothing to free any more: the worker is going away
            logger.info("request %s: engine dead, its KV blocks stay with it", tid)

    def close(self) -> None:
        self.keepalives.close()
        self.kv.close()
