"""HTTP control plane of a prefill or decode worker (the router is its only client).

    GET  /health               200 once the model is loaded and the KV transport is up
    GET  /pd/info              WorkerInfo: role, model, KV layout, transport address, load
    decode:  POST /pd/reserve  ReserveRequest -> ReserveReply | 503 (no room now) | 400
             GET  /pd/stream/{id}  NDJSON OutputFrames until the request finishes
             POST /pd/abort/{id}
    prefill: POST /pd/prefill  PrefillJob -> 202 | 400 | 409 (KV layout mismatch) | 502 (decode unreachable)
             POST /pd/abort/{id}
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.disagg.control import PrefillJob, ReserveRequest, Role, WorkerInfo
from pdserve.disagg.decode_service import DecodeService, FailurePolicy
from pdserve.disagg.kv_layout import KVLayout, KVLayoutMismatch
from pdserve.disagg.prefill_service import PrefillService
from pdserve.disagg.transport import make_receiver
from pdserve.disagg.transport.errors import KVTransferError
from pdserve.engine.llm_engine import LLMEngine
from pdserve.serving.async_engine import AsyncLLM
from pdserve.serving.errors import EXCEPTION_HANDLERS, error_response
from pdserve.serving.metrics import instrument_engine_app


def create_worker_app(client: AsyncLLM, role: Role, model_name: str, layout: KVLayout, transport: str,
                      service: PrefillService | DecodeService) -> FastAPI:
    app = FastAPI(title=f"pdserve {role} worker", exception_handlers=EXCEPTION_HANDLERS)  # type: ignore[arg-type]
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
                          kv_address=kv_address, ready=client.alive, num_running=stats.num_running,
                          num_waiting=stats.num_waiting, num_free_kv_blocks=stats.num_free_kv_blocks,
                          num_kv_blocks=stats.num_kv_blocks)

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
            return error_response("No available block: the KV pool has no room for this request now",
                                  HTTPStatus.SERVICE_UNAVAILABLE)
        return JSONResponse(reply.model_dump())

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
        try:
            await service.submit(job)
        except KVLayoutMismatch as exc:
            return error_response(str(exc), HTTPStatus.CONFLICT)
        except ValueError as exc:
            return error_response(str(exc), HTTPStatus.BAD_REQUEST)
        except (KVTransferError, OSError) as exc:
            return error_response(f"cannot reach the decode worker's KV receiver: {exc}", HTTPStatus.BAD_GATEWAY)
        return JSONResponse({"accepted": job.request_id}, status_code=int(HTTPStatus.ACCEPTED))

    @app.post("/pd/abort/{request_id}")
    async def abort(request_id: str) -> JSONResponse:
        await service.abort(request_id)
        return JSONResponse({"aborted": request_id})


def build_worker(engine: LLMEngine, role: Role, model_name: str, transport: str, failure_policy: FailurePolicy,
                 transfer_timeout_s: float, transport_options: dict[str, Any] | None = None
                 ) -> tuple[FastAPI, AsyncLLM, PrefillService | DecodeService]:
    """Engine thread + KV transport + control-plane app for one prefill or decode worker.
    `transport_options` go to the receiver (decode: e.g. host, port) or to each sender (prefill)."""
    kv_cache = engine.runner.kv_cache
    layout = KVLayout.from_pool(model_name, kv_cache)
    client = AsyncLLM(engine)
    service: PrefillService | DecodeService
    if role == "decode":
        receiver = make_receiver(transport, layout, kv_cache, **(transport_options or {}))
        service = DecodeService(client, receiver, failure_policy, transfer_timeout_s)
    else:
        service = PrefillService(client, transport, layout, transfer_timeout_s, transport_options)
    return create_worker_app(client, role, model_name, layout, transport, service), client, service
