"""Decode recovery: time from a decode worker's loss (SIGKILL mid-stream) to the end of the resumed
stream (32 more tokens), with the prompt's KV re-sent from the prefill worker's cache vs recomputed.

    python -m pdserve.bench.kv_recovery [--preset small] [--prompt-len 2000] [--reps 2]

Two clusters of processes on this machine, one after the other (random weights of --preset,
float32, tcp transport, one thread each): 1 prefill worker, --reps + 1 decode workers, a router
(`pdserve router`, memory queue). They differ only in the prefill worker's prefix cache:
- prefill_cache: on (the default); the resumed job (prompt + tokens sent) finds the prompt's full
  blocks in the prefill worker's pool and computes only the rest;
- recompute: `--no-enable-prefix-caching`; the resumed job computes prompt + tokens sent.
Per repetition, a fresh random prompt streams greedily; after `--kill-after` tokens the decode
worker holding it is SIGKILLed; the time from the kill to the stream's last token (32 more) is
the recovery time plus 32 decode steps (not to the next token: tokens the lost worker made before
it died may still be on their way).
Medians of --reps after one warm-up request per cluster; the ratio is against recompute in the
same run. `pdserve:kv_recoveries_total{source}` from the router says how each was counted.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from pdserve.bench.common import hardware_line, print_table
from pdserve.bench.serve.local import free_port
from pdserve.model.demo_checkpoint import default_model_dir

_START_TIMEOUT_S = 300.0
_TOKENS_AFTER_KILL = 32


def _spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("w") as out:
        return subprocess.Popen([sys.executable, "-m", "pdserve.cli", *args], stdout=out, stderr=subprocess.STDOUT)


def _wait(url: str, path: str, procs: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while True:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a process exited while starting (see its log)")
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} not ready in {_START_TIMEOUT_S:g} s")
        time.sleep(0.3)


def _worker(role: str, model: str, logs: Path, extra: list[str]) -> tuple[str, subprocess.Popen[bytes]]:
    port = free_port()
    proc = _spawn(["serve", "--role", role, "--port", str(port), "--model", model, "--dtype", "float32",
                   "--num-threads", "1", "--kv-transport", "tcp", "--kv-transfer-timeout-ms", "5000", *extra],
                  logs / f"{role}-{port}.log")
    return f"http://127.0.0.1:{port}", proc


def _stream_and_kill(router: str, decode: dict[str, subprocess.Popen[bytes]], prompt: list[int],
                     kill_after: int) -> float:
    """Stream `prompt`; SIGKILL its decode worker after `kill_after` chunks; seconds from the kill to
    the stream's last token (`_TOKENS_AFTER_KILL` more)."""
    # NOTE: not to the next chunk: tokens the lost worker made before it died may still be on their
    # way, so the first chunk after the kill says nothing about the recovery
    body = {"prompt": prompt, "max_tokens": kill_after + _TOKENS_AFTER_KILL, "ignore_eos": True, "temperature": 0,
            "stream": True}
    killed_at: float | None = None
    recovered_s: float | None = None
    chunks = 0
    with httpx.Client(timeout=600) as http, http.stream("POST", router + "/v1/completions", json=body) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            if killed_at is not None:
                recovered_s = time.perf_counter() - killed_at
            chunks += 1
            if chunks == kill_after:
                url = next(u for u, p in decode.items()
                           if p.poll() is None and httpx.get(u + "/pd/stats", timeout=5).json()["in_flight"])
                decode[url].send_signal(signal.SIGKILL)
                killed_at = time.perf_counter()
                decode[url].wait(10)
    if recovered_s is None:
        raise RuntimeError("the stream ended without a token after the kill")
    time.sleep(0.5)  # NOTE: the hand-off's reply (what the router counts) may follow the last token
    return recovered_s


def _recoveries(router: str) -> dict[str, float]:
    counts: dict[str, float] = {}
    for line in httpx.get(router + "/metrics", timeout=10).text.splitlines():
        if line.startswith("pdserve:kv_recoveries_total{"):
            source = line.split('source="')[1].split('"')[0]
            counts[source] = float(line.rsplit(" ", 1)[1])
    return counts


def _run_mode(model: str, logs: Path, prefill_flags: list[str], prompts: list[list[int]],
              kill_after: int) -> tuple[list[float], dict[str, float]]:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        prefill_url, prefill = _worker("prefill", model, logs, prefill_flags)
        decode = dict(_worker("decode", model, logs, []) for _ in range(len(prompts) + 1))
        procs = [prefill, *decode.values()]
        for url in [prefill_url, *decode]:
            _wait(url, "/health", procs)
        port = free_port()
        router = f"http://127.0.0.1:{port}"
        procs.append(_spawn(["router", "--port", str(port), "--model", model, "--prefill", prefill_url,
                             "--decode", *decode], logs / "router.log"))
        _wait(router, "/ready", procs)
        warm_up = {"prompt": [random.randrange(1000, 20_000) for _ in range(64)], "max_tokens": 4}
        httpx.post(router + "/v1/completions", json=warm_up, timeout=600).raise_for_status()
        times = [_stream_and_kill(router, decode, prompt, kill_after) for prompt in prompts]
        return times, _recoveries(router)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--prompt-len", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--kill-after", type=int, default=8, help="tokens streamed before the decode worker dies")
    parser.add_argument("--log-dir", default=None, help="keep the processes' logs here (default: a temporary one)")
    ns = parser.parse_args()
    random.seed(0)
    model = str(default_model_dir(ns.preset))
    prompts = [[random.randrange(1000, 20_000) for _ in range(ns.prompt_len)] for _ in range(ns.reps)]
    results = {}
    with tempfile.TemporaryDirectory(prefix="kv-recovery-bench-") as temporary:
        for mode, flags in (("recompute", ["--no-enable-prefix-caching"]), ("prefill_cache", [])):
            logs = Path(ns.log_dir or temporary) / mode
            logs.mkdir(parents=True, exist_ok=True)
            results[mode] = _run_mode(model, logs, flags, prompts, ns.kill_after)
    print(hardware_line())
    print(f"model: {ns.preset} (random weights, float32); prompt {ns.prompt_len} tokens; decode SIGKILLed after "
          f"{ns.kill_after} tokens; medians of {ns.reps}")
    base = statistics.median(results["recompute"][0])
    rows = [[mode, f"{statistics.median(times) * 1000:.0f}", f"{statistics.median(times) / base:.2f}x",
             json.dumps(counts, sort_keys=True)] for mode, (times, counts) in results.items()]
    print_table(["recovery", f"loss -> last of {_TOKENS_AFTER_KILL} more tokens (ms)", "vs recompute",
                 "kv_recoveries_total"], rows)


if __name__ == "__main__":
    main()
