"""Thread-based PD clusters for tests: prefill and decode workers (uvicorn on threads, engines on
their own threads) and the router, all in this process, over real KV transports on loopback, so
tests can look inside every engine and service."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI
from server_fixtures import free_port

from pdserve.config import EngineArgs
from pdserve.disagg.client import WorkerClient
from pdserve.disagg.config import RouterConfig, WorkerConfig
from pdserve.disagg.control import FirstToken, HandOff, Placement, PrefillJob
from pdserve.disagg.router.app import create_router_app
from pdserve.disagg.router.core import PDRouter
from pdserve.disagg.worker.app import build_worker
from pdserve.disagg.worker.decode_service import DecodeService, FailurePolicy
from pdserve.disagg.worker.prefill_service import PrefillService
from pdserve.engine.async_llm import AsyncLLM
from pdserve.engine.llm_engine import LLMEngine
from pdserve.model.qwen3_config import Qwen3ModelConfig
from pdserve.serving.config import ApiConfig
from pdserve.tokenizer import load_tokenizer

MODEL = "pd-test"


@dataclass
class Served:
    server: uvicorn.Server
    thread: threading.Thread
    url: str

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def serve(app: FastAPI, port: int | None = None) -> Served:
    """`app` on uvicorn on a thread, on `port` (default: a free one)."""
    port = port or free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    return Served(server, thread, f"http://127.0.0.1:{port}")


@dataclass
class Cluster:
    router: Served
    workers: list[tuple[Served, AsyncLLM]]
    services: list[PrefillService | DecodeService]
    pd: PDRouter

    def service(self, kind: type[PrefillService] | type[DecodeService], index: int = 0) -> Any:
        return [s for s in self.services if isinstance(s, kind)][index]

    def leaks(self) -> list[str]:
        found = []
        for served, client in self.workers:
            engine = client.engine
            pool = engine.scheduler.kv.pool
            if engine.has_unfinished_requests() or engine.scheduler.held or engine.scheduler.remote:
                found.append(f"{served.url}: requests left")
            if pool.num_free_blocks != pool.num_blocks:
                found.append(f"{served.url}: {pool.num_blocks - pool.num_free_blocks} blocks held")
            if served.server.server_state.tasks:  # e.g. a stream that waits for a request nobody ends
                found.append(f"{served.url}: {len(served.server.server_state.tasks)} requests still answered")
        for service in self.services:  # nixl: the registrations of reservations that ended are revoked
            if isinstance(service, DecodeService) and getattr(service.receiver, "num_registrations", 0):
                found.append(f"decode: {service.receiver.num_registrations} NIXL registrations left")
        return found

    def wait_until_idle(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while (leaks := self.leaks()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not leaks, leaks  # NOTE: what held on at the deadline (a second look may find it gone)


def start_cluster(model_dir: Path, transport: str, num_prefill: int, num_decode: int,
                  max_num_batched_tokens: int = 64, policy: FailurePolicy = "recompute", timeout_s: float = 5.0,
                  prefill_options: dict[str, Any] | None = None, decode_block_size: int = 16,
                  decode_kv_blocks: int = 256, api: ApiConfig | None = None,
                  worker_options: dict[str, Any] | None = None,
                  engine_options: dict[str, dict[str, Any]] | None = None, **router_options: Any) -> Cluster:
    """`engine_options`: role -> extra EngineArgs of that role's engines."""
    workers = []
    services: list[PrefillService | DecodeService] = []
    urls: dict[str, list[str]] = {"prefill": [], "decode": []}
    for role, count in (("decode", num_decode), ("prefill", num_prefill)):
        for _ in range(count):
            args: dict[str, Any] = {"model": str(model_dir), "dtype": "float32", "max_num_batched_tokens":
                                    max_num_batched_tokens, "num_kv_blocks": decode_kv_blocks if role == "decode"
                                    else 256, "block_size": decode_block_size if role == "decode" else 16}
            engine = LLMEngine.from_engine_args(EngineArgs(**(args | (engine_options or {}).get(role, {}))))
            config = WorkerConfig(role=role, kv_transport=transport, kv_failure_policy=policy,
                                  kv_transfer_timeout_ms=round(timeout_s * 1000), **(worker_options or {}))
            worker = build_worker(engine, config, MODEL, sender_options=prefill_options)
            services.append(worker.service)
            served = serve(worker.app)
            workers.append((served, worker.client))
            urls[role].append(served.url)
    config = RouterConfig(prefill=tuple(urls["prefill"]), decode=tuple(urls["decode"]), **router_options)
    pd = PDRouter.from_config(config, load_tokenizer(str(model_dir)), Qwen3ModelConfig.from_dir(model_dir),
                              str(model_dir), max_model_len=1024)
    router = serve(create_router_app(pd, MODEL, api))
    deadline = time.monotonic() + 10
    while not pd.alive and time.monotonic() < deadline:  # the router's first poll of its workers
        time.sleep(0.02)
    return Cluster(router, workers, services, pd)


def stop_cluster(cluster: Cluster) -> None:
    cluster.router.stop()
    for served, client in cluster.workers:
        served.stop()
        client.shutdown()
    for service in cluster.services:
        service.close()


class StubPrefillClient(WorkerClient):
    """A WorkerClient stub's prefill side, as the memory queue sees a prefill worker: it takes each
    job at once (`on_accepted`) and every placement; `prefill_job` is what the stub does with a job."""

    async def place(self, url: str, placement: Placement) -> bool:
        return True

    async def prefill(self, url: str, job: PrefillJob, on_first_token: Callable[[FirstToken], None] | None = None,
                      on_accepted: Callable[[], None] | None = None) -> HandOff | None:
        if on_accepted is not None:
            on_accepted()
        return await self.prefill_job(url, job, on_first_token)

    async def prefill_job(self, url: str, job: PrefillJob,
                          on_first_token: Callable[[FirstToken], None] | None) -> HandOff | None:
        raise NotImplementedError
