"""HTTP control plane of a prefill or decode worker (the router is its only client).

    GET  /health               200 once the model is loaded and the KV transport is up
    GET  /pd/info              WorkerInfo: role, model, KV layout, transport address, load
    GET  /pd/stats             counters of what the worker did (hand-offs, timeouts, retries, queue)
    decode:  POST /pd/reserve  ReserveRequest -> ReserveReply | 503 (no room now, or draining) | 400
             POST /pd/prefix   {"prompt_token_ids": [...]} -> {"num_cached_tokens": n} (prefix affinity)
             GET  /pd/stream/{id}  NDJSON OutputFrames until the request finishes
             POST /pd/alive    {"transfer_ids": [...]}: keepalives from prefill workers computing them
             POST /pd/retarget/{id}  Retarget: expect a new prefill attempt | 404
             POST /pd/prefill_here/{id}  compute the (short) uncached rest here | 404
             POST /pd/fail/{id}  FailJob: end a request still waiting for KV with an error | 404
             POST /pd/abort/{id}
    prefill: POST /pd/prefill  PrefillJob -> HandOff once the hand-off ended | 400 | 409 (KV layout
                               mismatch) | 502 (decode unreachable) | 503 (draining)
             POST /pd/abort/{transfer id}

Draining (SIGTERM, see `drain`): /pd/info says `draining`, so routers stop sending work, new
reservations and jobs get 503, and what is in flight finishes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.disagg.control import (
    FailJob,
    Keepalive,
    PrefillJob,
    PrefixQuery,
    PrefixReply,
    ReserveRequest,
    Retarget,
    Role,
    WorkerInfo,
)
from pdserve.disagg.decode_service import DecodeService, FailurePolicy
from pdserve.disagg.kv_layout import KVLayout, KVLayoutMismatch
from pdserve.disagg.prefill_service import PrefillService
from pdserve.disagg.transport import make_receiver
from pdserve.disagg.transport.errors import KVTransferError
from pdserve.engine.async_llm import AsyncLLM
from pdserve.engine.commands import CachedPrefixTokens
from pdserve.engine.llm_engine import KVTransferSetup, LLMEngine
from pdserve.serving.app import Lifespan
from pdserve.serving.errors import EXCEPTION_HANDLERS, error_response
from pdserve.serving.metrics import instrument_engine_app

if TYPE_CHECKING:
    from pdserve.disagg.queue.redis_streams import RedisJobConsumer


def create_worker_app(client: AsyncLLM, role: Role, model_name: str, layout: KVLayout, transport: str,
                      service: PrefillService | DecodeService, lifespan: Lifespan | None = None) -> FastAPI:
    app = FastAPI(title=f"pdserve {role} worker", exception_handlers=EXCEPTION_HANDLERS,  # type: ignore[arg-type]
                  lifespan=lifespan)
    kv_address = service.receiver.address if isinstance(service, DecodeService) else None
    instrument_engine_app(app, client, model_name, role, service)  # GET /metrics (serving/metrics.py)

    @app.get("/health")
    async def health() -> JSONResponse:
        if not client.alive:
            return JSONResponse({"status": "engine dead"}, status_code=int(HTTPStatus.SERVICE_UNAVAILABLE))
        return JSONResponse({"status": "ok", "role": role})

    @app.get("/pd/info")
    async def info() -> WorkerInfo:
        stats = client.stats()
        return WorkerInfo(role=role, model=model_name, kv_layout=dataclasses.asdict(layout), kv_transport=transport,
                          kv_address=kv_address, ready=client.alive and not service.draining,
                          num_running=stats.num_running, num_waiting=stats.num_waiting,
                          num_free_kv_blocks=stats.num_free_kv_blocks, num_kv_blocks=stats.num_kv_blocks,
                          max_num_batched_tokens=client.engine.config.scheduler.max_num_batched_tokens,
                          draining=service.draining)

    @app.get("/pd/stats")
    async def stats() -> JSONResponse:
        """What this worker's service did (counters), and what it holds now."""
        consumer = getattr(service, "consumer", None)
        return JSONResponse({"role": role, "in_flight": service.num_in_flight, "draining": service.draining,
                             "counters": dict(service.counters),
                             "queue": None if consumer is None else {"consumer": consumer.name,
                                                                     "in_flight": consumer.num_in_flight,
                                                                     "counters": dict(consumer.counters)}})

    if isinstance(service, DecodeService):
        _add_decode_routes(app, service)
    else:
        _add_prefill_routes(app, service)
    return app


def _add_decode_routes(app: FastAPI, service: DecodeService) -> None:
    @app.post("/pd/reserve")
    async def reserve(body: ReserveRequest) -> Response:
        try:
            reply = await service.reserve(body)
        except ValueError as exc:
            return error_response(str(exc), HTTPStatus.BAD_REQUEST)
        if reply is None:
            if service.draining:
                return error_response("this decode worker is draining", HTTPStatus.SERVICE_UNAVAILABLE)
            return error_response("No available block: the KV pool has no room for this request now",
                                  HTTPStatus.SERVICE_UNAVAILABLE)
        return JSONResponse(reply.model_dump())

    @app.post("/pd/prefix")
    async def prefix(body: PrefixQuery) -> PrefixReply:
        prompt = body.prompt_token_ids
        cached = await service.client.send(CachedPrefixTokens(prompt))
        return PrefixReply(num_cached_tokens=cached)

    @app.post("/pd/alive")
    async def alive(body: Keepalive) -> JSONResponse:
        service.touch(body.transfer_ids)
        return JSONResponse({})

    @app.post("/pd/retarget/{request_id}")
    async def retarget(request_id: str, body: Retarget) -> Response:
        if not service.retarget(request_id, body.transfer_id):
            return error_response(f"request {request_id!r} is not waiting for KV", HTTPStatus.NOT_FOUND)
        return JSONResponse({"expecting": body.transfer_id})

    @app.post("/pd/prefill_here/{request_id}")
    async def prefill_here(request_id: str) -> Response:
        if not await service.prefill_here(request_id):
            return error_response(f"request {request_id!r} is not waiting for KV", HTTPStatus.NOT_FOUND)
        return JSONResponse({"prefilling": request_id})

    @app.post("/pd/fail/{request_id}")
    async def fail(request_id: str, body: FailJob) -> Response:
        if not await service.fail(request_id, body.reason):
            return error_response(f"request {request_id!r} is not waiting for KV", HTTPStatus.NOT_FOUND)
        return JSONResponse({"failed": request_id})

    @app.get("/pd/stream/{request_id}")
    async def stream(request_id: str) -> Response:
        try:
            frames = service.stream(request_id)
            first = await anext(frames)
        except (KeyError, StopAsyncIteration):
            return error_response(f"unknown request {request_id!r}", HTTPStatus.NOT_FOUND)

        async def lines() -> AsyncIterator[str]:
            yield first.model_dump_json() + "\n"
            async for frame in frames:
                yield frame.model_dump_json() + "\n"

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @app.post("/pd/abort/{request_id}")
    async def abort(request_id: str) -> JSONResponse:
        await service.abort(request_id)
        return JSONResponse({"aborted": request_id})


def _add_prefill_routes(app: FastAPI, service: PrefillService) -> None:
    @app.post("/pd/prefill")
    async def prefill(job: PrefillJob) -> Response:
        if service.draining:
            return error_response("this prefill worker is draining", HTTPStatus.SERVICE_UNAVAILABLE)
        try:
            hand_off = await service.run(job)
        except KVLayoutMismatch as exc:
            return error_response(str(exc), HTTPStatus.CONFLICT)
        except ValueError as exc:
            return error_response(str(exc), HTTPStatus.BAD_REQUEST)
        except (KVTransferError, OSError) as exc:
            return error_response(f"cannot reach the decode worker's KV receiver: {exc}", HTTPStatus.BAD_GATEWAY)
        return JSONResponse(hand_off.model_dump())

    @app.post("/pd/abort/{request_id}")
    async def abort(request_id: str) -> JSONResponse:
        await service.abort(request_id)
        return JSONResponse({"aborted": request_id})


def drain(service: PrefillService | DecodeService, consumer: RedisJobConsumer | None = None) -> None:
    """Stop taking work (SIGTERM): routers see `draining` and stop sending; new reservations and
    jobs get 503; a queue consumer stops pulling. What is in flight finishes."""
    service.draining = True
    if consumer is not None:
        consumer.stop()


def build_worker(engine: LLMEngine, role: Role, model_name: str, transport: str, failure_policy: FailurePolicy,
                 transfer_timeout_s: float, transport_options: dict[str, Any] | None = None,
                 queue_url: str | None = None, queue_options: dict[str, Any] | None = None,
                 ) -> tuple[FastAPI, AsyncLLM, PrefillService | DecodeService]:
    """Engine thread + KV transport + control-plane app for one prefill or decode worker.
    `transport_options` go to the receiver (decode: e.g. host, port) or to each sender (prefill).
    A prefill worker given `queue_url` (redis://…) pulls its jobs from the shared queue
    (`RedisJobConsumer`, started with the app, drained and awaited when the app stops)."""
    kv_cache = engine.runner.kv_cache
    layout = KVLayout.from_pool(model_name, kv_cache)
    service: PrefillService | DecodeService
    if role == "decode":
        receiver = make_receiver(transport, layout, kv_cache, **(transport_options or {}))
        # NOTE: the quarantine must be known before the engine thread starts: only it reads it then
        client = AsyncLLM(engine, KVTransferSetup(remote_kv_quarantine_s=receiver.late_write_window_s))
        service = DecodeService(client, receiver, failure_policy, transfer_timeout_s)
    else:
        client = AsyncLLM(engine)
        service = PrefillService(client, transport, layout, transfer_timeout_s, transport_options)
    lifespan = None
    if queue_url and isinstance(service, PrefillService):
        from pdserve.disagg.queue.redis_streams import RedisJobConsumer

        consumer = RedisJobConsumer(service, queue_url, **(queue_options or {}))
        service.consumer = consumer

        @asynccontextmanager
        async def lifespan(_: FastAPI) -> AsyncIterator[None]:
            task = asyncio.create_task(consumer.run())
            try:
                yield
            finally:
                consumer.stop()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                await consumer.close()

    app = create_worker_app(client, role, model_name, layout, transport, service, lifespan)
    return app, client, service
