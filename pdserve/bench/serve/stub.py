"""A stub OpenAI server that answers at once: for measuring what the load client itself can drive,
and for testing the client's failure accounting without a model.

Raw asyncio HTTP/1.1 (keep-alive, Content-Length bodies), no web framework: the stub must cost far
less per request than the client it measures. A streaming reply is the whole SSE body in one write:
`max_tokens` one-token chunks, a usage chunk, `[DONE]`.

`faults` cycles over requests in arrival order: "ok", an HTTP status ("429", "500", ...),
"error_frame" (200, then an in-band error object mid-stream), or "drop" (close the connection
without answering).

    python -m pdserve.bench.serve.stub --port 8999
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import threading
from dataclasses import dataclass

_MODEL = "stub"
_REASONS = {200: "OK", 404: "Not Found", 429: "Too Many Requests", 500: "Internal Server Error",
            503: "Service Unavailable"}


@dataclass(frozen=True, slots=True)
class StubConfig:
    faults: tuple[str, ...] = ("ok",)


def _response(status: int, body: bytes, content_type: str) -> bytes:
    head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\ncontent-type: {content_type}\r\n"
            f"content-length: {len(body)}\r\n\r\n")
    return head.encode() + body


def _sse(payloads: list[dict | str]) -> bytes:
    return b"".join(b"data: " + (p if isinstance(p, str) else json.dumps(p)).encode() + b"\n\n" for p in payloads)


def _completion(request: dict, fault: str) -> bytes:
    max_tokens = int(request.get("max_tokens") or request.get("max_completion_tokens") or 16)
    prompt = request.get("prompt", "")
    prompt_tokens = len(prompt) if isinstance(prompt, list) else max(1, len(str(prompt).split()))
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens,
             "total_tokens": prompt_tokens + max_tokens}
    chat = "messages" in request
    if not request.get("stream"):
        choice = ({"index": 0, "message": {"role": "assistant", "content": "x" * max_tokens}} if chat
                  else {"index": 0, "text": "x" * max_tokens})
        return _response(200, json.dumps({"choices": [choice | {"finish_reason": "length"}], "usage": usage,
                                          "model": _MODEL}).encode(), "application/json")
    piece = (lambda: {"choices": [{"index": 0, "delta": {"content": "x"}}]}) if chat else (
        lambda: {"choices": [{"index": 0, "text": "x"}]})
    chunks: list[dict | str] = [piece() for _ in range(max_tokens)]
    if fault == "error_frame":
        chunks = chunks[:1] + [{"error": {"message": "stub: in-band failure", "type": "InternalServerError",
                                          "code": 500}}]
    elif request.get("stream_options", {}).get("include_usage"):
        chunks.append({"choices": [], "usage": usage})
    return _response(200, _sse([*chunks, "[DONE]"]), "text/event-stream")


class StubServer:
    """Serves until `stop()`; `faults` apply in order of arrival over all connections."""

    def __init__(self, config: StubConfig = StubConfig()) -> None:
        self._faults = itertools.cycle(config.faults)
        self.num_requests = 0
        self.port = 0  # the bound port, once serving

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                fields = (line.partition(":") for line in lines[1:] if line)
                headers = {k.strip().lower(): v.strip() for k, _, v in fields}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                if method == "GET" and path == "/v1/models":
                    writer.write(_response(200, json.dumps({"object": "list", "data": [{"id": _MODEL}]}).encode(),
                                           "application/json"))
                elif method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
                    self.num_requests += 1
                    fault = next(self._faults)
                    if fault == "drop":
                        break
                    if fault.isdigit():
                        error = {"error": {"message": f"stub: {fault}", "type": "stub", "code": int(fault)}}
                        writer.write(_response(int(fault), json.dumps(error).encode(), "application/json"))
                    else:
                        writer.write(_completion(json.loads(body), fault))
                else:
                    writer.write(_response(404, b'{"error": {"message": "not found"}}', "application/json"))
                await writer.drain()
                if headers.get("connection", "").lower() == "close":
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def serve(self, host: str, port: int, started: threading.Event | None = None,
                    stop: asyncio.Event | None = None) -> None:
        server = await asyncio.start_server(self._handle, host, port, backlog=1024)
        self.port = int(server.sockets[0].getsockname()[1])
        if started is not None:
            started.set()
        async with server:
            if stop is None:
                await server.serve_forever()
            else:
                await stop.wait()


class StubThread:
    """The stub on a background thread with its own event loop (tests). `url` once started."""

    def __init__(self, config: StubConfig = StubConfig()) -> None:
        self.server = StubServer(config)
        self._loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()
        started = threading.Event()
        self._thread = threading.Thread(target=self._loop.run_until_complete, name="pdserve-bench-stub", daemon=True,
                                        args=(self.server.serve("127.0.0.1", 0, started, self._stop),))
        self._thread.start()
        if not started.wait(10):
            raise RuntimeError("the stub server did not start")
        self.url = f"http://127.0.0.1:{self.server.port}"

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=10)

    def __enter__(self) -> StubThread:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8999)
    parser.add_argument("--faults", default="ok", help="comma-separated, cycled: ok, 429, 500, error_frame, drop")
    ns = parser.parse_args(argv)
    asyncio.run(StubServer(StubConfig(tuple(ns.faults.split(",")))).serve(ns.host, ns.port))


if __name__ == "__main__":
    main()
