"""The PD router's own cost per streamed chunk: the real router (`pdserve router`, its
own process) in front of model-less prefill and decode stand-ins (router_standins.py, one process
each, the workers' `/pd/*` protocol), so no engine limits how fast tokens come.

    python -m pdserve.bench.router_cost [--streams 1,8,64,512] [--tokens 128] [--stream both]
                                        [--min-chunks 8192] [--step-ms 0] [--json PATH] [--profile]
                                        [--floor]

Load: N concurrent `/v1/completions` requests (`max_tokens` T, `ignore_eos`, greedy), streamed (SSE)
and/or not, from an aiohttp client in this process; as many waves of N as make `--min-chunks`
chunks. A chunk is one token the router relays: one decode frame in, one SSE event out when
streamed (checked: the client counts the tokens it got, which must be N x T per wave).

Reported per N and mode: the router process's CPU time (user + sys, /proc/PID/stat) over the run,
divided by the chunks relayed (µs/chunk, the pool polls included: they run all the time), the chunks
a second one router core sustains at that cost (1e6 / µs per chunk), and the wall tok/s (all three
processes share this machine's cores). Before the load, the router's idle CPU (ms a second: its
polls alone) is measured, so the reader sees their share. `--profile`: one more run (64 streams,
streamed) with the router under cProfile; prints its top functions by self and cumulative time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import pstats
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from pdserve.bench.common import print_table

_CLK_TCK = os.sysconf("SC_CLK_TCK")
_READY_TIMEOUT_S = 120.0
_PROMPT = "The router relays every token of this request"
PROFILE_STREAMS = 64
FLOOR_STACKS = ("bare", "serving")  # relay_floor.py --stack


@dataclass(frozen=True, slots=True)
class Row:
    streams: int
    stream: bool
    tokens: int  # max_tokens of each request
    waves: int
    chunks: int  # tokens the client got, over every wave
    expected_chunks: int  # streams x tokens x waves
    wall_s: float
    router_cpu_s: float
    us_per_chunk: float
    user_us_per_chunk: float  # of which in user space (Python) ...
    sys_us_per_chunk: float  # ... and in the kernel (syscalls; on loopback a send also delivers it to the reader)
    chunks_per_core_s: float
    tok_per_s: float


def cpu_seconds(pid: int) -> tuple[float, float]:
    """user and sys CPU seconds of process `pid` (all its threads) so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) / _CLK_TCK, int(fields[12]) / _CLK_TCK  # utime, stime: fields 14, 15 of stat(5)


def run_seconds(pid: int) -> float:
    """CPU seconds of process `pid`'s threads alive now, to the nanosecond (/proc/PID/task/*/schedstat:
    the idle router's polls cost a few ms a second, under /proc/PID/stat's 10 ms ticks)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Processes:
    """The stand-ins and the router, started and stopped here; their output goes to `log_dir`."""

    def __init__(self, model_dir: str, log_dir: Path, step_ms: float, frame_mux: bool = True) -> None:
        self.model_dir = model_dir
        self.frame_mux = frame_mux
        self.log_dir = log_dir
        self.step_ms = step_ms
        self._procs: list[subprocess.Popen[bytes]] = []
        self.prefill_url = self.decode_url = ""

    def _start(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - the child holds it
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        self._procs.append(proc)
        return proc

    def start_standins(self) -> None:
        for role in ("prefill", "decode"):
            port = free_port()
            self._start(role, [sys.executable, "-m", "pdserve.bench.router_standins", "--role", role, "--port",
                               str(port), "--model", self.model_dir, "--step-ms", str(self.step_ms)])
            setattr(self, f"{role}_url", f"http://127.0.0.1:{port}")
        for url in (self.prefill_url, self.decode_url):
            _wait_ready(url + "/pd/info")

    def start_router(self, profile_out: Path | None = None) -> tuple[subprocess.Popen[bytes], str]:
        """`pdserve router` over the stand-ins; with `profile_out`, under a profiler that SIGUSR1
        starts and SIGUSR2 stops, writing its stats there (`_PROFILED_ROUTER`)."""
        port = free_port()
        runner = [sys.executable, "-m", "pdserve.cli"] if profile_out is None else [
            sys.executable, "-c", _PROFILED_ROUTER, str(profile_out)]
        proc = self._start("router", [*runner, "router", "--host", "127.0.0.1",
                                      "--port", str(port), "--model", self.model_dir, "--served-model-name",
                                      "standin", "--prefill", self.prefill_url, "--decode", self.decode_url,
                                      "--max-queued-requests", "100000",
                                      "--frame-mux" if self.frame_mux else "--no-frame-mux"])
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url + "/ready", proc)
        return proc, url

    def start_floor(self, stack: str) -> tuple[subprocess.Popen[bytes], str]:
        """The relay floor (relay_floor.py, `stack`: bare or serving) in the router's place, fed by
        its own ticker."""
        port = free_port()
        proc = self._start(f"floor-{stack}", [sys.executable, "-m", "pdserve.bench.relay_floor", "--port",
                                              str(port), "--step-ms", str(self.step_ms), "--stack", stack])
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url + "/ready", proc)
        return proc, url

    def stop(self, proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def stop_all(self) -> None:
        for proc in reversed(self._procs):
            self.stop(proc)


def _wait_for_file(path: Path, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.is_file() and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(0.5)  # NOTE: written by now


def _wait_ready(url: str, proc: subprocess.Popen[bytes] | None = None) -> None:
    import httpx

    deadline = time.monotonic() + _READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited ({proc.returncode}) before it was ready")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready within {_READY_TIMEOUT_S:g} s")


async def _one(session: aiohttp.ClientSession, url: str, tokens: int, stream: bool) -> int:
    """One request; the tokens its client got (streamed: SSE events with text; else: usage)."""
    body: dict = {"model": "standin", "prompt": _PROMPT, "max_tokens": tokens, "temperature": 0.0,
                  "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    async with session.post(url + "/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:300]}")
        if not stream:
            return int((await response.json())["usage"]["completion_tokens"])
        chunks = 0
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            event = json.loads(line[6:])
            chunks += sum(1 for choice in event["choices"] if choice["text"])
        return chunks


async def _waves(url: str, streams: int, tokens: int, stream: bool, waves: int) -> int:
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        total = 0
        for _ in range(waves):
            total += sum(await asyncio.gather(*(_one(session, url, tokens, stream) for _ in range(streams))))
        return total


@dataclass(frozen=True, slots=True)
class Load:
    """One row's load: `streams` concurrent requests of `tokens` tokens each, streamed or not."""

    streams: int
    tokens: int
    stream: bool


def measure(router_pid: int, url: str, load: Load, min_chunks: int, profiled: bool = False) -> Row:
    """`profiled`: the router runs under `_PROFILED_ROUTER`, profiled over the measured waves only."""
    streams, tokens, stream = load.streams, load.tokens, load.stream
    waves = max(1, math.ceil(min_chunks / (streams * tokens)))
    # NOTE: warm-up: connections, first-call paths, the frame streams open (they close after 1 s idle:
    # a pause after it would run the measured load on the path of requests that find no stream open)
    asyncio.run(_waves(url, min(streams, 8), 8, stream, 1))
    if profiled:  # NOTE: no pause: its handler runs once the loop wakes, at the latest for the first request
        os.kill(router_pid, signal.SIGUSR1)
    (user0, sys0), t0 = cpu_seconds(router_pid), time.perf_counter()
    chunks = asyncio.run(_waves(url, streams, tokens, stream, waves))
    (user1, sys1), wall = cpu_seconds(router_pid), time.perf_counter() - t0
    if profiled:
        os.kill(router_pid, signal.SIGUSR2)
    user, kernel = user1 - user0, sys1 - sys0
    per_chunk = 1e6 / chunks if chunks else math.nan
    us = (user + kernel) * per_chunk
    return Row(streams, stream, tokens, waves, chunks, streams * tokens * waves, wall, user + kernel, us,
               user * per_chunk, kernel * per_chunk, 1e6 / us if us > 0 else math.inf, chunks / wall)


def idle_cpu_ms_per_s(router_pid: int, seconds: float) -> float:
    cpu0, t0 = run_seconds(router_pid), time.perf_counter()
    time.sleep(seconds)
    return (run_seconds(router_pid) - cpu0) / (time.perf_counter() - t0) * 1e3


# `pdserve router` (sys.argv[2:]) under cProfile, enabled by SIGUSR1 and by SIGUSR2 disabled and
# written to sys.argv[1]: only the measured load is profiled, not the start (imports). Run as
# `python -c` (a process of its own, as `python -m pdserve.cli` is).
_PROFILED_ROUTER = """
import cProfile, signal, sys
from pdserve.cli import main
out, args = sys.argv[1], sys.argv[2:]
profiler = cProfile.Profile()
def stop(*_):
    profiler.disable()
    profiler.dump_stats(out)
signal.signal(signal.SIGUSR1, lambda *_: profiler.enable())
signal.signal(signal.SIGUSR2, stop)
sys.exit(main(args))
"""


def profile_top(path: Path, limit: int = 25) -> dict[str, list[dict]]:
    """The profile's top `limit` functions by self (tottime) and by cumulative time."""
    stats = pstats.Stats(str(path))
    raw = stats.stats  # type: ignore[attr-defined]
    total = sum(tt for _, _, tt, _, _ in raw.values()) or 1.0

    def entry(key: tuple, value: tuple) -> dict:
        _, ncalls, tottime, cumtime, _ = value
        file, line, name = key
        return {"function": f"{_short(file)}:{line}({name})", "calls": ncalls, "self_s": round(tottime, 4),
                "cum_s": round(cumtime, 4), "self_share": round(tottime / total, 4)}

    by_self = sorted(raw.items(), key=lambda kv: kv[1][2], reverse=True)[:limit]
    by_cum = sorted(raw.items(), key=lambda kv: kv[1][3], reverse=True)[:limit]
    return {"total_self_s": [{"total": round(total, 3)}], "self": [entry(k, v) for k, v in by_self],
            "cumulative": [entry(k, v) for k, v in by_cum]}


def _short(file: str) -> str:
    for marker in ("site-packages/", "/pdserve/", "lib/python3"):
        if marker in file:
            return ("pdserve/" if marker == "/pdserve/" else "") + file.split(marker, 1)[1]
    return file


def _print_profile(top: dict[str, list[dict]], limit: int) -> None:
    print(f"\nrouter profile ({PROFILE_STREAMS} streams, streamed; cProfile over the measured load, "
          f"{top['total_self_s'][0]['total']} s of profiled time)")
    for key, title in (("self", "by self time"), ("cumulative", "by cumulative time")):
        print(f"\n{title}:")
        print_table(["function", "calls", "self s", "cum s", "self %"],
                    [[e["function"], str(e["calls"]), f"{e['self_s']:.3f}", f"{e['cum_s']:.3f}",
                      f"{100 * e['self_share']:.1f}"] for e in top[key][:limit]])


def _ratio(router_us: float, floor_us: float) -> str:
    """router / floor; "-" where the floor read no CPU (a load too small for /proc/PID/stat's ticks)."""
    return f"{router_us / floor_us:.2f}x" if floor_us > 0 else "-"


@contextlib.contextmanager
def _log_dir(keep: str | None) -> Iterator[Path]:
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        yield Path(keep)
    else:
        with tempfile.TemporaryDirectory(prefix="router-cost-") as tmp:
            yield Path(tmp)


def run(ns: argparse.Namespace) -> dict:
    from pdserve.model.demo_checkpoint import default_model_dir

    model_dir = ns.model or str(default_model_dir("tiny"))
    modes = {"on": [True], "off": [False], "both": [True, False]}[ns.stream]
    streams = [int(n) for n in ns.streams.split(",")]
    result: dict = {"tokens": ns.tokens, "step_ms": ns.step_ms, "frame_mux": ns.frame_mux,
                    "min_chunks": ns.min_chunks,
                    "loadavg": Path("/proc/loadavg").read_text().strip(), "cpus": os.cpu_count()}
    with _log_dir(ns.log_dir) as logs:
        procs = Processes(model_dir, logs, ns.step_ms, ns.frame_mux)
        try:
            procs.start_standins()
            router, url = procs.start_router()
            result["idle_router_cpu_ms_per_s"] = idle_cpu_ms_per_s(router.pid, ns.idle_s)
            loads = [Load(n, ns.tokens, stream) for stream in modes for n in streams]
            rows = [measure(router.pid, url, load, ns.min_chunks) for load in loads]
            result["rows"] = [asdict(row) for row in rows]
            procs.stop(router)
            if ns.floor:
                result["floor_rows"] = []
                for stack in FLOOR_STACKS:
                    floor, url = procs.start_floor(stack)
                    result["floor_rows"] += [asdict(measure(floor.pid, url, load, ns.min_chunks)) | {"stack": stack}
                                             for load in loads if load.stream]
                    procs.stop(floor)
            if ns.profile:
                out = logs / "router.prof"
                router, url = procs.start_router(profile_out=out)
                load = Load(PROFILE_STREAMS, ns.tokens, True)
                profiled = measure(router.pid, url, load, ns.min_chunks, profiled=True)
                _wait_for_file(out)
                procs.stop(router)
                result["profile"] = {"row": asdict(profiled), **profile_top(out, ns.profile_top)}
        finally:
            procs.stop_all()
    return result


def print_report(result: dict) -> None:
    print(f"router idle: {result['idle_router_cpu_ms_per_s']:.1f} ms CPU a second (pool polls); "
          f"loadavg before: {result['loadavg']}; {result['cpus']} CPUs; "
          f"{'one frame stream per decode worker' if result['frame_mux'] else 'a frame stream per request'}")
    print_table(["streams", "mode", "T", "chunks", "router CPU s", "µs/chunk", "user / sys", "chunks/s/core",
                 "wall tok/s"],
                [[str(r["streams"]), "stream" if r["stream"] else "no-stream", str(r["tokens"]),
                  f"{r['chunks']}" + ("" if r["chunks"] == r["expected_chunks"] else f" (want {r['expected_chunks']})"),
                  f"{r['router_cpu_s']:.2f}", f"{r['us_per_chunk']:.0f}",
                  f"{r['user_us_per_chunk']:.0f} / {r['sys_us_per_chunk']:.0f}", f"{r['chunks_per_core_s']:.0f}",
                  f"{r['tok_per_s']:.0f}"] for r in result["rows"]])
    if result.get("floor_rows"):
        print(f"\nthe floor (relay_floor.py: a relay on uvicorn with one queue wake-up and one write a chunk, tokens "
              f"every {result['step_ms']:g} ms; bare ASGI, and through the serving side's app and SSE writer), "
              "the same load:")
        router = {r["streams"]: r["us_per_chunk"] for r in result["rows"] if r["stream"]}
        print_table(["stack", "streams", "chunks", "µs/chunk", "user / sys", "router / floor"],
                    [[r["stack"], str(r["streams"]), str(r["chunks"]), f"{r['us_per_chunk']:.0f}",
                      f"{r['user_us_per_chunk']:.0f} / {r['sys_us_per_chunk']:.0f}",
                      _ratio(router[r["streams"]], r["us_per_chunk"])] for r in result["floor_rows"]])
    if "profile" in result:
        row = result["profile"]["row"]
        print(f"\nprofiled run: {row['us_per_chunk']:.0f} µs/chunk under cProfile (inflated by it)")
        _print_profile(result["profile"], 20)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", default="1,8,64,512", help="concurrent streams, comma-separated")
    parser.add_argument("--tokens", type=int, default=128, help="max_tokens of each request")
    parser.add_argument("--stream", choices=("on", "off", "both"), default="both")
    parser.add_argument("--min-chunks", type=int, default=8192, help="waves of N requests until this many chunks")
    parser.add_argument("--step-ms", type=float, default=0.0, help="decode stand-in: time between a stream's frames")
    parser.add_argument("--idle-s", type=float, default=3.0, help="how long the router's idle CPU is measured")
    parser.add_argument("--model", default=None, help="checkpoint dir (tokenizer, config); default: the tiny demo")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--profile", action="store_true", help=f"profile the router at {PROFILE_STREAMS} streams")
    parser.add_argument("--profile-top", type=int, default=25)
    parser.add_argument("--frame-mux", action=argparse.BooleanOptionalAction, default=True,
                        help="the router's frame stream per decode worker (its default), or a stream per request")
    parser.add_argument("--floor", action="store_true",
                        help="also measure the bare relay (relay_floor.py) under the same streamed load")
    parser.add_argument("--log-dir", default=None, help="keep the processes' logs (and the profile) here")
    ns = parser.parse_args(argv)
    if ns.floor and ns.step_ms <= 0:
        parser.error("--floor needs --step-ms > 0 (tokens a decode step apart)")
    result = run(ns)
    print_report(result)
    if ns.json:
        Path(ns.json).write_text(json.dumps(result, indent=2))
    bad = [r for r in result["rows"] + result.get("floor_rows", []) if r["chunks"] != r["expected_chunks"]]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
