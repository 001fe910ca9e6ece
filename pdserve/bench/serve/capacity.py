"""`pdserve bench capacity`: what the load client itself sustains, so a result can show the client
was not the bottleneck ("the client is never the bottleneck").

The stub server (`stub.py`) runs in its own process and answers every request at once with
`--output-len` one-token chunks; whatever rate the client reaches against it is the most it could
ever measure. Compare it with a run's request and token throughput: a run far below both numbers
measured the server, not the client.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx

from pdserve.bench.serve import local
from pdserve.bench.serve.client import LoadConfig, run_load
from pdserve.bench.serve.metrics import summarize
from pdserve.bench.serve.workloads import random_lengths


@dataclass(frozen=True, slots=True)
class ClientCapacity:
    requests_per_s: float
    output_tokens_per_s: float  # one token per streamed chunk against the stub: also chunks/s
    num_requests: int
    output_len: int
    concurrency: int

    def __str__(self) -> str:
        return (f"client capacity (stub server, {self.num_requests} streamed requests x {self.output_len} tokens, "
                f"concurrency {self.concurrency}): {self.requests_per_s:.0f} req/s, "
                f"{self.output_tokens_per_s:.0f} output tok/s (chunks/s)")


def _wait_listening(url: str, popen: subprocess.Popen[bytes], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and popen.poll() is None:
        try:
            httpx.get(f"{url}/v1/models", timeout=2).raise_for_status()
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError("the stub server did not start")


def measure(num_requests: int = 2000, output_len: int = 64, concurrency: int = 64) -> ClientCapacity:
    """Drive a stub server in a child process (its own core where there is one) at full speed."""
    port = local.free_port()
    cmd = [sys.executable, "-m", "pdserve.bench.serve.stub", "--port", str(port)]
    popen = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_listening(url, popen)
        work = random_lengths(num_requests, 16, output_len, seed=0)
        result = asyncio.run(run_load(work, LoadConfig(url, max_concurrency=concurrency, progress=False)))
    finally:
        popen.terminate()
        popen.wait(10)
    summary = summarize(result.records, result.duration_s)
    if summary.completed != num_requests:
        raise RuntimeError(f"only {summary.completed} of {num_requests} stub requests succeeded: {summary.failures}")
    return ClientCapacity(summary.request_throughput, summary.output_throughput, num_requests, output_len, concurrency)


def add_parser(modes: argparse._SubParsersAction) -> None:
    p = modes.add_parser("capacity", help="what this client sustains against a stub server that answers at once",
                         description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=2000)
    p.add_argument("--output-len", type=int, default=64, help="streamed one-token chunks per request")
    p.add_argument("--max-concurrency", "--concurrency", type=int, default=64)
    p.set_defaults(bench_run=run)


def run(ns: argparse.Namespace) -> int:
    from pdserve.bench.common import hardware_line

    print(f"hardware: {hardware_line()}")
    print(measure(ns.num_prompts, ns.output_len, ns.max_concurrency))
    return 0
