"""Model-less prefill and decode workers that speak the real workers' `/pd/*` protocol, for
measuring what the router itself costs (bench/router_cost.py).

    python -m pdserve.bench.router_standins --role decode|prefill --port PORT [--model DIR] [--step-ms 0]

Decode: `POST /pd/reserve` always has room; the frame stream (the real worker's own, worker/frame_mux.py:
what a router uses by default) or `GET /pd/stream/{id}` (`--no-frame-mux`) streams one `OutputFrame`
per token (a delta: the token and its text, as a real decode worker's frames are: `FrameEncoder` over
RequestOutputs), `--step-ms` apart (0: as fast as the router reads them) on one step clock for all
streams, as a real decode step makes a token for every running request at once, the last one finished
("length") after the request's `max_tokens`. The tokens are a fixed cycle of ordinary vocabulary
ids (`token_cycle`), the same for every request, their text what a real engine's output state makes
of them (so the router's early first token, which prefill sends, matches decode's first frame).
Prefill: `POST /pd/prefill` answers at once: the first token (NDJSON, when asked), then the hand-off;
a job sent unplaced waits for its `POST /pd/place/{transfer_id}`, as a real one waits to send its KV.
No auth: run the router without a cluster secret.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import math
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.disagg.client import NDJSON
from pdserve.disagg.control import (
    FailJob,
    FirstToken,
    FrameEncoder,
    HandOff,
    Keepalive,
    OutputFrame,
    Placement,
    PrefillEvent,
    PrefillJob,
    PrefixQuery,
    PrefixReply,
    ReserveReply,
    ReserveRequest,
    Retarget,
    WorkerInfo,
)
from pdserve.disagg.worker.routes import add_frame_mux_routes
from pdserve.engine.output import RequestState
from pdserve.tokenizer import Tokenizer

CYCLE_LENGTH = 256
_FIRST_ID = 1000  # ordinary (non-special) ids of the Qwen vocabulary start well below this
_PLACEMENT_WAIT_S = 60.0
T = TypeVar("T")


def token_cycle(tokenizer: Tokenizer, length: int = CYCLE_LENGTH) -> list[int]:
    """`length` token ids, each one whole printable piece of text on its own (no special token, no
    EOS, no partial UTF-8 character): every token is one streamed chunk with text."""
    cycle: list[int] = []
    for token_id in range(_FIRST_ID, tokenizer.vocab_size):
        if len(cycle) == length:
            break
        if token_id in tokenizer.eos_token_ids or tokenizer.is_special(token_id):
            continue
        text = tokenizer.decode([token_id])
        if text.strip() and text.isprintable() and "\ufffd" not in text:
            cycle.append(token_id)
    return cycle


class FrameBook:
    """The frames a request of `max_tokens` T streams: T delta frames, the last finished ("length");
    made once per T, and their NDJSON lines once (a real worker builds each; here the stand-in's
    own cost stays small: the frame stream encodes each frame, as the real worker's does)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.cycle = token_cycle(tokenizer)
        self._books: dict[int, list[OutputFrame]] = {}
        self._lines: dict[int, list[bytes]] = {}

    def first_token(self) -> int:
        return self.cycle[0]

    def frames(self, max_tokens: int) -> list[OutputFrame]:
        if max_tokens not in self._books:
            state = RequestState("", None, [], 1, self.tokenizer, True, False, (), False, 0, 0.0)
            ids = list(itertools.islice(itertools.cycle(self.cycle), max_tokens))
            frames = []
            encoder = FrameEncoder()  # delta frames, as a real decode worker's (control.OutputFrame)
            for index, token_id in enumerate(ids):
                state.add_token(0, token_id, None)
                output = state.snapshot()
                if index == len(ids) - 1:
                    output.outputs[0] = dataclasses.replace(output.outputs[0], finish_reason="length")
                frames.append(encoder.frame(output))
            self._books[max_tokens] = frames
        return self._books[max_tokens]

    def lines(self, max_tokens: int) -> list[bytes]:
        """`frames` as NDJSON lines (a stream per request)."""
        if max_tokens not in self._lines:
            self._lines[max_tokens] = [frame.model_dump_json().encode() + b"\n" for frame in self.frames(max_tokens)]
        return self._lines[max_tokens]


def _info(role: str, model: str, num_running: int) -> WorkerInfo:
    return WorkerInfo(role=role, model=model, kv_layout={}, kv_transport="tcp",  # type: ignore[arg-type]
                      kv_address="127.0.0.1:1" if role == "decode" else None, ready=True, num_running=num_running,
                      num_waiting=0, num_free_kv_blocks=1 << 20, num_kv_blocks=1 << 20,
                      max_num_batched_tokens=1 << 30, instance_id=_INSTANCE)


_INSTANCE = uuid.uuid4().hex


def _add_common_routes(app: FastAPI, role: str, model: str, running: dict) -> None:
    @app.get("/pd/info")
    async def info() -> WorkerInfo:
        return _info(role, model, len(running))

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({})

    @app.get("/ready")
    async def ready() -> JSONResponse:
        return JSONResponse({})

    @app.post("/pd/prefix")
    async def prefix(body: PrefixQuery) -> PrefixReply:
        return PrefixReply(num_cached_tokens=0)


def _not_found(what: str) -> JSONResponse:
    return JSONResponse({"error": {"message": f"unknown request {what!r}", "type": "not_found"}}, status_code=404)


@dataclass(slots=True)
class _Reservation:
    max_tokens: int
    aborted: asyncio.Event = field(default_factory=asyncio.Event)


def decode_app(book: FrameBook, model: str = "standin", step_s: float = 0.0) -> FastAPI:
    app = FastAPI()
    reserved: dict[str, _Reservation] = {}
    _add_common_routes(app, "decode", model, reserved)

    @app.post("/pd/reserve")
    async def reserve(body: ReserveRequest) -> ReserveReply:
        max_tokens = body.params.fields.get("max_tokens") or 16
        reserved[body.request_id] = _Reservation(int(max_tokens))
        return ReserveReply(block_ids=[0], num_cached_tokens=0, kv_address="127.0.0.1:1", token="standin")

    @app.get("/pd/stream/{request_id}")
    async def stream(request_id: str) -> Response:
        record = reserved.get(request_id)
        if record is None:
            return _not_found(request_id)

        return StreamingResponse(_paced(book.lines(record.max_tokens), record, request_id, reserved, step_s),
                                 media_type=NDJSON)

    add_frame_mux_routes(app, _FrameSource(book, reserved, step_s))  # what a router uses unless --no-frame-mux
    _add_decode_control_routes(app, reserved)
    return app


class _FrameSource:
    """The real frame stream (worker/frame_mux.py, its routes) over the stand-in's reservations."""

    def __init__(self, book: FrameBook, reserved: dict[str, _Reservation], step_s: float) -> None:
        self.book, self.reserved, self.step_s = book, reserved, step_s

    def knows(self, rid: str) -> bool:
        return rid in self.reserved

    def stream(self, rid: str) -> AsyncIterator[OutputFrame]:
        record = self.reserved.get(rid)
        if record is None:
            raise KeyError(rid)
        return _paced(self.book.frames(record.max_tokens), record, rid, self.reserved, self.step_s)


async def _paced(items: Sequence[T], record: _Reservation, rid: str, reserved: dict[str, _Reservation],
                 step_s: float) -> AsyncIterator[T]:
    """A reserved request's frames (or their lines), `step_s` apart, until its abort; then it is
    no longer reserved, however it ended."""
    try:
        for item in items:
            if record.aborted.is_set():
                return
            yield item
            await next_step(step_s)
    finally:
        reserved.pop(rid, None)


async def next_step(step_s: float) -> None:
    """Until the next tick of one clock every `step_s` (0: only let others run). Every stream waiting
    wakes on the same tick, as every running request gets its token from the same decode step (each
    stream sleeping its own `step_s` drifted apart: a real worker's one write a step became many)."""
    if step_s <= 0:
        await asyncio.sleep(0)
        return
    now = asyncio.get_running_loop().time()
    await asyncio.sleep((math.floor(now / step_s) + 1) * step_s - now)


def _add_decode_control_routes(app: FastAPI, reserved: dict[str, _Reservation]) -> None:
    """What decode answers besides reserving and streaming: aborts, keepalives, retargets..."""

    @app.post("/pd/abort/{request_id}")
    async def abort(request_id: str) -> JSONResponse:
        if (record := reserved.pop(request_id, None)) is not None:
            record.aborted.set()
        return JSONResponse({"aborted": request_id})

    @app.post("/pd/alive")
    async def alive(body: Keepalive) -> JSONResponse:
        return JSONResponse({})

    @app.post("/pd/retarget/{request_id}")
    async def retarget(request_id: str, body: Retarget) -> Response:
        return JSONResponse({"expecting": body.transfer_id}) if request_id in reserved else _not_found(request_id)

    @app.post("/pd/prefill_here/{request_id}")
    async def prefill_here(request_id: str) -> Response:
        return JSONResponse({"prefilling": request_id}) if request_id in reserved else _not_found(request_id)

    @app.post("/pd/fail/{request_id}")
    async def fail(request_id: str, body: FailJob) -> Response:
        return JSONResponse({"failed": request_id}) if reserved.pop(request_id, None) else _not_found(request_id)


def prefill_app(book: FrameBook, model: str = "standin") -> FastAPI:
    app = FastAPI()
    placed: dict[str, asyncio.Future[str]] = {}  # transfer id -> how the attempt ends (placed, aborted)
    _add_common_routes(app, "prefill", model, placed)

    @app.post("/pd/prefill")
    async def prefill(job: PrefillJob, request: Request) -> Response:
        first = FirstToken(transfer_id=job.transfer_id, token_id=book.first_token(), prefill_queue_s=0.0,
                           prefill_compute_s=0.0)
        if not job.placed:
            placed[job.transfer_id] = asyncio.get_running_loop().create_future()
        if NDJSON not in request.headers.get("accept", ""):
            return JSONResponse((await _hand_off(job, placed)).model_dump())

        async def events() -> AsyncIterator[str]:
            yield PrefillEvent(first_token=first).model_dump_json() + "\n"
            yield PrefillEvent(hand_off=await _hand_off(job, placed)).model_dump_json() + "\n"

        return StreamingResponse(events(), media_type=NDJSON)

    _add_prefill_control_routes(app, placed)
    return app


async def _hand_off(job: PrefillJob, placed: dict[str, asyncio.Future[str]]) -> HandOff:
    """At once for a placed job; else once its placement (or an abort) comes, or it times out."""
    if job.placed:
        return HandOff(transfer_id=job.transfer_id, status="handed_off")
    try:
        status = await asyncio.wait_for(placed[job.transfer_id], _PLACEMENT_WAIT_S)
    except TimeoutError:
        status = "failed"
    finally:
        placed.pop(job.transfer_id, None)
    return HandOff(transfer_id=job.transfer_id, status=status)  # type: ignore[arg-type]


def _add_prefill_control_routes(app: FastAPI, placed: dict[str, asyncio.Future[str]]) -> None:
    """Placements and aborts of the jobs prefill holds."""

    @app.post("/pd/place/{transfer_id}")
    async def place(transfer_id: str, body: Placement) -> Response:
        waiting = placed.get(transfer_id)
        if waiting is None or waiting.done():
            return _not_found(transfer_id)
        waiting.set_result("handed_off")
        return JSONResponse({"placed": transfer_id})

    @app.post("/pd/abort/{request_id}")
    async def abort(request_id: str) -> JSONResponse:
        if (waiting := placed.get(request_id)) is not None and not waiting.done():
            waiting.set_result("aborted")
        return JSONResponse({"aborted": request_id})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=("decode", "prefill"), required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default=None, help="checkpoint dir (its tokenizer); default: the tiny demo")
    parser.add_argument("--step-ms", type=float, default=0.0, help="decode: time between a stream's frames")
    ns = parser.parse_args(argv)
    from pdserve.model.demo_checkpoint import default_model_dir
    from pdserve.tokenizer import load_tokenizer

    book = FrameBook(load_tokenizer(ns.model or str(default_model_dir("tiny"))))
    app = decode_app(book, step_s=ns.step_ms / 1e3) if ns.role == "decode" else prefill_app(book)
    uvicorn.run(app, host=ns.host, port=ns.port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
