"""Workers as real processes (`pdserve serve --role …`), so tests can SIGKILL or SIGTERM them, a
real `redis-server` on a free port, and the router in this process (its counters are readable).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from pd_fixtures import Served, serve
from server_fixtures import free_port

from pdserve.bench.soak_load import redis_pending
from pdserve.disagg.config import QueueArgs, RouterConfig
from pdserve.disagg.router.app import create_router_app
from pdserve.disagg.router.core import PDRouter
from pdserve.model.qwen3_config import Qwen3ModelConfig
from pdserve.tokenizer import load_tokenizer

MODEL = "pd-proc"
_START_TIMEOUT_S = 120.0


@dataclass
class RedisServer:
    url: str
    port: int
    process: subprocess.Popen[bytes]
    workdir: Path

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, decode_responses=True)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)

    def start(self) -> None:
        """(Re)start on the same port, empty (no persistence)."""
        self.process = _redis_process(self.port, self.workdir)
        _wait_redis(self.url)


def _redis_process(port: int, workdir: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(workdir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait_redis(url: str) -> None:
    deadline = time.monotonic() + 10
    while True:
        try:
            redis.Redis.from_url(url).ping()
            return
        except redis.RedisError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def start_redis(workdir: Path) -> RedisServer:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server; .ci/run installs it)")
    port = free_port()
    server = RedisServer(f"redis://127.0.0.1:{port}/0", port, _redis_process(port, workdir), workdir)
    _wait_redis(server.url)
    return server


@dataclass
class WorkerProcess:
    role: str
    url: str
    popen: subprocess.Popen[bytes]
    log: Path

    def stats(self) -> dict:
        return httpx.get(f"{self.url}/pd/stats", timeout=5).json()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, sig)

    def tail(self) -> str:
        return self.log.read_text()[-3000:] if self.log.exists() else ""


def spawn_worker(role: str, model_dir: Path, log_dir: Path, flags: list[str], host: str = "127.0.0.1",
                 port: int | None = None, env: dict[str, str] | None = None) -> WorkerProcess:
    """`env`: variables added to this process's environment for the worker."""
    port = port or free_port()
    log = log_dir / f"{role}-{host}-{port}.log"
    cmd = [sys.executable, "-m", "pdserve.cli", "--log-level", "INFO", "serve", "--role", role, "--host", host,
           "--port", str(port), "--model", str(model_dir), "--dtype", "float32", "--num-threads", "1",
           "--kv-transport", "tcp", "--kv-host", host, *flags]
    with log.open("w") as out:
        popen = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    return WorkerProcess(role, f"http://{host}:{port}", popen, log)


def engine_process_of(server_pid: int, timeout_s: float = 10.0) -> int:
    """The engine core process (engine/core_proc.py; a prefill or decode worker's:
    disagg/worker/core.py) of the `pdserve serve` process `server_pid`."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = subprocess.run(["pgrep", "-P", str(server_pid), "-f",
                                "pdserve.engine.core_proc|pdserve.disagg.worker.core"],
                               capture_output=True, text=True).stdout.split()
        if len(found) == 1:
            return int(found[0])
        assert time.monotonic() < deadline, f"server {server_pid}: engine processes {found}"
        time.sleep(0.1)


def pid_gone(pid: int, timeout_s: float) -> bool:
    """Whether process `pid` exits (or is a zombie) within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z"):
                return True
        except (FileNotFoundError, IndexError):
            return True
        time.sleep(0.1)
    return False


def wait_healthy(workers: list[WorkerProcess]) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    for worker in workers:
        while True:
            assert worker.popen.poll() is None, f"{worker.role} worker exited:\n{worker.tail()}"
            try:
                if httpx.get(f"{worker.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"{worker.role} worker did not start:\n{worker.tail()}"
            time.sleep(0.2)


@dataclass
class InProcessRouter:
    client: PDRouter
    served: Served

    @property
    def url(self) -> str:
        return self.served.url

    def stop(self) -> None:
        self.served.stop()


def start_router(model_dir: Path, prefill: list[WorkerProcess], decode: list[WorkerProcess],
                 queue_url: str | None = None, deployment: str = "default", wait_ready: bool = True,
                 **options: Any) -> InProcessRouter:
    """`wait_ready=False`: return once it listens (workers that join by registering come later)."""
    config = RouterConfig(prefill=tuple(w.url for w in prefill), decode=tuple(w.url for w in decode),
                          queue=QueueArgs(queue_url or "memory", deployment), **options)
    client = PDRouter.from_config(config, load_tokenizer(str(model_dir)), Qwen3ModelConfig.from_dir(model_dir),
                                  str(model_dir), 1024)
    router = InProcessRouter(client, serve(create_router_app(client, MODEL)))
    if wait_ready:
        wait_router_ready(router)
    return router


def wait_router_ready(router: InProcessRouter, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not router.client.alive:
        assert time.monotonic() < deadline, router.client.workers()
        time.sleep(0.1)


@dataclass
class ProcessCluster:
    prefill: list[WorkerProcess]
    decode: list[WorkerProcess]
    router: InProcessRouter
    extra: list[WorkerProcess] = field(default_factory=list)

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop()
        for worker in self.prefill + self.decode + self.extra:
            worker.kill(signal.SIGKILL)
            worker.popen.wait(10)

    def held_blocks(self) -> dict[str, int]:
        """KV blocks in use on every live worker (prefix-cached free blocks do not count)."""
        held = {}
        for worker in self.prefill + self.decode:
            if worker.popen.poll() is None:
                info = httpx.get(f"{worker.url}/pd/info", timeout=5).json()
                held[worker.url] = info["num_kv_blocks"] - info["num_free_kv_blocks"]
        return held

    def wait_until_idle(self, timeout_s: float = 15.0) -> None:
        deadline = time.monotonic() + timeout_s
        while any(self.held_blocks().values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(self.held_blocks().values()), self.held_blocks()


def pending_entries(server: RedisServer, deployment: str = "default") -> int:
    """Entries delivered to a consumer of the prefill group and not acknowledged."""
    return redis_pending(server.url, deployment)
