"""Workers joining and leaving a running router, as real processes: through DNS (a real dnsmasq on
a free port, answering from a hosts directory it re-reads on change, the way a headless Service's
records change) and through registration (`--register`). The router is never restarted."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from pd_fixtures import serve
from process_cluster import MODEL, WorkerProcess, spawn_worker, wait_healthy
from server_fixtures import free_port

from pdserve.disagg.config import RouterConfig
from pdserve.disagg.control import WorkerInfo
from pdserve.disagg.router.app import create_router_app
from pdserve.disagg.router.core import PDRouter
from pdserve.model.qwen3_config import Qwen3ModelConfig
from pdserve.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow  # worker processes, a DNS server
FLAGS = ["--num-kv-blocks", "256"]
NAME = "decode.pdserve.test"


def _until(condition: Callable[[], bool], what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.1)


class Dns:
    """dnsmasq answering for *.test from the files in `hosts` (re-read when they change)."""

    def __init__(self, workdir: Path) -> None:
        if shutil.which("dnsmasq") is None:
            pytest.skip("dnsmasq is not installed (apt-get install -y dnsmasq; .ci/run installs it)")
        self.hosts = workdir / "hosts"
        self.hosts.mkdir()
        self.port = free_port()
        user = ["--user=root"] if _is_root() else []
        self.process = subprocess.Popen(
            ["dnsmasq", "--keep-in-foreground", "--conf-file=/dev/null", "--no-resolv", "--no-hosts",
             "--local=/test/", f"--port={self.port}", "--listen-address=127.0.0.1", "--bind-interfaces",
             f"--hostsdir={self.hosts}", "--local-ttl=0", "--pid-file=", *user],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def publish(self, *addresses: str) -> None:
        """NAME's A records are now `addresses` (written whole, then renamed: one change)."""
        staging = self.hosts.parent / "records"
        staging.write_text("".join(f"{address} {NAME}\n" for address in addresses))
        staging.replace(self.hosts / "records")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(10)


def _is_root() -> bool:
    import os

    return os.geteuid() == 0


def _router(model_dir: Path, **options: object) -> tuple[PDRouter, str, Callable[[], None]]:
    config = RouterConfig(**options)  # type: ignore[arg-type]
    client = PDRouter.from_config(config, load_tokenizer(str(model_dir)), Qwen3ModelConfig.from_dir(model_dir),
                                  str(model_dir), 1024)
    served = serve(create_router_app(client, MODEL))
    return client, served.url, served.stop


def _decode_urls(http: httpx.Client, ready: bool = True) -> set[str]:
    return {w["url"] for w in http.get("/workers").json() if w["role"] == "decode" and w["ready"] == ready}


def _complete(http: httpx.Client) -> httpx.Response:
    return http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello there", "max_tokens": 4,
                                              "temperature": 0})


@pytest.fixture
def workers() -> Iterator[list[WorkerProcess]]:
    started: list[WorkerProcess] = []
    yield started
    for worker in started:
        worker.kill(signal.SIGKILL)
        worker.popen.wait(10)


def test_dns_adds_and_removes_decode_workers_at_runtime(model_dirs: dict[str, Path], tmp_path: Path,
                                                        workers: list[WorkerProcess]) -> None:
    dns = Dns(tmp_path)
    port = free_port()
    workers += [spawn_worker("prefill", model_dirs["tiny"], tmp_path, FLAGS),
                *(spawn_worker("decode", model_dirs["tiny"], tmp_path, FLAGS, host=h, port=port)
                  for h in ("127.0.0.2", "127.0.0.3"))]
    first, second = (f"http://127.0.0.{i}:{port}" for i in (2, 3))
    dns.publish("127.0.0.2")
    wait_healthy(workers)
    router, url, stop = _router(model_dirs["tiny"], prefill=(workers[0].url,), decode=(f"dns:{NAME}:{port}",),
                                dns_server=f"127.0.0.1:{dns.port}", dns_interval_s=0.5)
    try:
        with httpx.Client(base_url=url, timeout=60) as http:
            _until(lambda: _decode_urls(http) == {first}, "the first decode worker is in the pool")
            refused = http.post("/pd/register", json={"role": "decode", "url": "http://127.0.0.9:1"})
            assert refused.status_code == 403 and "--accept-registrations" in refused.json()["error"]["message"]
            assert _complete(http).status_code == 200
            dns.publish("127.0.0.2", "127.0.0.3")
            _until(lambda: _decode_urls(http) == {first, second}, "DNS adds the second", timeout_s=10)
            dns.publish("127.0.0.3")
            _until(lambda: {w["url"] for w in http.get("/workers").json()} == {workers[0].url, second},
                   "DNS removes the first", timeout_s=10)
            served_before = _served(second)
            assert all(_complete(http).status_code == 200 for _ in range(3))
            assert _served(second) == served_before + 3  # every request went to the one DNS still lists
    finally:
        stop()
        dns.stop()


def _served(decode_url: str) -> int:
    """Requests a decode worker streamed to the end (its /metrics)."""
    text = httpx.get(f"{decode_url}/metrics", timeout=5).text
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
               if line.startswith("vllm:e2e_request_latency_seconds_count"))


def _not_ready_worker() -> tuple[str, dict[str, int], Callable[[], None]]:
    """A decode worker that answers /pd/info but never says ready, and counts what it is asked."""
    calls = {"info": 0, "reserve": 0}
    app = FastAPI()

    @app.get("/pd/info")
    async def info() -> WorkerInfo:
        calls["info"] += 1
        return WorkerInfo(role="decode", model=MODEL, kv_layout={}, kv_transport="tcp", kv_address="127.0.0.1:1",
                          ready=False, num_running=0, num_waiting=0, num_free_kv_blocks=1000, num_kv_blocks=1000)

    @app.post("/pd/reserve")
    async def reserve() -> dict[str, str]:
        calls["reserve"] += 1
        return {}

    served = serve(app)
    return served.url, calls, served.stop


def test_registered_workers_join_when_ready_and_leave_when_they_drain(
        model_dirs: dict[str, Path], tmp_path: Path, workers: list[WorkerProcess]) -> None:
    router, url, stop = _router(model_dirs["tiny"], accept_registrations=True, registration_ttl_s=5)
    stub_url, calls, stop_stub = _not_ready_worker()
    try:
        with httpx.Client(base_url=url, timeout=60) as http:
            assert http.post("/pd/register", json={"role": "decode", "url": "not a url"}).status_code == 400
            assert http.post("/pd/register", json={"role": "decode", "url": stub_url}).status_code == 200
            register = ["--register", url]
            workers += [spawn_worker(role, model_dirs["tiny"], tmp_path, FLAGS + register)
                        for role in ("prefill", "decode")]
            _until(lambda: router.alive and router.pool.any_ready("prefill"), "both workers registered", 120)
            replies = [_complete(http) for _ in range(4)]
            assert [r.status_code for r in replies] == [200] * 4
            assert calls["info"] > 0 and calls["reserve"] == 0  # polled, never given a request
            decode = workers[1]
            decode.kill(signal.SIGTERM)
            assert decode.popen.wait(30) == 0
            _until(lambda: decode.url not in {w["url"] for w in http.get("/workers").json()},
                   "the drained worker is gone", timeout_s=5)
            assert "deregistered" in decode.tail()
            reply = _complete(http)
            assert reply.status_code == 503 and "no decode worker" in reply.json()["error"]["message"]
    finally:
        stop()
        stop_stub()
