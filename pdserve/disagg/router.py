"""The router's engine client: makes P prefill and D decode workers look like one engine to the
OpenAI handlers (`serving/app.py`), so the router serves the same API as a colocated server.

One request:
  0. admission: a prompt that cannot fit is a 400 (before anything is queued); no ready prefill
     or decode worker, or the queue's Redis unreachable, is a 503; more than `max_queued_requests`
     requests (or `max_queued_tokens` prompt tokens) admitted and still waiting for their first
     token is a 429 with Retry-After. Every rejection is counted by reason.
  1. pick a decode worker (`decode_policy`: least-loaded, round-robin or prefix-affinity) and
     reserve the prompt's blocks there (POST /pd/reserve). No room anywhere: wait and retry until
     `reserve_deadline_s`, then 503.
  2. conditional disaggregation: when what the decode worker does not already cache is shorter
     than `pd_threshold` tokens, it prefills that itself (POST /pd/prefill_here). Otherwise the
     prefill job goes to a prefill worker: through the router's own FIFO (`MemoryDispatcher`,
     default) or the shared Redis stream (`--queue redis://…`).
  3. stream the decode worker's outputs (GET /pd/stream/{id}) back as RequestOutputs. A
     `kv_retry` frame (the transfer stalled) makes a new prefill attempt. A decode worker lost
     mid-stream: the request resumes on another one, prefilled over prompt + tokens already sent,
     so the client sees no duplicated and no missing token (exact for greedy decoding; a sampled
     continuation is a fresh sample). No decode worker left: the error reaches the client.
  Leaving early (client gone) aborts the request on every worker, which frees every block.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import itertools
import logging
from collections import Counter, deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Literal

import httpx
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from pdserve.disagg.control import (
    HandOff,
    OutputFrame,
    PrefillJob,
    ReserveReply,
    ReserveRequest,
    Retarget,
    WireSamplingParams,
    WorkerInfo,
    transfer_id,
)
from pdserve.disagg.queue import PrefillQueue, QueueUnavailable, next_attempt
from pdserve.engine.llm_engine import check_request
from pdserve.engine.output import CompletionOutput, RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.logs import bind_request_id
from pdserve.model.qwen3_config import Qwen3ModelConfig
from pdserve.serving.app import create_app
from pdserve.serving.errors import OpenAIError
from pdserve.serving.trace import RequestTrace, TTFTPhases, current_trace
from pdserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
_RESERVE_RETRY_S = 0.05
_INFO_TIMEOUT_S = 2.0
_RETRY_AFTER_S = 1
DecodePolicy = Literal["least-loaded", "round-robin", "prefix-affinity"]
DECODE_POLICIES: tuple[DecodePolicy, ...] = ("least-loaded", "round-robin", "prefix-affinity")


@dataclass(slots=True)
class Worker:
    url: str
    role: str
    info: WorkerInfo | None = None
    in_flight: int = 0
    in_flight_tokens: int = 0  # prefill: prompt tokens of the jobs pushed to it and not yet handed off

    @property
    def ready(self) -> bool:
        return self.info is not None and self.info.ready


class _DecodeLost(Exception):
    """The decode worker went away mid-request (connection dropped, or its stream ended early)."""


@dataclass(slots=True)
class _Dispatch:
    """One prefill job in the router's own queue, from submission to hand-off."""

    job: PrefillJob
    done: bool = False  # handed off, refused, or cancelled: nothing more to do for it
    worker: Worker | None = None
    cancelled: bool = False
    refusal: OpenAIError | None = None  # the prefill worker refused the job (its status and message)
    trace: RequestTrace = field(default_factory=current_trace)  # the request's TTFT phases (metrics)

    @property
    def num_tokens(self) -> int:
        """Prompt tokens the prefill worker computes (what its token budget is charged)."""
        return len(self.job.prompt_token_ids) - self.job.num_cached_tokens


class MemoryDispatcher:
    """The in-memory prefill queue: a FIFO in the router, pushed to prefill workers whose token
    budget has room (a worker takes a job when it holds none, or when the job fits into its
    `max_num_batched_tokens` beside what it holds). Jobs are taken in order, but a job that fits
    nowhere yet does not hold back smaller ones behind it. A worker lost with a job: the job is
    queued again at the front as a new attempt (the decode worker is told first)."""

    def __init__(self, client: PDClient) -> None:
        self._client = client
        self._pending: deque[_Dispatch] = deque()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._running: set[asyncio.Task[None]] = set()

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def submit(self, job: PrefillJob) -> _Dispatch:
        if self._task is None:
            # NOTE: in a fresh context: a task copies its creator's, and this one serves every
            # request (its log lines must not carry the first request's id)
            self._task = contextvars.Context().run(asyncio.create_task, self._loop())
        item = _Dispatch(job)
        self._pending.append(item)
        self._wakeup.set()
        return item

    def wake(self) -> None:
        self._wakeup.set()

    async def cancel(self, item: _Dispatch) -> None:
        item.cancelled = True
        if item in self._pending:
            self._pending.remove(item)
            item.done = True
        elif item.worker is not None and not item.done:
            await self._client.post(item.worker, f"/pd/abort/{item.job.transfer_id}", {})

    async def close(self) -> None:
        for task in [self._task, *self._running]:
            if task is not None:
                task.cancel()

    async def _loop(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            for item in list(self._pending):
                worker = self._pick(item.num_tokens)
                if worker is None:
                    continue
                self._pending.remove(item)
                item.worker = worker
                item.trace.mark_left_router()
                worker.in_flight += 1
                worker.in_flight_tokens += item.num_tokens
                task = asyncio.create_task(self._push(item, worker))
                self._running.add(task)
                task.add_done_callback(self._running.discard)

    def _pick(self, num_tokens: int) -> Worker | None:
        ready = [w for w in self._client.prefill if w.ready]
        fits = [w for w in ready if w.in_flight_tokens == 0 or
                w.in_flight_tokens + num_tokens <= max(w.info.max_num_batched_tokens if w.info else 0, 1)]
        return min(fits, key=lambda w: (w.in_flight_tokens, w.in_flight), default=None)

    async def _push(self, item: _Dispatch, worker: Worker) -> None:
        bind_request_id(item.job.request_id)
        requeue = False
        try:
            reply = await self._client.post(worker, "/pd/prefill", item.job.model_dump())
            if reply is None:  # the worker is gone, and so is whatever KV it computed
                requeue = not item.cancelled
            elif reply.status_code == HTTPStatus.OK:
                hand_off = HandOff.model_validate(reply.json())
                if hand_off.status == "failed":
                    logger.warning("request %s: hand-off failed: %s", item.job.request_id, hand_off.reason)
            elif reply.status_code == HTTPStatus.SERVICE_UNAVAILABLE:  # draining: try another one
                requeue = not item.cancelled
            else:
                message = _error_message(reply)
                logger.warning("request %s: prefill refused the job: %s", item.job.request_id, message)
                item.refusal = OpenAIError(message, HTTPStatus(reply.status_code))
                await self._client.fail_on_decode(item.job, f"prefill refused the job: {message}")
        finally:
            worker.in_flight -= 1
            worker.in_flight_tokens -= item.num_tokens
            self._wakeup.set()
        retry = next_attempt(item.job)
        if requeue and await self._client.retarget(item.job, retry):
            self._client.counters["redispatched"] += 1
            item.job, item.worker = retry, None
            self._pending.appendleft(item)
            self._wakeup.set()
            return
        item.done = True


class PDClient:
    """EngineClient over remote workers (see serving/engine_client.py for the contract)."""

    def __init__(self, prefill_urls: list[str], decode_urls: list[str], tokenizer: Tokenizer,
                 model_config: Qwen3ModelConfig, model_path: str, max_model_len: int,
                 reserve_deadline_s: float = 30.0, *, queue: PrefillQueue | None = None,
                 decode_policy: DecodePolicy = "least-loaded", pd_threshold: int = 0,
                 max_queued_requests: int = 512, max_queued_tokens: int = 1 << 20, max_resumes: int = 2) -> None:
        if not decode_urls or (not prefill_urls and queue is None):
            raise ValueError("the router needs decode workers, and prefill workers or a shared queue")
        if decode_policy not in DECODE_POLICIES:
            raise ValueError(f"decode policy must be one of {DECODE_POLICIES}, got {decode_policy!r}")
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.max_model_len = max_model_len
        self.vocab_size = model_config.vocab_size
        self.reserve_deadline_s = reserve_deadline_s
        self.queue = queue
        self.decode_policy = decode_policy
        self.pd_threshold = pd_threshold
        self.max_queued_requests = max_queued_requests
        self.max_queued_tokens = max_queued_tokens
        self.max_resumes = max_resumes
        self.prefill = [Worker(u.rstrip("/"), "prefill") for u in prefill_urls]
        self.decode = [Worker(u.rstrip("/"), "decode") for u in decode_urls]
        # rejected_<reason>, prefilled_on_decode, kv_retries, redispatched, resumed
        self.counters: Counter[str] = Counter()
        self.num_queued = 0  # admitted, first token not out yet
        self.num_queued_tokens = 0
        self.num_live_consumers = 0  # Redis: prefill workers pulling from the shared queue
        self.queue_error = ""  # Redis: why the queue is unreachable ("" when it is fine)
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))
        self._round_robin = itertools.count()
        self._dispatcher = MemoryDispatcher(self)

    # -- pool view -------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._prefill_ready() and any(w.ready for w in self.decode)

    def _prefill_ready(self) -> bool:
        if self.queue is not None:
            return not self.queue_error and self.num_live_consumers > 0
        return any(w.ready for w in self.prefill)

    def workers(self) -> list[dict[str, object]]:
        return [{"role": w.role, "url": w.url, "ready": w.ready, "in_flight": w.in_flight,
                 "draining": bool(w.info and w.info.draining),
                 "load": None if w.info is None else {"num_running": w.info.num_running,
                                                      "num_waiting": w.info.num_waiting,
                                                      "num_free_kv_blocks": w.info.num_free_kv_blocks,
                                                      "num_kv_blocks": w.info.num_kv_blocks}}
                for w in self.prefill + self.decode]

    def stats(self) -> dict[str, object]:
        return {"queued_requests": self.num_queued, "queued_tokens": self.num_queued_tokens,
                "dispatch_pending": self._dispatcher.num_pending, "queue": "redis" if self.queue else "memory",
                "live_queue_consumers": self.num_live_consumers, "queue_error": self.queue_error,
                "counters": dict(self.counters)}

    async def refresh(self) -> None:
        """Poll every worker's /pd/info (role, layout, readiness, load): the heartbeat. A worker
        that does not answer within 2 s leaves the pool until it answers again."""
        await asyncio.gather(*(self._refresh(w) for w in self.prefill + self.decode))
        if self.queue is not None:
            try:
                self.num_live_consumers = await self.queue.num_live_consumers()
                self.queue_error = ""
            except QueueUnavailable as exc:
                self.queue_error = str(exc)
        self._dispatcher.wake()

    async def _refresh(self, worker: Worker) -> None:
        try:
            reply = await self._http.get(f"{worker.url}/pd/info", timeout=_INFO_TIMEOUT_S)
            reply.raise_for_status()
            info = WorkerInfo.model_validate(reply.json())
            if info.role != worker.role:
                logger.error("worker %s is a %s worker, listed as %s", worker.url, info.role, worker.role)
                info = info.model_copy(update={"ready": False})
            if worker.info is None:
                logger.info("%s worker %s is in the pool", worker.role, worker.url)
            worker.info = info
        except (httpx.HTTPError, ValueError) as exc:
            if worker.info is not None:
                logger.warning("%s worker %s left the pool: %s", worker.role, worker.url, exc or type(exc).__name__)
            worker.info = None

    async def close(self) -> None:
        await self._dispatcher.close()
        if self.queue is not None:
            await self.queue.close()
        await self._http.aclose()

    async def watch(self, interval_s: float = 0.5) -> None:
        """Keep the view of the pool fresh (readiness and load) until cancelled."""
        while True:
            await self.refresh()
            await asyncio.sleep(interval_s)

    # -- requests --------------------------------------------------------------------------------
    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        try:
            check_request(prompt_token_ids, params, self.max_model_len, self.vocab_size)
            if params.n != 1:
                raise ValueError("n > 1 is not supported by the disaggregated router yet")
        except ValueError:
            self.counters["rejected_invalid"] += 1
            raise

    def _admit(self, num_tokens: int) -> None:
        if self.queue is not None and self.queue_error:
            self._reject("queue_unavailable", self.queue_error, HTTPStatus.SERVICE_UNAVAILABLE)
        if not self._prefill_ready():
            self._reject("no_prefill_worker", "no prefill worker is ready", HTTPStatus.SERVICE_UNAVAILABLE)
        if not any(w.ready for w in self.decode):
            self._reject("no_decode_worker", "no decode worker is ready", HTTPStatus.SERVICE_UNAVAILABLE)
        if self.num_queued + 1 > self.max_queued_requests or \
                (self.num_queued and self.num_queued_tokens + num_tokens > self.max_queued_tokens):
            self._reject("queue_full", f"the router's queue is full ({self.num_queued} requests, "
                         f"{self.num_queued_tokens} prompt tokens waiting); retry later", HTTPStatus.TOO_MANY_REQUESTS)
        self.num_queued += 1
        self.num_queued_tokens += num_tokens

    def _reject(self, reason: str, message: str, status: HTTPStatus) -> None:
        self.counters[f"rejected_{reason}"] += 1
        retry = {"Retry-After": str(_RETRY_AFTER_S)} if status == HTTPStatus.TOO_MANY_REQUESTS else None
        raise OpenAIError(message, status, headers=retry)

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        self.validate_request(prompt_token_ids, params)
        self._admit(len(prompt_token_ids))
        queued = True
        try:
            async for output in self._run(request_id, prompt_token_ids, params):
                if queued:
                    queued = False
                    self._unqueue(len(prompt_token_ids))
                yield output
        finally:
            if queued:
                self._unqueue(len(prompt_token_ids))

    def _unqueue(self, num_tokens: int) -> None:
        self.num_queued -= 1
        self.num_queued_tokens -= num_tokens

    async def _run(self, request_id: str, prompt: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """The request on one decode worker after another, until it finishes."""
        sent_tokens: list[int] = []
        sent_text = ""
        lost: set[str] = set()
        for resume in range(self.max_resumes + 1):
            sub_id = request_id if resume == 0 else f"{request_id}~{resume}"
            sub_prompt, sub_params = prompt + sent_tokens, _continuation(params, len(sent_tokens))
            decode, reply = await self._reserve(sub_id, sub_prompt, sub_params, lost)
            last: RequestOutput | None = None
            try:
                async for output in self._serve_on(decode, sub_id, sub_prompt, sub_params, reply):
                    last = output
                    seq = output.outputs[0]
                    yield RequestOutput(request_id, None, prompt, [dataclasses.replace(
                        seq, token_ids=sent_tokens + seq.token_ids, text=sent_text + seq.text)],
                        output.finished, output.num_cached_tokens)
                return
            except _DecodeLost as exc:
                lost.add(decode.url)
                if last is not None:
                    sent_tokens, sent_text = sent_tokens + last.outputs[0].token_ids, sent_text + last.outputs[0].text
                if resume == self.max_resumes:
                    raise OpenAIError(str(exc), HTTPStatus.BAD_GATEWAY) from exc
                self.counters["resumed"] += 1
                logger.warning("request %s: %s; resuming on another decode worker after %d tokens", request_id, exc,
                               len(sent_tokens))

    async def _serve_on(self, decode: Worker, rid: str, prompt: list[int], params: SamplingParams,
                        reply: ReserveReply) -> AsyncIterator[RequestOutput]:
        job = PrefillJob(request_id=rid, transfer_id=transfer_id(rid, 0), prompt_token_ids=prompt,
                         params=WireSamplingParams.of(params), kv_address=reply.kv_address, block_ids=reply.block_ids,
                         num_cached_tokens=reply.num_cached_tokens, decode_url=decode.url)
        dispatch: _Dispatch | None = None
        finished = False
        try:
            if len(prompt) - reply.num_cached_tokens < self.pd_threshold:
                self.counters["prefilled_on_decode"] += 1
                current_trace().mark_left_router()
                answer = await self.post(decode, f"/pd/prefill_here/{rid}", {})
                if answer is None or answer.status_code != HTTPStatus.OK:
                    raise _DecodeLost(f"decode worker {decode.url} did not take the prefill")
            else:
                dispatch = await self._dispatch(job)
            async for frame in self._stream(decode, rid):
                if frame.kv_retry:
                    self.counters["kv_retries"] += 1
                    retry = next_attempt(job)
                    if dispatch is not None and await self.retarget(job, retry):
                        await self._cancel(dispatch)
                        job = retry
                        dispatch = await self._dispatch(job)
                    continue
                if frame.error is not None:
                    if dispatch is not None and dispatch.refusal is not None:
                        raise dispatch.refusal
                    raise OpenAIError(frame.error, HTTPStatus.SERVICE_UNAVAILABLE)
                if frame.phases is not None:
                    current_trace().record(TTFTPhases(frame.phases.prefill_queue_s, frame.phases.prefill_compute_s,
                                                      frame.phases.first_decode_step_s))
                output = _request_output(rid, prompt, frame)
                finished = output.finished
                yield output
            if not finished:
                raise _DecodeLost(f"decode worker {decode.url} ended the stream of {rid} early")
        finally:
            decode.in_flight -= 1
            if not finished:
                await asyncio.shield(self._abort(rid, decode, dispatch))

    async def _dispatch(self, job: PrefillJob) -> _Dispatch:
        if self.queue is None:
            return self._dispatcher.submit(job)
        try:
            await self.queue.put(job)
            current_trace().mark_left_router()
        except QueueUnavailable as exc:
            self.queue_error = str(exc)
            self._reject("queue_unavailable", str(exc), HTTPStatus.SERVICE_UNAVAILABLE)
        return _Dispatch(job, done=True)

    async def _cancel(self, dispatch: _Dispatch) -> None:
        if self.queue is not None:
            await self.queue.cancel(dispatch.job.transfer_id)
        else:
            await self._dispatcher.cancel(dispatch)

    async def retarget(self, old: PrefillJob, new: PrefillJob) -> bool:
        """Tell the decode worker to expect `new` instead of `old`; False if it no longer waits."""
        decode = self._decode_by_url(old.decode_url)
        answer = None if decode is None else await self.post(
            decode, f"/pd/retarget/{old.request_id}", Retarget(transfer_id=new.transfer_id).model_dump())
        return answer is not None and answer.status_code == HTTPStatus.OK

    async def fail_on_decode(self, job: PrefillJob, reason: str) -> None:
        decode = self._decode_by_url(job.decode_url)
        if decode is not None:
            await self.post(decode, f"/pd/fail/{job.request_id}", {"reason": reason})

    def _decode_by_url(self, url: str) -> Worker | None:
        return next((w for w in self.decode if w.url == url), None)

    async def _reserve(self, request_id: str, prompt: list[int], params: SamplingParams,
                       exclude: set[str]) -> tuple[Worker, ReserveReply]:
        body = ReserveRequest(request_id=request_id, transfer_id=transfer_id(request_id, 0), prompt_token_ids=prompt,
                              params=WireSamplingParams.of(params)).model_dump()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.reserve_deadline_s
        while True:
            candidates = await self._decode_order(prompt, exclude)
            if not candidates:
                self._reject("no_decode_worker", "no decode worker is ready", HTTPStatus.SERVICE_UNAVAILABLE)
            for worker in candidates:
                reply = await self.post(worker, "/pd/reserve", body)
                if reply is not None and reply.status_code == HTTPStatus.OK:
                    worker.in_flight += 1
                    return worker, ReserveReply.model_validate(reply.json())
                if reply is not None and reply.status_code == HTTPStatus.BAD_REQUEST:
                    raise OpenAIError(_error_message(reply), HTTPStatus.BAD_REQUEST)
            if loop.time() > deadline:
                self._reject("no_kv_room", "No decode worker has room for this request; try again later",
                             HTTPStatus.SERVICE_UNAVAILABLE)
            await asyncio.sleep(_RESERVE_RETRY_S)

    async def _decode_order(self, prompt: list[int], exclude: set[str]) -> list[Worker]:
        ready = [w for w in self.decode if w.ready and w.url not in exclude]
        if not ready:
            return []
        if self.decode_policy == "round-robin":
            start = next(self._round_robin) % len(ready)
            return ready[start:] + ready[:start]
        load = {w.url: (-(w.info.num_free_kv_blocks if w.info else 0), w.in_flight) for w in ready}
        if self.decode_policy == "least-loaded" or len(ready) == 1:
            return sorted(ready, key=lambda w: load[w.url])
        cached = await asyncio.gather(*(self._cached_tokens(w, prompt) for w in ready))
        by_worker = dict(zip((w.url for w in ready), cached, strict=True))
        return sorted(ready, key=lambda w: (-by_worker[w.url], load[w.url]))

    async def _cached_tokens(self, worker: Worker, prompt: list[int]) -> int:
        reply = await self.post(worker, "/pd/prefix", {"prompt_token_ids": prompt})
        return int(reply.json()["num_cached_tokens"]) if reply is not None and reply.is_success else -1

    async def _stream(self, decode: Worker, request_id: str) -> AsyncIterator[OutputFrame]:
        try:
            async with self._http.stream("GET", f"{decode.url}/pd/stream/{request_id}") as response:
                if response.status_code != HTTPStatus.OK:
                    raise _DecodeLost(f"decode worker {decode.url} lost request {request_id}")
                async for line in response.aiter_lines():
                    if line:
                        yield OutputFrame.model_validate_json(line)
        except httpx.HTTPError as exc:
            decode.info = None
            raise _DecodeLost(f"decode worker {decode.url} failed mid-request: {exc!r}") from exc

    async def post(self, worker: Worker, path: str, body: dict) -> httpx.Response | None:
        try:
            return await self._http.post(f"{worker.url}{path}", json=body)
        except httpx.HTTPError as exc:
            logger.warning("%s worker %s unreachable: %r", worker.role, worker.url, exc)
            worker.info = None
            return None

    async def _abort(self, request_id: str, decode: Worker, dispatch: _Dispatch | None) -> None:
        if dispatch is not None:
            await self._cancel(dispatch)
        await self.post(decode, f"/pd/abort/{request_id}", {})


def _continuation(params: SamplingParams, num_sent: int) -> SamplingParams:
    """What is left of a request after `num_sent` tokens went out (resuming on another worker)."""
    if not num_sent:
        return params
    max_tokens = None if params.max_tokens is None else params.max_tokens - num_sent
    return dataclasses.replace(params, max_tokens=max_tokens, min_tokens=max(0, params.min_tokens - num_sent))


def _error_message(reply: httpx.Response) -> str:
    try:
        return str(reply.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {reply.status_code}"


def _request_output(request_id: str, prompt: list[int], frame: OutputFrame) -> RequestOutput:
    seq = CompletionOutput(0, frame.text, frame.token_ids, frame.finish_reason, frame.stop_reason)
    return RequestOutput(request_id, None, prompt, [seq], frame.finish_reason is not None, frame.num_cached_tokens)


def create_router_app(client: PDClient, model_name: str) -> FastAPI:
    """The OpenAI API of serving/app.py over the worker pool, plus GET /workers and /router/stats."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await client.refresh()
        watcher = asyncio.create_task(client.watch())
        try:
            yield
        finally:
            watcher.cancel()
            await client.close()

    app = create_app(client, model_name, lifespan, role="router")

    @app.get("/workers")
    async def workers() -> list[dict[str, object]]:
        return client.workers()

    @app.get("/router/stats")
    async def stats() -> JSONResponse:
        return JSONResponse(client.stats())

    return app
