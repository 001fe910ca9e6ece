"""`pdserve up`: router + prefill + decode workers as processes on this machine, one command.

Starts the decode workers, then the prefill workers, then the router; splits the CPU threads
between the workers; waits until one request has gone through end to end; prints the URL and a
curl line. Ctrl-C (or SIGTERM) stops everything. A process that dies is reported with its exit
status, and the rest are stopped: a half cluster is never left running silently.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, replace

import httpx

from pdserve.config import RouterConfig, WorkerConfig
from pdserve.config_flags import to_argv

_READY_TIMEOUT_S = 300.0


@dataclass
class Process:
    name: str
    url: str
    popen: subprocess.Popen[bytes]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _spawn(name: str, args: list[str], port: int) -> Process:
    cmd = [sys.executable, "-m", "pdserve.cli", *args]
    return Process(name, f"http://127.0.0.1:{port}", subprocess.Popen(cmd, start_new_session=True))


def _threads_per_worker(num_workers: int) -> int:
    return max(1, (os.cpu_count() or 1) // num_workers)


def launch(ns: argparse.Namespace, router: RouterConfig, worker: WorkerConfig,
           engine_flags: list[str]) -> list[Process]:
    """Start every process; the router last, so it finds its workers. `worker` is every worker's
    config but for its role; `router`'s worker URLs are filled in here."""
    even = _threads_per_worker(ns.num_prefill + ns.num_decode)
    threads = {"prefill": ns.prefill_threads or even, "decode": ns.decode_threads or even}
    logs = ["--log-level", ns.log_level, "--log-format", ns.log_format]
    processes = []
    for role, count in (("decode", ns.num_decode), ("prefill", ns.num_prefill)):
        for index in range(count):
            port = _free_port()
            # NOTE: later flags win: the engine flags over --num-threads (for every worker) and over
            # the worker config; the role and port over anything in the engine flags
            args = [*logs, "serve", "--num-threads", str(threads[role]), *to_argv(worker, exclude=("role",)),
                    *engine_flags, "--role", role, "--port", str(port)]
            processes.append(_spawn(f"{role}-{index}", args, port))
    urls = {role: tuple(p.url for p in processes if p.name.startswith(role)) for role in ("prefill", "decode")}
    router = replace(router, prefill=urls["prefill"], decode=urls["decode"])
    router_args = [*logs, "router", "--port", str(ns.port), *to_argv(router)]
    if ns.model:
        router_args += ["--model", ns.model]
    processes.append(_spawn("router", router_args, ns.port))
    return processes


def _dead(processes: list[Process]) -> list[Process]:
    return [p for p in processes if p.popen.poll() is not None]


def wait_ready(processes: list[Process], router_url: str) -> None:
    """Until a completion goes through the router (raises RuntimeError if a process dies)."""
    deadline = time.monotonic() + _READY_TIMEOUT_S
    body = {"prompt": "Hello", "max_tokens": 2}
    with httpx.Client(timeout=30) as http:
        while time.monotonic() < deadline:
            if dead := _dead(processes):
                raise RuntimeError(", ".join(f"{p.name} exited with status {p.popen.returncode}" for p in dead))
            try:
                if http.post(f"{router_url}/v1/completions", json=body).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    raise RuntimeError(f"no request went through within {_READY_TIMEOUT_S:.0f} s")


def stop(processes: list[Process]) -> None:
    """SIGTERM every process (workers drain), SIGKILL what is left after 15 s. A second Ctrl-C
    (or SIGTERM) meanwhile skips the wait; it never interrupts the cleanup itself, which would
    leave workers running with nobody to stop them."""
    force = False

    def hurry(*_: object) -> None:
        nonlocal force
        force = True

    signal.signal(signal.SIGINT, hurry)
    signal.signal(signal.SIGTERM, hurry)
    for process in reversed(processes):
        if process.popen.poll() is None:
            os.killpg(process.popen.pid, signal.SIGTERM)
    deadline = time.monotonic() + 15
    while not force and time.monotonic() < deadline and any(p.popen.poll() is None for p in processes):
        time.sleep(0.05)
    for process in processes:
        if process.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.popen.pid, signal.SIGKILL)
            process.popen.wait()


def run(ns: argparse.Namespace, router: RouterConfig, worker: WorkerConfig, engine_flags: list[str]) -> int:
    # Build the demo checkpoint once here, not concurrently in every worker.
    if ns.model is None:
        from pdserve.model.demo_checkpoint import default_model_dir

        default_model_dir()
    processes = launch(ns, router, worker, engine_flags)
    router_url = f"http://127.0.0.1:{ns.port}"
    stopping = False

    def interrupt(*_: object) -> None:
        """Ctrl-C / SIGTERM: unwind to the cleanup once; a second one before `stop` takes over
        must not interrupt the cleanup."""
        nonlocal stopping
        if not stopping:
            stopping = True
            raise KeyboardInterrupt

    # NOTE: SIGINT explicitly too: a shell that starts us in the background leaves it ignored
    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    try:
        wait_ready(processes, router_url)
        print(f"\npdserve is up: {ns.num_prefill} prefill + {ns.num_decode} decode workers behind {router_url}")
        print(f"  workers: curl -s {router_url}/workers")
        print(f"  try:     curl -s {router_url}/v1/chat/completions -H 'content-type: application/json' "
              "-d '{\"messages\":[{\"role\":\"user\",\"content\":\"Hello!\"}],\"max_tokens\":32}'")
        print("Ctrl-C stops everything.", flush=True)
        while not (dead := _dead(processes)):
            time.sleep(0.5)
        for process in dead:
            print(f"pdserve up: {process.name} ({process.url}) exited with status {process.popen.returncode}; "
                  "stopping the others", file=sys.stderr)
        return 1
    except RuntimeError as exc:
        print(f"pdserve up: {exc}; stopping", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        stop(processes)
