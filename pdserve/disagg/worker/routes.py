"""The `/pd/*` routes of each worker role (paths, bodies and status codes: see worker/app.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.disagg.control import (
    FailJob,
    FirstToken,
    HandOff,
    Keepalive,
    Placement,
    PrefillEvent,
    PrefillJob,
    PrefixQuery,
    PrefixReply,
    ReserveRequest,
    Retarget,
)
from pdserve.disagg.kv_layout import KVLayoutMismatch
from pdserve.disagg.ndjson import NDJSON
from pdserve.disagg.transport.errors import KVTransferError
from pdserve.disagg.worker.decode_service import DecodeService
from pdserve.disagg.worker.frame_mux import FrameMuxes, FrameSource, UnknownMux
from pdserve.disagg.worker.prefill_service import PrefillService
from pdserve.serving.errors import DRAINING_HEADER, error_response


def add_decode_routes(app: FastAPI, service: DecodeService) -> None:
    _add_reservation_routes(app, service)
    _add_attempt_routes(app, service)
    _add_stream_routes(app, service)
    add_frame_mux_routes(app, service)


def _add_reservation_routes(app: FastAPI, service: DecodeService) -> None:
    """Reserving blocks, and what a router asks before it reserves."""

    @app.post("/pd/reserve")
    async def reserve(body: ReserveRequest) -> Response:
        try:
            reply = await service.reserve(body)
        except ValueError as exc:
            return error_response(str(exc), HTTPStatus.BAD_REQUEST)
        if reply is None:
            if service.draining:
                return error_response("this decode worker is draining", HTTPStatus.SERVICE_UNAVAILABLE,
                                      headers={DRAINING_HEADER: "1"})
            return error_response("No available block: the KV pool has no room for this request now",
                                  HTTPStatus.SERVICE_UNAVAILABLE)
        return JSONResponse(reply.model_dump())

    @app.post("/pd/prefix")
    async def prefix(body: PrefixQuery) -> PrefixReply:
        return PrefixReply(num_cached_tokens=await service.cached_prefix_tokens(body.prompt_token_ids))


def _add_attempt_routes(app: FastAPI, service: DecodeService) -> None:
    """A reservation waiting for its KV: which prefill attempt it expects, or what to do instead."""

    @app.post("/pd/alive")
    async def alive(body: Keepalive) -> JSONResponse:
        service.touch(body.transfer_ids, body.step_s)
        await service.attempts_ended(body.ended)
        return JSONResponse(service.keepalive_reply().model_dump())

    @app.post("/pd/retarget/{request_id}")
    async def retarget(request_id: str, body: Retarget) -> Response:
        if not await service.retarget(request_id, body.transfer_id, body.replaces):
            return error_response(f"request {request_id!r} is not waiting for KV"
                                  + (f" from attempt {body.replaces!r}" if body.replaces else ""), HTTPStatus.NOT_FOUND)
        return JSONResponse({"expecting": body.transfer_id})

    @app.post("/pd/prefill_here/{request_id}")
    async def prefill_here(request_id: str) -> Response:
        if not await service.prefill_here(request_id):
            return error_response(f"request {request_id!r} is not waiting for KV", HTTPStatus.NOT_FOUND)
        return JSONResponse({"prefilling": request_id})

    @app.post("/pd/fail/{request_id}")
    async def fail(request_id: str, body: FailJob) -> Response:
        if not await service.fail(request_id, body.reason, body.transfer_id):
            return error_response(f"request {request_id!r} is not waiting for KV", HTTPStatus.NOT_FOUND)
        return JSONResponse({"failed": request_id})


def _add_stream_routes(app: FastAPI, service: DecodeService) -> None:
    """A reserved request's outputs, and its end."""

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

        return StreamingResponse(lines(), media_type=NDJSON)

    @app.post("/pd/abort/{request_id}")
    async def abort(request_id: str) -> JSONResponse:
        await service.abort(request_id)
        return JSONResponse({"aborted": request_id})


def add_frame_mux_routes(app: FastAPI, service: FrameSource) -> None:
    """Many requests' frames on one stream per router (worker/frame_mux.py)."""
    muxes = FrameMuxes(service)

    @app.get("/pd/frames/{mux_id}")
    async def frames(mux_id: str) -> Response:
        try:
            body = muxes.open(mux_id)
        except ValueError as exc:
            return error_response(str(exc), HTTPStatus.CONFLICT)
        return StreamingResponse(body, media_type=NDJSON)

    @app.post("/pd/stream/{request_id}/via/{mux_id}")
    async def stream_via(request_id: str, mux_id: str) -> Response:
        try:
            muxes.attach(mux_id, request_id)
        except UnknownMux:
            return error_response(f"no frame stream {mux_id!r} here", HTTPStatus.GONE)
        except KeyError:
            return error_response(f"unknown request {request_id!r}", HTTPStatus.NOT_FOUND)
        return JSONResponse({"streaming": request_id})


def add_prefill_routes(app: FastAPI, service: PrefillService) -> None:
    @app.post("/pd/prefill")
    async def prefill(job: PrefillJob, request: Request) -> Response:
        if service.draining:
            return error_response("this prefill worker is draining", HTTPStatus.SERVICE_UNAVAILABLE,
                                  headers={DRAINING_HEADER: "1"})
        try:
            task = await service.submit(job)
        except (ValueError, KVTransferError, OSError) as exc:
            return _refused(exc)
        if NDJSON not in request.headers.get("accept", ""):
            return JSONResponse((await asyncio.shield(task)).model_dump())
        first_token, held = service.first_token(job.transfer_id), service.held_open(job.transfer_id)
        return StreamingResponse(_prefill_events(first_token, task, held), media_type=NDJSON)

    @app.post("/pd/place/{transfer_id}")
    async def place(transfer_id: str, body: Placement) -> Response:
        return await _place(service, transfer_id, body)

    @app.post("/pd/abort/{request_id}")
    async def abort(request_id: str) -> JSONResponse:
        await service.abort(request_id)
        return JSONResponse({"aborted": request_id})

    @app.post("/pd/prefix")
    async def prefix(body: PrefixQuery) -> PrefixReply:
        return PrefixReply(num_cached_tokens=await service.cached_prefix_tokens(body.prompt_token_ids))


async def _place(service: PrefillService, transfer_id: str, body: Placement) -> Response:
    if body.transfer_id != transfer_id:
        return error_response("the placement names another attempt than its path", HTTPStatus.BAD_REQUEST)
    try:
        await service.place(body)
    except KeyError:
        return error_response(f"attempt {transfer_id!r} is not running here", HTTPStatus.NOT_FOUND)
    except (ValueError, KVTransferError, OSError) as exc:
        return _refused(exc)
    return JSONResponse({"placed": transfer_id})


async def _prefill_events(first_token: asyncio.Future[FirstToken | None], task: asyncio.Task[HandOff],
                          held: asyncio.Future[None]) -> AsyncIterator[str]:
    # NOTE: the first token goes out as soon as it is sampled, before the KV hand-off ends
    # (waited for beside the task: neither is cancelled when this stream is)
    try:
        await asyncio.wait((first_token, task), return_when=asyncio.FIRST_COMPLETED)
        if first_token.done() and not first_token.cancelled() and (token := first_token.result()) is not None:
            yield PrefillEvent(first_token=token).model_dump_json() + "\n"
        yield PrefillEvent(hand_off=await asyncio.shield(task)).model_dump_json() + "\n"
    finally:  # NOTE: the router left (or the stream ended): an unplaced attempt waits no longer for it
        if not held.done():
            held.set_result(None)


def _refused(exc: Exception) -> Response:
    """A prefill job (or its placement) that cannot run: a KV layout decode cannot map (409), a bad
    job (400), or decode's KV receiver out of reach (502)."""
    if isinstance(exc, KVLayoutMismatch):
        return error_response(str(exc), HTTPStatus.CONFLICT)
    if isinstance(exc, ValueError):
        return error_response(str(exc), HTTPStatus.BAD_REQUEST)
    return error_response(f"cannot reach the decode worker's KV receiver: {exc}", HTTPStatus.BAD_GATEWAY)
