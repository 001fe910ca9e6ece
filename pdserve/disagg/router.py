"""The PD router: makes P prefill and D decode workers look like one engine to the OpenAI handlers
(`router_app.py` serves it through `serving/app.py`), so it serves the same API as a colocated server.

It owns one of each piece and runs a request through them; none of them calls back into it:
  `pool.py` (workers, readiness, load), `admission.py` (400/429/503), `policy.py` (which decode
  worker), `queue/` (how the prefill job reaches a prefill worker), `client.py` (the /pd/* calls).

One request:
  0. admission: a request that can never run is a 400, before anything is queued; no ready
     prefill or decode worker, or the queue unreachable, is a 503; too many admitted requests
     still waiting for their first token is a 429.
  1. the decode policy orders the ready decode workers; reserve the prompt's blocks on the first
     with room (POST /pd/reserve). No room anywhere: wait and retry until `reserve_deadline_s`,
     then 503.
  2. conditional disaggregation: when what the decode worker does not already cache is shorter
     than `pd_threshold` tokens, it prefills that itself (POST /pd/prefill_here). Otherwise the
     prefill job goes onto the prefill queue.
  3. stream the decode worker's outputs (GET /pd/stream/{id}) back as RequestOutputs; the first
     token, where it is exactly what decode would send, comes from the prefill worker as soon as
     it is sampled (`early_first_token`, router_outputs.py), before decode has the KV. A
     `kv_retry` frame (the transfer stalled) makes a new prefill attempt. A decode worker lost
     mid-stream: the request resumes on another one, prefilled over prompt + tokens already sent
     (its job goes to the prefill worker whose cache, pool or disk tier, holds the prompt's KV:
     that worker re-sends it and computes only the sent tokens; `kv_recoveries` counts which),
     so the client sees no duplicated and no missing token (exact for greedy decoding; a sampled
     continuation is a fresh sample). No decode worker left: it waits for one (restarted, new) until
     `reserve_deadline_s`, then the error reaches the client.
  Until its first output the request runs under the first-token deadline (`first_token_timeout_s`):
  past it, a 503, and the request is aborted as below.
  Leaving early (client gone) aborts the request on every worker, which frees every block.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from http import HTTPStatus

from pdserve.config import RouterConfig
from pdserve.disagg.admission import Admission
from pdserve.disagg.auth import load_cluster_secret, sign_job
from pdserve.disagg.client import UnknownRequest, WorkerClient, WorkerRefused, WorkerUnreachable
from pdserve.disagg.control import (
    FirstToken,
    OutputFrame,
    Placement,
    PrefillJob,
    ReserveReply,
    ReserveRequest,
    WireSamplingParams,
    transfer_id,
)
from pdserve.disagg.membership import Membership, Registry
from pdserve.disagg.policy import DecodePolicy, make_decode_policy
from pdserve.disagg.pool import Worker, WorkerPool, reach
from pdserve.disagg.queue import PrefillQueue, PrefillTicket, QueueUnavailable, make_queue, next_attempt
from pdserve.disagg.router_outputs import (
    AttemptFailed,
    DecodeLost,
    EarlyFirstToken,
    Inbox,
    after_sent,
    continuation,
    early_first_token_wanted,
    merged,
    next_within,
    request_output,
)
from pdserve.engine.output import CompletionOutput, RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.model.qwen3_config import Qwen3ModelConfig
from pdserve.serving.errors import OpenAIError
from pdserve.serving.router_stats import Recoveries, RouterEvents, RouterStats, WorkerView
from pdserve.serving.trace import current_trace
from pdserve.tokenizer import Tokenizer

_next_within = next_within  # NOTE: its old name, which tests use
logger = logging.getLogger(__name__)
_RESERVE_RETRY_S = 0.05
_CONNECT_TIMEOUT_S = 5.0


@dataclasses.dataclass(slots=True)
class _Events:
    """The router's own event counts (RouterEvents, less what the queue counts)."""

    kv_retries: int = 0
    resumed: int = 0
    prefilled_on_decode: int = 0
    recovered_from_prefill_cache: int = 0  # resumes whose prompt KV a prefill worker had cached
    recovered_by_recompute: int = 0  # resumes whose prompt KV was computed again


class PDRouter:
    """EngineClient over remote workers (see serving/engine_client.py for the contract) and the
    RouterState serving/ reads (serving/router_stats.py). Used from one event loop."""

    def __init__(self, config: RouterConfig, tokenizer: Tokenizer, model_config: Qwen3ModelConfig, model_path: str,
                 max_model_len: int, *, pool: WorkerPool, queue: PrefillQueue, client: WorkerClient,
                 membership: Membership | None = None) -> None:
        config.validate()
        self.config = config
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.max_model_len = max_model_len
        self.pool = pool
        self.membership = membership or Membership(pool, config)
        self.queue = queue
        self.client = client
        self.vocab_size = model_config.vocab_size
        self.admission = Admission(config, pool, queue, max_model_len, model_config.vocab_size)
        self.policy: DecodePolicy = make_decode_policy(config.decode_policy, client)
        self._events = _Events()

    @classmethod
    def from_config(cls, config: RouterConfig, tokenizer: Tokenizer, model_config: Qwen3ModelConfig,
                    model_path: str, max_model_len: int) -> PDRouter:
        """The router with its client, pool (`config`'s members: URLs, DNS names, registrations)
        and queue (`config.queue`)."""
        # NOTE: no read timeout: a prefill job's POST answers once its hand-off ended, a stream
        # lasts as long as its request; until its first output, the first-token deadline bounds it.
        client = WorkerClient(timeout_s=None, connect_timeout_s=_CONNECT_TIMEOUT_S,
                              secret=load_cluster_secret(config.cluster_secret_file))
        pool = WorkerPool(client)
        registry = Registry(config.registration_ttl_s) if config.accept_registrations else None
        membership = Membership(pool, config, registry=registry)
        queue = make_queue(config.queue, pool, client)
        return cls(config, tokenizer, model_config, model_path, max_model_len, pool=pool, queue=queue, client=client,
                   membership=membership)

    @property
    def alive(self) -> bool:
        return not self.unready_reason

    @property
    def unready_reason(self) -> str:
        """Why a request would get a 503 now ("" when none): the queue is unreachable, or no
        prefill or no decode worker is ready (GET /ready, Kubernetes' readiness probe)."""
        if self.queue.error:
            return self.queue.error
        if not self.queue.ready:
            return "no prefill worker is ready"
        if not self.pool.any_ready("decode"):
            return "no decode worker is ready"
        return ""

    def workers(self) -> list[WorkerView]:
        return self.pool.views()

    def stats(self) -> RouterStats:
        queue = self.queue.stats()
        events = RouterEvents(kv_retries=self._events.kv_retries, redispatched=queue.num_redispatched,
                              resumed=self._events.resumed, prefilled_on_decode=self._events.prefilled_on_decode)
        return RouterStats(queued_requests=self.admission.num_queued, queued_tokens=self.admission.num_queued_tokens,
                           dispatch_pending=queue.num_pending, queue_backlog=queue.num_backlog, queue=queue.kind,
                           live_queue_consumers=queue.num_live_consumers, queue_error=queue.error,
                           rejections=self.admission.rejections(), events=events,
                           recoveries=Recoveries(self._events.recovered_from_prefill_cache,
                                                 self._events.recovered_by_recompute))

    async def refresh(self) -> None:
        """Update the membership, poll the pool (the heartbeat), then let the queue take another
        look at it."""
        await self.membership.refresh()
        await self.pool.refresh()
        await self.queue.refresh()

    async def watch(self, interval_s: float = 0.5) -> None:
        """Keep the view of the pool fresh (readiness and load) until cancelled. A round that fails
        unexpectedly is logged and the next one tried: a router that stopped watching would route
        on a stale pool (its /health says so only if this loop ends)."""
        while True:
            try:
                await self.refresh()
            except Exception:
                logger.exception("refreshing the worker pool failed; trying again")
            await asyncio.sleep(interval_s)

    async def close(self) -> None:
        await self.queue.close()
        await self.client.close()

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.admission.validate(prompt_token_ids, params)

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        self.validate_request(prompt_token_ids, params)
        self.admission.admit(len(prompt_token_ids))
        outputs = self._run(request_id, prompt_token_ids, params)
        try:
            try:
                first = await self._first_output(request_id, outputs)
            finally:
                self.admission.release(len(prompt_token_ids))
            if first is None:
                return
            yield first
            async for output in outputs:
                yield output
        finally:
            await outputs.aclose()

    async def _first_output(self, request_id: str,
                            outputs: AsyncGenerator[RequestOutput, None]) -> RequestOutput | None:
        """The request's first output, within the first-token deadline: past it, a 503 (counted as
        `first_token_timeout`), and the request is aborted on every worker (None: no output at all)."""
        # NOTE: the deadline cancels the generator wherever it waits (a reservation, the queue, a
        # prefill, a resume); its `finally` blocks abort the request on decode and cancel its job.
        try:
            return await next_within(outputs, self.config.first_token_timeout_s or None)
        except StopAsyncIteration:
            return None
        except TimeoutError:
            logger.warning("request %s: no first token within %g s; aborted", request_id,
                           self.config.first_token_timeout_s)
            self.admission.reject("first_token_timeout", f"no first token within the router's first-token deadline "
                                  f"({self.config.first_token_timeout_s:g} s)", HTTPStatus.SERVICE_UNAVAILABLE)

    async def _run(self, request_id: str, prompt: list[int],
                   params: SamplingParams) -> AsyncGenerator[RequestOutput, None]:
        """The request on one decode worker after another, until it finishes (n > 1: on one only)."""
        sent = CompletionOutput(0, "", [], logprobs=None if params.logprobs is None else [])  # out before a loss
        lost: set[tuple[str, str]] = set()  # (url, instance id) of the decode workers that lost it
        prompt_logprobs = None  # asked for: from the first frame that has them (prefill computed them)
        for resume in range(self.config.max_resumes + 1):
            sub_id = request_id if resume == 0 else f"{request_id}~{resume}"
            sub_prompt = prompt + sent.token_ids
            sub_params = continuation(self.tokenizer, params, sent.token_ids, sent.text)
            early = self._early_first_token(sub_id, sub_prompt, sub_params)
            ticket = await self._dispatch_unplaced(sub_id, sub_prompt, sub_params, early) if resume == 0 else None
            try:
                decode, reply = await self._reserve(sub_id, sub_prompt, sub_params, lost)
            except BaseException:
                if ticket is not None:
                    await asyncio.shield(self.queue.cancel(ticket))
                raise
            instance = _instance(decode)
            last: RequestOutput | None = None
            try:
                async for output in self._serve_on(decode, sub_id, sub_prompt, sub_params, reply, resume > 0, early,
                                                   ticket):
                    prompt_logprobs = prompt_logprobs or output.prompt_logprobs
                    if output.finished and prompt_logprobs is None and params.prompt_logprobs is not None:
                        raise OpenAIError(f"decode worker {decode.url} did not send the prompt's logprobs (an "
                                          "older version?)", HTTPStatus.BAD_GATEWAY)
                    last = after_sent(request_id, prompt, sent, output, prompt_logprobs)
                    yield last
                return
            except DecodeLost as exc:
                if not isinstance(exc, AttemptFailed):  # its worker is still there
                    lost.add(instance)
                if last is not None:
                    sent = last.outputs[0]
                # NOTE: n sequences that share a prompt's KV are not resumed one by one
                if resume == self.config.max_resumes or params.n > 1:
                    raise OpenAIError(str(exc), HTTPStatus.BAD_GATEWAY) from exc
                self._events.resumed += 1
                logger.warning("request %s: %s; resuming on another decode worker after %d tokens", request_id, exc,
                               len(sent.token_ids))

    async def _reserve(self, request_id: str, prompt: list[int], params: SamplingParams,
                       exclude: set[tuple[str, str]]) -> tuple[Worker, ReserveReply]:
        """Blocks for the prompt on the first decode worker (in the policy's order) with room, none
        of the instances in `exclude` (which lost it before). A request that resumes waits for a
        decode worker (a restarted one, a new one) until the deadline; a new one gets a 503 at once
        when none is ready."""
        request = ReserveRequest(request_id=request_id, transfer_id=transfer_id(request_id, 0),
                                 prompt_token_ids=prompt, params=WireSamplingParams.of(params))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.reserve_deadline_s
        while True:
            candidates = [w for w in self.pool.ready("decode") if _instance(w) not in exclude]
            if not candidates and (not exclude or loop.time() > deadline):
                self.admission.reject("no_decode_worker", "no decode worker is ready", HTTPStatus.SERVICE_UNAVAILABLE)
            for worker in await self.policy.order(candidates, prompt):
                try:
                    reply = await reach(worker, self.client.reserve(worker.url, request))
                except WorkerRefused as exc:
                    raise OpenAIError(exc.message, HTTPStatus.BAD_REQUEST) from exc
                if reply is not None:
                    worker.in_flight += 1
                    return worker, reply
            if loop.time() > deadline:
                self.admission.reject("no_kv_room", "No decode worker has room for this request; try again later",
                                      HTTPStatus.SERVICE_UNAVAILABLE)
            await asyncio.sleep(_RESERVE_RETRY_S)

    def _early_first_token(self, rid: str, prompt: list[int], params: SamplingParams) -> EarlyFirstToken | None:
        if not self.config.early_first_token or not early_first_token_wanted(params):
            return None
        return EarlyFirstToken(self.tokenizer, self.max_model_len, self.vocab_size, rid, prompt, params, 0)

    async def _dispatch_unplaced(self, rid: str, prompt: list[int], params: SamplingParams,
                                 early: EarlyFirstToken | None) -> PrefillTicket | None:
        """The prefill job, sent before the reservation is made (placed by `_start` once it is),
        where the queue allows it and the prompt is long enough to be prefilled there: prefill
        computes while decode reserves, and the reservation's round trip leaves the first token's
        path. None: the job goes once the reservation is made."""
        if not self.queue.places_later or len(prompt) < self.config.pd_threshold:
            return None
        job = PrefillJob(request_id=rid, transfer_id=transfer_id(rid, 0), prompt_token_ids=prompt,
                         params=WireSamplingParams.of(dataclasses.replace(params, n=1, logprobs=None)))
        ticket = await self._dispatch(sign_job(self.client.secret, job), recovering=False,
                                      on_first_token=None if early is None else early.inbox.put_nowait)
        await asyncio.sleep(0)  # NOTE: the push (a task the queue started) goes out before the reservation
        return ticket

    async def _serve_on(self, decode: Worker, rid: str, prompt: list[int], params: SamplingParams,
                        reply: ReserveReply, recovering: bool, early: EarlyFirstToken | None,
                        unplaced: PrefillTicket | None) -> AsyncIterator[RequestOutput]:
        """The request's outputs from `decode`, which holds its reservation; prefilled there or
        through the queue (`recovering`: after a decode loss, counted by where the prompt's KV
        came from; `unplaced`: its job, sent before the reservation), whose prefill worker may send
        the first token before decode does (`early`, router_outputs.py). Raises DecodeLost if the
        worker goes away before the request ends."""
        if early is not None:
            early.num_cached_tokens = reply.num_cached_tokens
        ticket: PrefillTicket | None = unplaced
        placing: asyncio.Task[None] | None = None
        finished = False
        try:
            if unplaced is not None and early is not None and not self._prefill_here(prompt, reply):
                # NOTE: the first token, if it comes first, is not held up by the placement's round
                # trip (which prefill's engine thread answers only between steps): it is placed
                # meanwhile, and whatever stops it reaches the request through the inbox
                placing = asyncio.create_task(self._place_beside(unplaced, decode, reply, early.inbox))
            else:
                ticket = await self._start(decode, rid, prompt, params, reply, recovering, early, unplaced)
            early = early if ticket is not None else None
            frames = self._frames(decode, rid)
            source: AsyncGenerator[OutputFrame | FirstToken, None] = frames if early is None else merged(
                frames, early.inbox)
            async with contextlib.aclosing(source) as items:
                async for item in items:
                    if isinstance(item, FirstToken):
                        if (first := _first_token(early, ticket, item)) is not None:
                            yield first
                        continue
                    if item.kv_retry:
                        self._events.kv_retries += 1
                        if ticket is not None:
                            ticket = await self._retry_prefill(decode, ticket)
                        continue
                    if item.error is not None:
                        if ticket is not None and ticket.refusal is not None:
                            raise OpenAIError(ticket.refusal.message, HTTPStatus(ticket.refusal.status))
                        raise OpenAIError(item.error, HTTPStatus.SERVICE_UNAVAILABLE)
                    if item.phases is not None and (early is None or early.sent is None):
                        current_trace().record(item.phases)
                    output = request_output(rid, prompt, item)
                    if early is not None and early.after(output) is None:
                        continue  # the token prefill sent already
                    finished = output.finished
                    yield output
            if not finished:
                raise DecodeLost(f"decode worker {decode.url} ended the stream of {rid} early")
        finally:
            decode.in_flight -= 1
            if placing is not None and not placing.done():
                placing.cancel()
            if not finished:
                await asyncio.shield(self._abort(rid, decode, ticket))

    async def _start(self, decode: Worker, rid: str, prompt: list[int], params: SamplingParams, reply: ReserveReply,
                     recovering: bool, early: EarlyFirstToken | None,
                     unplaced: PrefillTicket | None = None) -> PrefillTicket | None:
        """Have the prompt prefilled: by `decode` (its uncached part is short: None), or through the
        queue (its ticket; its first token, once sampled, goes to `early`; a job sent unplaced is
        placed now)."""
        if self._prefill_here(prompt, reply):
            if unplaced is not None:
                await self.queue.cancel(unplaced)
            await self._prefill_on_decode(decode, rid)
            if recovering:
                self._count_recovery(0)
            return None
        if unplaced is not None:
            if (error := await self._place(unplaced, decode, reply)) is None:
                return unplaced
            if not isinstance(error, AttemptFailed):
                raise error
            # NOTE: its prefill worker lost the job before it was placed: sent again, placed
        # NOTE: prefill computes the prompt's KV once for all n sequences; with n > 1 or logprobs,
        # decode samples the first tokens itself (LLMEngine.complete_remote)
        job = PrefillJob(request_id=rid, transfer_id=transfer_id(rid, 0), prompt_token_ids=prompt,
                         params=WireSamplingParams.of(dataclasses.replace(params, n=1, logprobs=None)),
                         kv_address=reply.kv_address, block_ids=reply.block_ids,
                         num_cached_tokens=reply.num_cached_tokens, decode_url=decode.url, token=reply.token)
        job = sign_job(self.client.secret, job)  # prefill acts only on jobs a cluster member signed
        ticket = await self._dispatch(job, recovering, count_recovery=recovering,
                                      on_first_token=None if early is None else early.inbox.put_nowait)
        # NOTE: the push to prefill (a task the queue started) goes out before the stream is
        # opened: the job is on the first token's path, the stream only needed by then.
        await asyncio.sleep(0)
        return ticket

    def _prefill_here(self, prompt: list[int], reply: ReserveReply) -> bool:
        """Whether the decode worker prefills what it does not cache itself (conditional disaggregation)."""
        return len(prompt) - reply.num_cached_tokens < self.config.pd_threshold

    async def _place(self, ticket: PrefillTicket, decode: Worker, reply: ReserveReply) -> Exception | None:
        """Place a job sent unplaced. None once placed; else what stops it: a refusal, as the
        client's error, or AttemptFailed (the job lost before it was placed)."""
        try:
            if await self.queue.place(ticket, _placement(ticket, decode, reply)):
                return None
        except WorkerRefused as exc:
            if exc.status >= HTTPStatus.INTERNAL_SERVER_ERROR:  # its failure, not the request's: go on elsewhere
                return AttemptFailed(f"prefill failed to place the job of {ticket.job.request_id}: {exc.message}")
            return OpenAIError(exc.message, HTTPStatus(exc.status))
        if ticket.refusal is not None:
            return OpenAIError(ticket.refusal.message, HTTPStatus(ticket.refusal.status))
        return AttemptFailed(f"prefill lost the job of {ticket.job.request_id} before it was placed")

    async def _place_beside(self, ticket: PrefillTicket, decode: Worker, reply: ReserveReply, inbox: Inbox) -> None:
        """`_place` beside the request's stream: what stops it goes into `inbox` (an error for the
        client; a failed attempt: the request resumes)."""
        if (error := await self._place(ticket, decode, reply)) is not None:
            inbox.put_nowait(error)

    async def _prefill_on_decode(self, decode: Worker, rid: str) -> None:
        self._events.prefilled_on_decode += 1
        current_trace().mark_left_router()
        if not await reach(decode, self.client.prefill_here(decode.url, rid)):
            raise DecodeLost(f"decode worker {decode.url} did not take the prefill")

    async def _dispatch(self, job: PrefillJob, recovering: bool, count_recovery: bool = False,
                        on_first_token: Callable[[FirstToken], None] | None = None) -> PrefillTicket:
        """Queue the job; a resume after a decode loss (`recovering`) goes where the prompt's KV is
        cached, if any prefill worker has it (re-sent instead of recomputed); `count_recovery`:
        counted by what its hand-off reports; `on_first_token`: hears the first token prefill sampled."""
        affinity = recovering or self.config.prefill_policy == "prefix-affinity"
        try:
            ticket = await self.queue.put(job, prefix_affinity=affinity)
        except QueueUnavailable as exc:
            self.admission.reject("queue_unavailable", str(exc), HTTPStatus.SERVICE_UNAVAILABLE)
        if count_recovery:  # NOTE: set before the next await: the hand-off cannot have ended yet
            ticket.on_handed_off = self._count_recovery
        ticket.on_first_token = on_first_token  # NOTE: likewise: the push reads it when it starts
        return ticket

    def _count_recovery(self, prefill_cached_tokens: int) -> None:
        if prefill_cached_tokens > 0:
            self._events.recovered_from_prefill_cache += 1
        else:
            self._events.recovered_by_recompute += 1

    async def _retry_prefill(self, decode: Worker, ticket: PrefillTicket) -> PrefillTicket:
        """The transfer stalled: a new attempt, once the decode worker expects it (if it no
        longer waits for KV, the stream says how the request ends)."""
        # NOTE: after the ticket's job, which the memory queue moves on when it re-queues the job
        # (its worker was lost): a retry numbered from the first attempt would reuse that id.
        retry = next_attempt(ticket.job)
        if not await reach(decode, self.client.retarget(decode.url, retry.request_id, retry.transfer_id)):
            return ticket
        await self.queue.cancel(ticket)
        recovering = ticket.on_handed_off is not None
        if recovering:
            # NOTE: a resume is counted once, by its first attempt: a retry would find in prefill's
            # cache the KV its stalled predecessor computed, which is no recovery from the cache
            ticket.on_handed_off = None
            self._count_recovery(0)
        return await self._dispatch(retry, recovering, on_first_token=ticket.on_first_token)

    async def _frames(self, decode: Worker, request_id: str) -> AsyncGenerator[OutputFrame, None]:
        try:
            async with contextlib.aclosing(self.client.stream(decode.url, request_id)) as frames:
                async for frame in frames:
                    yield frame
        except UnknownRequest as exc:
            raise DecodeLost(str(exc)) from exc
        except WorkerUnreachable as exc:
            decode.mark_unreachable(exc)
            raise DecodeLost(f"decode worker {decode.url} failed mid-request: {exc.cause!r}") from exc

    async def _abort(self, request_id: str, decode: Worker, ticket: PrefillTicket | None) -> None:
        if ticket is not None:
            await self.queue.cancel(ticket)
        await reach(decode, self.client.abort(decode.url, request_id))


def _instance(worker: Worker) -> tuple[str, str]:
    """Which process a worker is: its URL and the instance id of its last /pd/info answer."""
    return worker.url, worker.info.instance_id if worker.info is not None else ""


def _placement(ticket: PrefillTicket, decode: Worker, reply: ReserveReply) -> Placement:
    return Placement(transfer_id=ticket.job.transfer_id, decode_url=decode.url, kv_address=reply.kv_address,
                     block_ids=reply.block_ids, num_cached_tokens=reply.num_cached_tokens, token=reply.token)


def _first_token(early: EarlyFirstToken | None, ticket: PrefillTicket | None,
                 first: FirstToken) -> RequestOutput | None:
    """The output to send for a first token from prefill, if any (its TTFT phases recorded)."""
    if early is None or ticket is None or (output := early.take(first, ticket.job.transfer_id)) is None:
        return None
    if (phases := early.phases(first)) is not None:
        current_trace().record(phases)
    return output
