"""The router's engine client: makes P prefill and D decode workers look like one engine to the
OpenAI handlers (`serving/app.py`), so the router serves the same API as a colocated server.

One request:
  1. pick the decode worker with the most free KV blocks; reserve the prompt's blocks there
     (POST /pd/reserve). No room anywhere: wait and retry until `reserve_deadline_s`, then 503.
  2. pick the least busy prefill worker; hand it the job with the reservation (POST /pd/prefill).
  3. stream the decode worker's outputs (GET /pd/stream/{id}) back as RequestOutputs.
  Leaving early (client gone) aborts the request on both workers, which frees every block.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from http import HTTPStatus

import httpx
from fastapi import FastAPI

from pdserve.disagg.control import OutputFrame, PrefillJob, ReserveReply, ReserveRequest, WireSamplingParams, WorkerInfo
from pdserve.disagg.phases import current_trace
from pdserve.engine.llm_engine import check_request
from pdserve.engine.output import CompletionOutput, RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.model.qwen3_config import Qwen3ModelConfig
from pdserve.serving.app import create_app
from pdserve.serving.errors import OpenAIError
from pdserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
_RESERVE_RETRY_S = 0.05


@dataclass(slots=True)
class Worker:
    url: str
    role: str
    info: WorkerInfo | None = None
    in_flight: int = 0

    @property
    def ready(self) -> bool:
        return self.info is not None and self.info.ready


class PDClient:
    """EngineClient over remote workers (see serving/engine_client.py for the contract)."""

    def __init__(self, prefill_urls: list[str], decode_urls: list[str], tokenizer: Tokenizer,
                 model_config: Qwen3ModelConfig, model_path: str, max_model_len: int,
                 reserve_deadline_s: float = 30.0) -> None:
        if not prefill_urls or not decode_urls:
            raise ValueError("the router needs at least one prefill and one decode worker")
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.max_model_len = max_model_len
        self.vocab_size = model_config.vocab_size
        self.reserve_deadline_s = reserve_deadline_s
        self.prefill = [Worker(u.rstrip("/"), "prefill") for u in prefill_urls]
        self.decode = [Worker(u.rstrip("/"), "decode") for u in decode_urls]
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))
        self._round_robin = itertools.count()

    @property
    def alive(self) -> bool:
        return any(w.ready for w in self.prefill) and any(w.ready for w in self.decode)

    def workers(self) -> list[dict[str, object]]:
        return [{"role": w.role, "url": w.url, "ready": w.ready, "in_flight": w.in_flight,
                 "load": None if w.info is None else {"num_running": w.info.num_running,
                                                      "num_waiting": w.info.num_waiting,
                                                      "num_free_kv_blocks": w.info.num_free_kv_blocks,
                                                      "num_kv_blocks": w.info.num_kv_blocks}}
                for w in self.prefill + self.decode]

    async def refresh(self) -> None:
        """Poll every worker's /pd/info (what it advertises: role, layout, readiness, load)."""
        await asyncio.gather(*(self._refresh(w) for w in self.prefill + self.decode))

    async def _refresh(self, worker: Worker) -> None:
        try:
            reply = await self._http.get(f"{worker.url}/pd/info", timeout=2.0)
            reply.raise_for_status()
            info = WorkerInfo.model_validate(reply.json())
            if info.role != worker.role:
                logger.error("worker %s is a %s worker, listed as %s", worker.url, info.role, worker.role)
                info = info.model_copy(update={"ready": False})
            worker.info = info
        except (httpx.HTTPError, ValueError):
            worker.info = None

    async def close(self) -> None:
        await self._http.aclose()

    async def watch(self, interval_s: float = 0.5) -> None:
        """Keep the view of the pool fresh (readiness and load) until cancelled."""
        while True:
            await self.refresh()
            await asyncio.sleep(interval_s)

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        check_request(prompt_token_ids, params, self.max_model_len, self.vocab_size)
        if params.n != 1:
            raise ValueError("n > 1 is not supported by the disaggregated router yet")

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        self.validate_request(prompt_token_ids, params)
        decode, reply = await self._reserve(request_id, prompt_token_ids, params)
        prefill: Worker | None = None
        finished = False
        try:
            # NOTE: a reservation always leaves prefill at least one token (the one that samples).
            current_trace().mark_left_router()
            prefill = await self._dispatch(request_id, prompt_token_ids, params, reply)
            async for output in self._stream(decode, request_id, prompt_token_ids):
                finished = output.finished
                yield output
        finally:
            decode.in_flight -= 1
            if prefill is not None:
                prefill.in_flight -= 1
            if not finished:
                await asyncio.shield(self._abort(request_id, decode, prefill))

    async def _reserve(self, request_id: str, prompt: list[int], params: SamplingParams) -> tuple[Worker, ReserveReply]:
        body = ReserveRequest(request_id=request_id, prompt_token_ids=prompt,
                              params=WireSamplingParams.of(params)).model_dump()
        deadline = asyncio.get_running_loop().time() + self.reserve_deadline_s
        while True:
            for worker in self._decode_order():
                reply = await self._post(worker, "/pd/reserve", body)
                if reply is not None and reply.status_code == HTTPStatus.OK:
                    worker.in_flight += 1
                    return worker, ReserveReply.model_validate(reply.json())
                if reply is not None and reply.status_code == HTTPStatus.BAD_REQUEST:
                    raise OpenAIError(reply.json()["error"]["message"], HTTPStatus.BAD_REQUEST)
            if asyncio.get_running_loop().time() > deadline:
                raise OpenAIError("No decode worker has room for this request; try again later",
                                  HTTPStatus.SERVICE_UNAVAILABLE)
            await asyncio.sleep(_RESERVE_RETRY_S)

    def _decode_order(self) -> list[Worker]:
        """Least loaded first: most free KV blocks, then fewest requests in flight from here."""
        ready = [w for w in self.decode if w.ready] or list(self.decode)
        return sorted(ready, key=lambda w: (-(w.info.num_free_kv_blocks if w.info else 0), w.in_flight))

    async def _dispatch(self, request_id: str, prompt: list[int], params: SamplingParams,
                        reply: ReserveReply) -> Worker:
        job = PrefillJob(request_id=request_id, prompt_token_ids=prompt, params=WireSamplingParams.of(params),
                         kv_address=reply.kv_address, block_ids=reply.block_ids,
                         num_cached_tokens=reply.num_cached_tokens).model_dump()
        candidates = sorted([w for w in self.prefill if w.ready] or self.prefill,
                            key=lambda w: (w.in_flight, next(self._round_robin)))
        for worker in candidates:
            answer = await self._post(worker, "/pd/prefill", job)
            if answer is not None and answer.status_code == HTTPStatus.ACCEPTED:
                worker.in_flight += 1
                return worker
            if answer is not None and answer.status_code in (HTTPStatus.BAD_REQUEST, HTTPStatus.CONFLICT):
                raise OpenAIError(answer.json()["error"]["message"], HTTPStatus(answer.status_code))
        raise OpenAIError("no prefill worker accepted the request", HTTPStatus.SERVICE_UNAVAILABLE)

    async def _stream(self, decode: Worker, request_id: str, prompt: list[int]) -> AsyncIterator[RequestOutput]:
        try:
            async with self._http.stream("GET", f"{decode.url}/pd/stream/{request_id}") as response:
                if response.status_code != HTTPStatus.OK:
                    raise OpenAIError(f"decode worker {decode.url} lost request {request_id}", HTTPStatus.BAD_GATEWAY)
                async for line in response.aiter_lines():
                    if not line:
                        continue
                    frame = OutputFrame.model_validate_json(line)
                    if frame.error is not None:
                        raise OpenAIError(frame.error, HTTPStatus.SERVICE_UNAVAILABLE)
                    if frame.phases is not None:
                        current_trace().record(frame.phases)
                    yield _request_output(request_id, prompt, frame)
        except httpx.HTTPError as exc:
            decode.info = None
            raise OpenAIError(f"decode worker {decode.url} failed mid-request: {exc}", HTTPStatus.BAD_GATEWAY) from exc

    async def _post(self, worker: Worker, path: str, body: dict) -> httpx.Response | None:
        try:
            return await self._http.post(f"{worker.url}{path}", json=body)
        except httpx.HTTPError as exc:
            logger.warning("%s worker %s unreachable: %s", worker.role, worker.url, exc)
            worker.info = None
            return None

    async def _abort(self, request_id: str, decode: Worker, prefill: Worker | None) -> None:
        for worker in (decode, prefill):
            if worker is not None:
                await self._post(worker, f"/pd/abort/{request_id}", {})


def _request_output(request_id: str, prompt: list[int], frame: OutputFrame) -> RequestOutput:
    seq = CompletionOutput(0, frame.text, frame.token_ids, frame.finish_reason, frame.stop_reason)
    return RequestOutput(request_id, None, prompt, [seq], frame.finish_reason is not None, frame.num_cached_tokens)


def create_router_app(client: PDClient, model_name: str) -> FastAPI:
    """The OpenAI API of serving/app.py over the worker pool, plus GET /workers."""

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

    return app
