"""Servers that `pdserve bench sweep` and `compare` launch themselves: a colocated `pdserve serve`
or a `pdserve up` cluster, as a child process on a free port, ready once a completion goes through
(and, for `up`, once it said it is up: its own readiness check sends a completion too, which must
not land among the measured requests).

Each child gets its own process group and log file; `stop` sends SIGINT to the group (what `pdserve
up` handles as Ctrl-C: it stops its workers), then SIGKILL if it lingers, so no run leaves a
server behind for the next one to compete with.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

_STOP_TIMEOUT_S = 30.0
_UP_READY_LINE = "pdserve is up:"  # ops/up.py prints it once its own readiness check passed


@dataclass
class LocalServer:
    name: str
    url: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    ready_line: str = ""  # what the log says once the server calls itself ready ("": nothing to wait for)

    def log_tail(self, num_chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""


def free_port() -> int:
    from pdserve.ops.supervisor import free_port as free_local_port

    return free_local_port()


def up_threads_per_worker(num_workers: int) -> int:
    """The torch threads `pdserve up` gives each worker by default (CPUs // workers, at least 1)."""
    from pdserve.ops.threads import threads_per_worker

    return threads_per_worker(num_workers)


def colocated_args(port: int, num_threads: int, chunked_prefill: bool, engine_args: list[str]) -> list[str]:
    chunked = "--enable-chunked-prefill" if chunked_prefill else "--no-enable-chunked-prefill"
    return ["serve", "--port", str(port), "--num-threads", str(num_threads), chunked, *engine_args]


def pd_args(port: int, num_prefill: int, num_decode: int, threads_per_worker: int, engine_args: list[str]) -> list[str]:
    # NOTE: `pdserve up` passes unknown flags to every worker after its own `--num-threads`, so this
    # one wins over up's cpu_count // workers split. No supervisor metrics: only `port` is known free.
    return ["up", "--port", str(port), "--supervisor-port", "0", "--prefill", str(num_prefill), "--decode",
            str(num_decode), "--num-threads", str(threads_per_worker), *engine_args]


def replicas_args(port: int, num_replicas: int, threads_per_replica: int, engine_args: list[str]) -> list[str]:
    """`pdserve up --colocated N`: N colocated replicas behind a balancer (engine flags to each)."""
    return ["up", "--port", str(port), "--supervisor-port", "0", "--colocated", str(num_replicas), "--num-threads",
            str(threads_per_replica), *engine_args]


def start(name: str, cli_args: list[str], port: int, log_dir: Path) -> LocalServer:
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    cmd = [sys.executable, "-m", "pdserve.cli", "--log-level", "WARNING", *cli_args]
    with log_path.open("w") as log:  # a file, not a pipe: nobody would drain a pipe
        popen = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    # NOTE: `pdserve up` sends its own completions until one goes through, 0.5 s apart: one sent after
    # ours went through would run beside the first measured requests (and count in their metrics)
    return LocalServer(name, f"http://127.0.0.1:{port}", popen, log_path,
                       ready_line=_UP_READY_LINE if cli_args[:1] == ["up"] else "")


def wait_ready(server: LocalServer, timeout_s: float) -> None:
    """Until one completion goes through (raises RuntimeError, with the log's tail, if the process dies)."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=server.url, timeout=30) as http:
        while time.monotonic() < deadline:
            if server.popen.poll() is not None:
                raise RuntimeError(f"{server.name} exited with status {server.popen.returncode}:\n"
                                   f"{server.log_tail()}")
            try:
                if http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2}).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        while time.monotonic() < deadline and server.popen.poll() is None:
            if server.ready_line in server.log_tail(1 << 20):
                return
            time.sleep(0.1)
        if server.popen.poll() is not None:
            raise RuntimeError(f"{server.name} exited with status {server.popen.returncode}:\n"
                               f"{server.log_tail()}")
    raise RuntimeError(f"{server.name} served nothing within {timeout_s:.0f} s:\n{server.log_tail()}")


def stop(server: LocalServer) -> None:
    if server.popen.poll() is None:
        os.killpg(server.popen.pid, signal.SIGINT)
    try:
        server.popen.wait(_STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(server.popen.pid, signal.SIGKILL)
        server.popen.wait()


@contextmanager
def running(name: str, cli_args: list[str], port: int, log_dir: Path, ready_timeout_s: float) -> Iterator[LocalServer]:
    server = start(name, cli_args, port, log_dir)
    try:
        wait_ready(server, ready_timeout_s)
        yield server
    finally:
        stop(server)
