"""The floor under the router's cost per streamed chunk: the least a Python relay on this stack
(uvicorn, uvloop, httptools: what `pdserve router` runs on) spends per chunk when tokens arrive a
decode step at a time, with none of the router's own work.

    python -m pdserve.bench.relay_floor --port 8300 --step-ms 20 [--stack bare|serving]
                                                                      # router_cost --floor runs both

A bare ASGI app (no FastAPI, no middleware). POST /v1/completions (`max_tokens`, streamed) opens a
stream; one ticker task, every `--step-ms` (the stand-in decode's step clock), puts one token into
the queue of every open stream, as the router's frame reader puts each request's frame into its
queue after reading a decode step's frames. Each stream's task wakes, writes the chunk's JSON as
the router does (`ChunkJson`) and sends it: one queue wake-up and one socket write a chunk, the two
things the router cannot avoid per streamed token. `router_cost --floor` drives it with the very
load it drives the router with.

`--stack serving`: the same relay through what the router's streamed answer passes on its way out:
a FastAPI app with pdserve's middleware (serving/app.py `install_middleware`), the chunks an async
generator framed by `sse_stream` and written by `EventStreamResponse` (events ready together in one
write). What the router spends above this is its own: frames to outputs, the generator chain from
the frame stream to the OpenAI layer, its metrics, its calls to the workers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request

from pdserve import envs
from pdserve.bench.router_standins import next_step
from pdserve.serving.app import install_middleware
from pdserve.serving.config import ApiConfig
from pdserve.serving.event_stream import EventStreamResponse
from pdserve.serving.sse import ChunkJson, sse_stream, to_json

_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


class FloorRelay:
    """The ASGI app: every open stream's queue, and the ticker that feeds them."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.streams: dict[int, asyncio.Queue[str]] = {}
        self._ticker: asyncio.Task[None] | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["path"] == "/v1/completions":
            await self._completion(receive, send)
        else:  # /ready, anything else
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._ticker = asyncio.create_task(self.tick())
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._ticker is not None:
                    self._ticker.cancel()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def tick(self) -> None:
        """A decode step: one token for every open stream, on the stand-in decode's step clock."""
        while True:
            await next_step(self.step_s)
            for queue in self.streams.values():
                queue.put_nowait(" token")

    def opened(self) -> asyncio.Queue[str]:
        queue: asyncio.Queue[str] = asyncio.Queue()
        self.streams[id(queue)] = queue
        return queue

    async def _completion(self, receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        max_tokens = int(json.loads(body)["max_tokens"])
        await send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
        async for chunk in self.chunks(max_tokens):
            await send({"type": "http.response.body", "body": f"data: {chunk}\n\n".encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    async def chunks(self, max_tokens: int) -> AsyncIterator[str]:
        """A stream's chunks' JSON: one a token as the ticker puts them, then the usage."""
        chunks = ChunkJson.of("cmpl-floor", "text_completion", 0, "standin")
        queue = self.opened()
        try:
            for n in range(max_tokens):
                text = await queue.get()
                finish = "length" if n == max_tokens - 1 else None
                yield chunks.chunk(f'[{{"index": 0, "text": {to_json(text)}, "logprobs": null, '
                                   f'"finish_reason": {to_json(finish)}, "stop_reason": null}}]')
        finally:
            self.streams.pop(id(queue), None)
        yield chunks.usage({"prompt_tokens": 1, "completion_tokens": max_tokens, "total_tokens": max_tokens + 1})


def serving_app(relay: FloorRelay) -> FastAPI:
    """`relay`'s streams through the serving side's app, middleware and SSE writer (`--stack serving`)."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        ticker = asyncio.create_task(relay.tick())
        yield
        ticker.cancel()

    app = FastAPI(lifespan=lifespan)
    install_middleware(app, ApiConfig())

    @app.get("/ready")
    async def ready() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/completions")
    async def completions(request: Request) -> EventStreamResponse:
        body = await request.json()
        return EventStreamResponse(sse_stream(relay.chunks(int(body["max_tokens"]))))

    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--step-ms", type=float, default=20.0, help="time between a stream's tokens")
    parser.add_argument("--stack", choices=("bare", "serving"), default="bare")
    ns = parser.parse_args(argv)
    if ns.step_ms <= 0:
        parser.error("--step-ms must be > 0 (a ticker at 0 would spin a core)")
    relay = FloorRelay(ns.step_ms / 1e3)
    app: Any = relay if ns.stack == "bare" else serving_app(relay)
    gc.collect()  # NOTE: as `pdserve router` sets its process up (ops/serve.py `run_server`)
    gc.freeze()
    envs.serving_switch_interval()
    uvicorn.run(app, host=ns.host, port=ns.port, log_level="warning", access_log=False,
                lifespan="on")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
