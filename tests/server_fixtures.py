"""Helpers for tests/test_server.py: a real pdserve HTTP server on a background thread, SSE parsing,
and the "nothing leaked" check.

The server runs in-process (uvicorn on a thread) with its engine in an engine core process
(`EngineCoreClient`, as `pdserve serve` runs it), or with PDSERVE_ENGINE_IN_PROCESS=1 on a thread
inside `AsyncLLM`. Tests look at the engine after a request through its stats: no unfinished
request, every KV block back in the pool.
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

from pdserve import envs
from pdserve.config import EngineArgs
from pdserve.engine.async_llm import AsyncLLM
from pdserve.engine.core_client import EngineCoreClient
from pdserve.engine.llm_engine import LLMEngine
from pdserve.serving.app import create_app
from pdserve.serving.config import ApiConfig

_STARTUP_TIMEOUT_S = 30.0
_LEAK_POLL_S = 5.0  # aborts are applied by the engine thread between steps, so allow a short wait


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class ServerHandle:
    client: AsyncLLM | EngineCoreClient
    server: uvicorn.Server
    thread: threading.Thread
    base_url: str
    model_name: str

    @property
    def engine(self) -> LLMEngine:
        """The engine object itself: only with the engine in this process (PDSERVE_ENGINE_IN_PROCESS=1)."""
        assert isinstance(self.client, AsyncLLM), "the engine runs in its own process"
        return self.client.engine

    def http(self, timeout_s: float = 60.0) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=timeout_s)

    def async_http(self, timeout_s: float = 60.0) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.base_url, timeout=timeout_s)

    def leaks(self) -> list[str]:
        """What the engine still holds; empty when every request is gone and every block is free."""
        found = []
        if isinstance(self.client, EngineCoreClient) and self.client.num_in_flight:
            found.append(f"the API process still streams {self.client.num_in_flight} requests")
        stats = self.client.stats()  # NOTE: the engine process sends them whenever it goes idle
        if stats.num_engine_requests:
            found.append("the engine has unfinished requests")
        if stats.num_scheduler_requests:
            found.append(f"the scheduler still tracks {stats.num_scheduler_requests} requests")
        if stats.num_free_kv_blocks != stats.num_kv_blocks:
            found.append(f"{stats.num_kv_blocks - stats.num_free_kv_blocks} of {stats.num_kv_blocks} KV blocks "
                         "are in use")
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


def start_server(model_dir: Path, model_name: str, api: ApiConfig | None = None, in_process: bool | None = None,
                 **engine_args: Any) -> ServerHandle:
    """`in_process`: the engine on a thread of this process (a test that patches the engine's code, or
    reads its log records); default: in its own process, unless PDSERVE_ENGINE_IN_PROCESS=1."""
    args = EngineArgs(model=str(model_dir), **engine_args)
    if in_process is None:
        in_process = envs.engine_in_process()
    client: AsyncLLM | EngineCoreClient = (AsyncLLM(LLMEngine.from_engine_args(args)) if in_process
                                           else EngineCoreClient.start(args))
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
