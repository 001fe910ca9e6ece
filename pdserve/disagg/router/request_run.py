"""One run of a request through the cluster: its decode reservation, its prefill attempts and
decode's outputs (router/core.py runs a request as one run, and one more after each decode loss).

A `RequestRun` is made by the router when the request is admitted (and for each resume) and every
step takes it: `dispatch_unplaced` (the prefill job before the reservation, where the queue can
place it later), `reserve` (blocks on a decode worker), `outputs` (prefilled on decode or through
the queue, then decode's stream, with prefill's early first token merged in). It is the listener
of its prefill attempts (queue/base.py `AttemptListener`) and holds all a run's state: the
prompt and parameters of this run, the decode worker and its reservation, the current attempt's
ticket, the early first token, a refusal for the client. What it uses of the router is
`RouterParts`, built once per router.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from http import HTTPStatus

from pdserve.disagg.attempt_states import RUN, Run, State
from pdserve.disagg.client import UnknownRequest, WorkerClient, WorkerDraining, WorkerRefused, WorkerUnreachable
from pdserve.disagg.config import RouterConfig
from pdserve.disagg.control import (
    FirstToken,
    FrameDecoder,
    FrameGap,
    OutputFrame,
    PrefillJob,
    ReserveReply,
    ReserveRequest,
    WireSamplingParams,
)
from pdserve.disagg.queue import PlacesLater, PrefillQueue, PrefillTicket, QueueUnavailable, Refusal, next_attempt
from pdserve.disagg.request_ids import run_id, transfer_id
from pdserve.disagg.router.admission import Admission
from pdserve.disagg.router.errors import RouterError
from pdserve.disagg.router.kv_index import KVEventsView, base_root
from pdserve.disagg.router.outputs import (
    AttemptFailed,
    DecodeLost,
    EarlyFirstToken,
    Inbox,
    early_first_token_wanted,
)
from pdserve.disagg.router.policy import DecodePolicy
from pdserve.disagg.router.pool import Worker, WorkerPool, reach
from pdserve.disagg.run_parts import placement, prefill_job, request_output
from pdserve.engine.output import RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.serving.trace import current_trace
from pdserve.tokenizer import Tokenizer

_RESERVE_RETRY_S = 0.05

Instance = tuple[str, str]  # which process a worker is: its URL and its instance id


@dataclasses.dataclass(slots=True)
class RunEvents:
    """The router's own event counts (RouterEvents, less what the queue counts)."""

    kv_retries: int = 0
    resumed: int = 0
    prefilled_on_decode: int = 0
    recovered_from_prefill_cache: int = 0  # resumes whose prompt KV a prefill worker had cached
    recovered_by_recompute: int = 0  # resumes whose prompt KV was computed again

    def count_recovery(self, prefill_cached_tokens: int) -> None:
        if prefill_cached_tokens > 0:
            self.recovered_from_prefill_cache += 1
        else:
            self.recovered_by_recompute += 1


@dataclasses.dataclass(frozen=True, slots=True)
class RouterParts:
    """What a run uses of its router."""

    config: RouterConfig
    tokenizer: Tokenizer
    max_model_len: int
    vocab_size: int
    pool: WorkerPool
    policy: DecodePolicy
    queue: PrefillQueue
    client: WorkerClient
    admission: Admission
    events: RunEvents
    placing: PlacesLater | None  # the queue's, asked once: None when every job goes placed
    # a prompt's hash root under its LoRA adapter (kv_index.py `lora_root`), for policies matching blocks
    lora_root: Callable[[str | None], bytes] = base_root
    prefill_view: KVEventsView | None = None  # --prefill-policy kv-events: the prefill workers' caches


def instance(worker: Worker) -> Instance:
    return worker.url, worker.info.instance_id if worker.info is not None else ""


class RequestRun:
    """One run of a request (module docstring). Used from the router's event loop only."""

    def __init__(self, parts: RouterParts, request_id: str, prompt: list[int], params: SamplingParams,
                 resume: int = 0) -> None:
        self.parts = parts
        self.rid = run_id(request_id, resume)
        self.prompt = prompt
        self.params = params
        self.recovering = resume > 0  # after a decode loss: counted by where the prompt's KV came from
        self._uncounted = self.recovering  # that count is still to be made (once, by the first attempt)
        self.early: EarlyFirstToken | None = None
        if parts.config.early_first_token and early_first_token_wanted(params):
            self.early = EarlyFirstToken(parts.tokenizer, parts.max_model_len, parts.vocab_size, self.rid, prompt,
                                         params, 0)
        self.decode: Worker | None = None
        self.reply: ReserveReply | None = None
        self.ticket: PrefillTicket | None = None  # the prefill attempt under way, if any
        self.placed = True  # whether `ticket`'s job names the reservation (else: sent before it was made)
        self.refusal: Refusal | None = None  # a prefill worker refused the job: what the client gets
        self.state = State(RUN, self.rid)  # where it is in its lifecycle (attempt_states.RUN)
        self.frames_in = FrameDecoder()  # decode's stream of this run: its delta frames made whole

    # -- what the queue tells it (AttemptListener) ------------------------------------------------

    @property
    def wants_first_token(self) -> bool:
        return self.early is not None

    def first_token(self, first: FirstToken) -> None:
        if self.early is not None:
            self.early.inbox.put_nowait(first)

    def handed_off(self, prefill_cached_tokens: int) -> None:
        self._count_recovery(prefill_cached_tokens)

    def refused(self, refusal: Refusal) -> None:
        self.refusal = refusal

    def _count_recovery(self, prefill_cached_tokens: int) -> None:
        if self._uncounted:
            self._uncounted = False
            self.parts.events.count_recovery(prefill_cached_tokens)

    # -- the steps ---------------------------------------------------------------------------------

    async def dispatch_unplaced(self) -> None:
        """The prefill job, sent before the reservation is made (placed by `outputs` once it is),
        where the queue allows it and the prompt is long enough to be prefilled there: prefill
        computes while decode reserves, and the reservation's round trip leaves the first token's
        path. Otherwise the job goes once the reservation is made."""
        if self.parts.placing is None or len(self.prompt) < self.parts.config.pd_threshold:
            return
        with self._fails():
            await self.dispatch(self._job(None))
        self.placed = False
        await asyncio.sleep(0)  # NOTE: the push (a task the queue started) goes out before the reservation

    async def reserve(self, exclude: set[Instance]) -> Worker:
        """Blocks for the prompt on the first decode worker (in the policy's order) with room, none
        of the instances in `exclude` (which lost the request before). A resumed run waits for a
        decode worker (a restarted one, a new one) until the deadline; a new one gets a 503 at once
        when none is ready. A job sent unplaced is cancelled if this fails. Returns the decode worker."""
        try:
            with self._fails():
                self.decode, self.reply = await self._reserve(exclude)
        except BaseException:
            if self.ticket is not None:
                await asyncio.shield(self.parts.queue.cancel(self.ticket))
            raise
        self.state.move(Run.PREFILLING)
        return self.decode

    @contextlib.contextmanager
    def _fails(self) -> Iterator[None]:
        """What raises in it ends the run: lost (DecodeLost: the router resumes it) or failed."""
        try:
            yield
        except BaseException as exc:
            if not self.state.ended:
                self.state.move(Run.LOST if isinstance(exc, DecodeLost) else Run.FAILED)
            raise

    async def _reserve(self, exclude: set[Instance]) -> tuple[Worker, ReserveReply]:
        parts = self.parts
        request = ReserveRequest(request_id=self.rid, transfer_id=transfer_id(self.rid, 0),
                                 prompt_token_ids=self.prompt, params=WireSamplingParams.of(self.params))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + parts.config.reserve_deadline_s
        window = loop.time() + parts.config.restart_window_s
        while True:
            candidates = [w for w in parts.pool.ready("decode") if instance(w) not in exclude]
            # NOTE: a resume waits whatever ended the run before: after a failed attempt `exclude` can
            # be empty while the decode worker that failed it is down (CI once got this 503 mid-stream);
            # a new run waits only while a decode worker is expected back, within the restart window
            waits = loop.time() <= deadline if self.recovering else \
                loop.time() <= window and parts.pool.expected_back("decode")
            if not candidates and not waits:
                parts.admission.reject("no_decode_worker", "no decode worker is ready")
            root = parts.lora_root(self.params.lora_name)
            for worker in await parts.policy.order(candidates, self.prompt, root=root):
                try:
                    reply = await reach(worker, parts.client.reserve(worker.url, request))
                except WorkerRefused as exc:
                    raise RouterError("decode_refused", exc.message) from exc
                except WorkerDraining:
                    worker.mark_draining()
                    continue
                if reply is not None:
                    worker.in_flight += 1
                    return worker, reply
            # NOTE: candidates that left meanwhile (draining, unreachable) had no "no room" to say: the
            # next round finds them gone
            if loop.time() > deadline and any(w.ready for w in candidates):
                parts.admission.reject("no_kv_room", "No decode worker has room for this request; try again later")
            await asyncio.sleep(_RESERVE_RETRY_S)

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """The run's outputs from its decode worker (after `reserve`), prefilled there or through
        the queue, whose prefill worker may send the first token before decode does (router/outputs.py).
        Raises DecodeLost if the worker goes away before the request ends; aborts the request on
        every worker if it ends early."""
        decode, reply = self._reservation()
        if self.early is not None:
            self.early.num_cached_tokens = reply.num_cached_tokens
        finished = False
        try:
            with self._fails():
                async for output in self._prefilled_and_decoded():
                    finished = output.finished
                    if finished or self.state.is_in(Run.PREFILLING):
                        self.state.move(Run.FINISHED if finished else Run.STREAMING)
                    yield output
                if not finished:
                    raise DecodeLost(f"decode worker {decode.url} ended the stream of {self.rid} early")
        finally:
            decode.in_flight -= 1
            if not finished:
                await asyncio.shield(self._abort())

    async def _prefilled_and_decoded(self) -> AsyncGenerator[RequestOutput, None]:
        placing: asyncio.Task[None] | None = None
        try:
            if not self.placed and self.early is not None and not self._prefill_here():
                # NOTE: the first token, if it comes first, is not held up by the placement's round
                # trip (which prefill's engine answers only between steps): it is placed
                # meanwhile, and whatever stops it reaches the request through the inbox
                placing = asyncio.create_task(self._place_beside())
            else:
                await self._start()
            async with contextlib.aclosing(self._source()) as items:
                async for item in items:
                    if (output := await self._output_of(item)) is not None:
                        yield output
        finally:
            if placing is not None and not placing.done():
                placing.cancel()

    def _reservation(self) -> tuple[Worker, ReserveReply]:
        if self.reply is None:
            raise RuntimeError(f"run {self.rid} has no decode reservation")
        return self._decode(), self.reply

    def _decode(self) -> Worker:
        if self.decode is None:
            raise RuntimeError(f"run {self.rid} has no decode worker")
        return self.decode

    def _source(self) -> AsyncGenerator[OutputFrame | FirstToken, None]:
        """Decode's frames, merged with prefill's first token where one can come before them."""
        if self.ticket is None:
            self.early = None  # prefilled on decode: the first token is decode's
        return self._frames(None if self.early is None else self.early.inbox)

    async def _output_of(self, item: OutputFrame | FirstToken) -> RequestOutput | None:
        """What to send the client for one item of `_source` (None: nothing)."""
        early = self.early
        if isinstance(item, FirstToken):
            return self._first_token_output(item)
        try:
            self.frames_in.check(item)
        except FrameGap as exc:
            raise RouterError("decode_broke", f"decode's stream of {self.rid} is broken: {exc}") from exc
        if item.kv_retry:
            self.parts.events.kv_retries += 1
            if self.ticket is not None:
                await self.retry_prefill()
            return None
        if item.error is not None:
            if self.ticket is not None and self.refusal is not None:
                raise self._refused()
            raise RouterError("kv_failed", item.error)
        if item.phases is not None and (early is None or early.sent is None):
            current_trace().record(item.phases)
        try:
            output = request_output(self.rid, self.prompt, item, self.frames_in)
        except FrameGap as exc:
            raise RouterError("decode_broke", f"decode's stream of {self.rid} is broken: {exc}") from exc
        if early is not None and early.after(output) is None:
            return None  # the token prefill sent already
        return output

    def _first_token_output(self, first: FirstToken) -> RequestOutput | None:
        """The output to send for a first token from prefill, if any (its TTFT phases recorded)."""
        early, ticket = self.early, self.ticket
        if early is None or ticket is None or (output := early.take(first, ticket.job.transfer_id)) is None:
            return None
        if (phases := early.phases(first)) is not None:
            current_trace().record(phases)
        return output

    def _refused(self) -> RouterError:
        refusal = self.refusal
        if refusal is None:
            raise RuntimeError(f"run {self.rid} was not refused")
        return RouterError("prefill_refused", refusal.message, refusal.status)

    def _prefill_here(self) -> bool:
        """Whether the decode worker prefills what it does not cache itself (conditional disaggregation)."""
        _, reply = self._reservation()
        return len(self.prompt) - reply.num_cached_tokens < self.parts.config.pd_threshold

    async def _start(self) -> None:
        """Have the prompt prefilled: by the decode worker (its uncached part is short), or through
        the queue (a job sent unplaced is placed now)."""
        if self._prefill_here():
            if self.ticket is not None:
                await self.parts.queue.cancel(self.ticket)
                self.ticket = None
            await self._prefill_on_decode()
            self._count_recovery(0)
            return
        if self.ticket is not None and not self.placed:
            if (error := await self._place()) is None:
                return
            if not isinstance(error, AttemptFailed):
                raise error
            # NOTE: its prefill worker lost the job before it was placed: sent again, placed
        await self.dispatch(self._job(self._reservation()))
        # NOTE: the push to prefill (a task the queue started) goes out before the stream is
        # opened: the job is on the first token's path, the stream only needed by then.
        await asyncio.sleep(0)

    def _job(self, reservation: tuple[Worker, ReserveReply] | None) -> PrefillJob:
        """This run's prefill job (attempt 0, run_parts.py), naming the decode reservation if there is one."""
        where = None
        if reservation is not None:
            decode, reply = reservation
            where = placement(transfer_id(self.rid, 0), decode.url, reply)
        return prefill_job(self.parts.client.secret, self.rid, self.prompt, self.params, where)

    async def _place(self) -> Exception | None:
        """Place the job sent unplaced. None once placed; else what stops it: a refusal, as the
        client's error, or AttemptFailed (the job lost before it was placed)."""
        ticket, placing = self.ticket, self.parts.placing
        if ticket is None or placing is None:
            raise RuntimeError(f"run {self.rid} has no job to place")
        decode, reply = self._reservation()
        try:
            if await placing.place(ticket, placement(ticket.job.transfer_id, decode.url, reply)):
                self.placed = True
                return None
        except WorkerRefused as exc:
            if exc.status >= HTTPStatus.INTERNAL_SERVER_ERROR:  # its failure, not the request's: go on elsewhere
                return AttemptFailed(f"prefill failed to place the job of {self.rid}: {exc.message}")
            return RouterError("prefill_refused", exc.message, exc.status)
        if self.refusal is not None:
            return self._refused()
        return AttemptFailed(f"prefill lost the job of {self.rid} before it was placed")

    async def _place_beside(self) -> None:
        """`_place` beside the request's stream: what stops it goes into the early first token's
        inbox (an error for the client; a failed attempt: the request resumes)."""
        if (error := await self._place()) is not None and self.early is not None:
            self.early.inbox.put_nowait(error)

    async def _prefill_on_decode(self) -> None:
        decode = self._decode()
        self.parts.events.prefilled_on_decode += 1
        current_trace().mark_left_router()
        if not await reach(decode, self.parts.client.prefill_here(decode.url, self.rid)):
            raise DecodeLost(f"decode worker {decode.url} did not take the prefill")

    async def dispatch(self, job: PrefillJob) -> PrefillTicket:
        """Queue a prefill attempt of this run (it becomes the current one). A resumed run's job
        goes where the prompt's KV is cached, if any prefill worker has it (re-sent instead of
        recomputed). With --prefill-policy kv-events, a first attempt goes where the prefill workers'
        events say most of the prompt is cached."""
        parts = self.parts
        affinity = self.recovering or parts.config.prefill_policy == "prefix-affinity"
        cached = None
        if parts.prefill_view is not None and not self.recovering:
            cached = parts.prefill_view.num_cached_tokens(parts.pool.ready("prefill"), job.prompt_token_ids,
                                                          parts.lora_root(self.params.lora_name))
        try:
            self.ticket = await parts.queue.put(job, prefix_affinity=affinity, cached_tokens=cached, listener=self)
        except QueueUnavailable as exc:
            self.parts.admission.reject("queue_unavailable", str(exc))
        return self.ticket

    async def retry_prefill(self) -> None:
        """The transfer stalled: a new attempt, once the decode worker expects it (if it no longer
        waits for KV, the stream says how the request ends)."""
        decode, ticket = self._decode(), self.ticket
        if ticket is None:
            return
        # NOTE: after the ticket's job, which the memory queue moves on when it re-queues the job
        # (its worker was lost): a retry numbered from the first attempt would reuse that id.
        retry = next_attempt(ticket.job)
        if not await reach(decode, self.parts.client.retarget(decode.url, retry.request_id, retry.transfer_id,
                                                              replaces=ticket.job.transfer_id)):
            return
        await self.parts.queue.cancel(ticket)
        # NOTE: a resume is counted once, by its first attempt: a retry would find in prefill's
        # cache the KV its stalled predecessor computed, which is no recovery from the cache
        self._count_recovery(0)
        await self.dispatch(retry)

    async def _frames(self, inbox: Inbox | None = None) -> AsyncGenerator[OutputFrame | FirstToken, None]:
        """Decode's frames (with `inbox`: merged with what lands there, prefill's first token)."""
        decode = self._decode()
        try:
            client = self.parts.client
            frames = client.stream(decode.url, self.rid) if inbox is None else \
                client.stream_merged(decode.url, self.rid, inbox)
            async with contextlib.aclosing(frames):
                async for frame in frames:
                    yield frame
        except UnknownRequest as exc:
            raise DecodeLost(str(exc)) from exc
        except WorkerUnreachable as exc:
            decode.mark_unreachable(exc)
            raise DecodeLost(f"decode worker {decode.url} failed mid-request: {exc.cause!r}") from exc

    async def _abort(self) -> None:
        decode = self._decode()
        if self.ticket is not None:
            await self.parts.queue.cancel(self.ticket)
        await reach(decode, self.parts.client.abort(decode.url, self.rid))
