"""Helpers for tests/test_server.py: a real pdserve HTTP server on a background thread, SSE parsing,
and the "nothing leaked" check.

The server runs in-process (uvicorn on a thread, the engine on its own thread inside `AsyncLLM`) so
tests can look at the engine after a request: no unfinished request, every KV block back in the pool.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from pdserve.config import ApiConfig, EngineArgs
from pdserve.engine.async_llm import AsyncLLM
from pdserve.engine.llm_engine import LLMEngine
from pdserve.serving.app import create_app

_STARTUP_TIMEOUT_S = 30.0
_LEAK_POLL_S = 5.0  # aborts are applied by the engine thread between steps, so allow a short wait


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class ServerHandle:
    client: AsyncLLM
    server: uvicorn.Server
    thread: threading.Thread
    base_url: str
    model_name: str

    @property
    def engine(self) -> LLMEngine:
        return self.client.engine

    def http(self, timeout_s: float = 60.0) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=timeout_s)

    def async_http(self, timeout_s: float = 60.0) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.base_url, timeout=timeout_s)

    def leaks(self) -> list[str]:
        """What the engine still holds; empty when every request is gone and every block is free."""
        scheduler = self.engine.scheduler
        pool = scheduler.kv.pool
        found = []
        if self.engine.has_unfinished_requests():
            found.append("the engine has unfinished requests")
        if scheduler.num_unfinished:
            found.append(f"the scheduler still tracks {scheduler.num_unfinished} requests")
        if pool.num_free_blocks != pool.num_blocks:
            found.append(f"{pool.num_blocks - pool.num_free_blocks} of {pool.num_blocks} KV blocks are in use")
        return found

    def wait_until_idle(self, timeout_s: float = _LEAK_POLL_S) -> float:
        """Poll until nothing is left in the engine; returns the seconds it took. Asserts on timeout."""
        start = time.monotonic()
        while self.leaks() and self.client.alive and time.monotonic() - start < timeout_s:
            time.sleep(0.02)
        assert self.client.alive, "the engine thread died"
        assert not self.leaks(), f"after {timeout_s}s: {'; '.join(self.leaks())}"
        return time.monotonic() - start

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.client.shutdown()


def start_server(model_dir: Path, model_name: str, api: ApiConfig | None = None, **engine_args: Any) -> ServerHandle:
    args = EngineArgs(model=str(model_dir), **engine_args)
    client = AsyncLLM(LLMEngine.from_engine_args(args))
    port = free_port()
    config = uvicorn.Config(create_app(client, model_name, api=api), host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="pdserve-test-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + _STARTUP_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            client.shutdown()
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    return ServerHandle(client, server, thread, f"http://127.0.0.1:{port}", model_name)


# -- SSE ---------------------------------------------------------------------------------------

DONE = "[DONE]"


def parse_sse(body: str) -> list[dict[str, Any] | str]:
    """Every `data:` event of a complete SSE body, JSON-decoded; the final `[DONE]` stays a string."""
    events: list[dict[str, Any] | str] = []
    for block in body.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), f"not an SSE data event: {block!r}"
        data = block.removeprefix("data: ")
        events.append(data if data == DONE else json.loads(data))
    return events


def stream_events(http: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """POST a streaming request; asserts the SSE framing (200, event-stream, ends with exactly one
    [DONE]) and returns the JSON chunks."""
    response = http.post(path, json=body | {"stream": True})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(response.text)
    assert events and events[-1] == DONE, events[-3:]
    chunks = events[:-1]
    assert all(isinstance(chunk, dict) for chunk in chunks), "[DONE] must come once, last"
    for chunk in chunks:
        assert "error" not in chunk, chunk
    return chunks  # type: ignore[return-value]
