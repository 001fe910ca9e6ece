"""`python -m pdserve.bench.soak` (scripts/soak.sh): minutes of mixed load through `pdserve up
--queue redis://…` while things go wrong on a schedule, then proof that nothing was lost.

The run:
- a Redis of its own (append-only file, fsync on every write: a restart keeps the queue) and
  `pdserve up --queue` with P prefill and D decode workers over TCP, float32;
- `--concurrency` client threads send requests drawn from a seeded mix for `--duration` seconds:
  prompts 8-600 tokens, 4-64 output tokens, greedy or seeded sampling, streamed or not; a
  `--cancel-fraction` of them are cancelled at a random point (a stream closed after a random
  number of chunks, a plain request given up after a random time). A 503 or 429 is retried after
  half a second (as the OpenAI SDK does), at most 40 times;
- at 25 % of the duration a prefill worker is SIGKILLed, at 50 % a decode worker, at 75 % Redis
  is restarted (SIGTERM, then started again on its port and directory).

The checks at the end (exit status 1 if any fails):
- every request that was not cancelled got an answer, and that answer is the colocated engine's
  (`LLM.generate` on the same weights and sampling parameters: greedy and seeded alike);
- no worker holds a KV block (prefix-cached free blocks do not count), no queue entry is pending;
- the resident memory of every process there from the start to the end (restarted workers have
  not warmed up) grew < 10 % from the end of the warm-up (default 10 % of the run; keep it before
  the first fault at 25 %).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis

from pdserve.bench.common import hardware_line, print_table
from pdserve.disagg.queue.redis_streams import RedisKeys

_OK, _CANCELLED, _FAILED = "ok", "cancelled", "failed"
_RETRY_STATUSES = (429, 503)
_MAX_RETRIES = 40
_FIRST_SPECIAL_TOKEN_ID = 151643  # prompts are drawn below the Qwen3 special tokens


@dataclass(frozen=True, slots=True)
class Spec:
    """One request of the mix."""

    prompt: tuple[int, ...]
    max_tokens: int
    seed: int | None  # None: greedy
    stream: bool
    cancel_after: float | None  # chunks (stream) or seconds (plain) before giving up; None: never

    def sampling(self) -> dict[str, Any]:
        """The sampling parameters, as the request body and `SamplingParams` both spell them."""
        random_ = {"temperature": 0.8, "top_p": 0.95, "seed": self.seed}
        return {"max_tokens": self.max_tokens, "ignore_eos": True,
                **({"temperature": 0.0} if self.seed is None else random_)}

    def body(self) -> dict[str, object]:
        return {"prompt": list(self.prompt), "stream": self.stream, **self.sampling()}


@dataclass
class Outcome:
    spec: Spec
    status: str = _FAILED
    text: str = ""
    retries: int = 0
    error: str = ""
    started: float = field(default_factory=time.monotonic)
    ended: float = 0.0


def draw(rng: random.Random, cancel_fraction: float) -> Spec:
    length = rng.choice([rng.randint(8, 64), rng.randint(64, 600)])
    max_tokens = rng.randint(4, 64)
    stream = rng.random() < 0.5
    cancel = None
    if rng.random() < cancel_fraction:
        cancel = float(rng.randint(1, max_tokens - 1)) if stream and max_tokens > 1 else rng.uniform(0.05, 1.5)
    return Spec(tuple(rng.randrange(_FIRST_SPECIAL_TOKEN_ID) for _ in range(length)), max_tokens,
                None if rng.random() < 0.7 else rng.randrange(2**31), stream, cancel)


def send(http: httpx.Client, url: str, spec: Spec) -> Outcome:
    outcome = Outcome(spec)
    while True:
        try:
            status = _stream(http, url, spec, outcome) if spec.stream else _plain(http, url, spec, outcome)
        except httpx.TimeoutException:
            if spec.cancel_after is not None and not spec.stream:
                outcome.status = _CANCELLED
                return outcome
            outcome.error = "timed out"
            return outcome
        except httpx.HTTPError as exc:
            outcome.error = repr(exc)
            return outcome
        if status in _RETRY_STATUSES and outcome.retries < _MAX_RETRIES:
            outcome.retries += 1
            time.sleep(0.5)
            continue
        return outcome


def _plain(http: httpx.Client, url: str, spec: Spec, outcome: Outcome) -> int:
    timeout = spec.cancel_after if spec.cancel_after is not None else 300.0
    reply = http.post(f"{url}/v1/completions", json=spec.body(), timeout=timeout)
    if reply.status_code == 200:
        outcome.status, outcome.text = _OK, str(reply.json()["choices"][0]["text"])
    else:
        outcome.error = f"HTTP {reply.status_code}: {reply.text[:200]}"
    return reply.status_code


def _stream(http: httpx.Client, url: str, spec: Spec, outcome: Outcome) -> int:
    text, chunks = "", 0
    with http.stream("POST", f"{url}/v1/completions", json=spec.body(), timeout=300.0) as reply:
        if reply.status_code != 200:
            outcome.error = f"HTTP {reply.status_code}: {reply.read()[:200]!r}"
            return reply.status_code
        for line in reply.iter_lines():
            data = line.removeprefix("data: ")
            if not line.startswith("data: ") or data == "[DONE]":
                continue
            event = json.loads(data)
            if "error" in event:
                outcome.error = f"in-band error: {event['error']}"
                return 200
            text += event["choices"][0]["text"]
            chunks += 1
            if spec.cancel_after is not None and chunks >= spec.cancel_after:
                outcome.status = _CANCELLED  # leaving the block closes the connection mid-stream
                return 200
    outcome.status, outcome.text = _OK, text
    return 200


@dataclass
class Load:
    """The client threads; each draws from its own seeded generator until told to stop."""

    url: str
    concurrency: int
    cancel_fraction: float
    seed: int
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self) -> list[threading.Thread]:
        threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(self.concurrency)]
        for thread in threads:
            thread.start()
        return threads

    def stop(self, threads: list[threading.Thread]) -> None:
        self._stop.set()
        for thread in threads:
            thread.join(600)

    def _client(self, index: int) -> None:
        rng = random.Random(self.seed * 1000 + index)
        with httpx.Client() as http:
            while not self._stop.is_set():
                outcome = send(http, self.url, draw(rng, self.cancel_fraction))
                outcome.ended = time.monotonic()
                with self._lock:
                    self.outcomes.append(outcome)


def main(argv: list[str] | None = None) -> int:
    from pdserve.bench import soak_cluster

    ns = _parser().parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="pdserve-soak-"))
    print(f"hardware: {hardware_line()}\nsoak: {ns.duration:g} s, {ns.concurrency} clients, {ns.prefill} prefill + "
          f"{ns.decode} decode, {ns.cancel_fraction:.0%} cancelled; logs in {workdir}", flush=True)
    with soak_cluster.Cluster.start(ns, workdir) as cluster:
        load = Load(cluster.url, ns.concurrency, ns.cancel_fraction, ns.seed)
        threads = load.run()
        events = cluster.run_schedule(ns.duration, ns.warmup)
        load.stop(threads)
        report = soak_cluster.check(cluster, load.outcomes, ns, events)
    print_table(["check", "result", "ok"], [[r.name, r.value, "yes" if r.ok else "NO"] for r in report])
    if ns.save:
        ns.save.write_text(json.dumps([asdict(r) for r in report], indent=2))
    return 0 if all(r.ok for r in report) else 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load (the schedule scales with it)")
    p.add_argument("--warmup", type=float, default=None, help="seconds before the memory baseline (default 10 %%)")
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--cancel-fraction", type=float, default=0.2)
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--model", default=None, help="checkpoint dir (default: the embedded tiny demo model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-rss-growth", type=float, default=0.10)
    p.add_argument("--save", type=Path, default=None, help="the checks as JSON")
    return p


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def children(pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in found]


def kill(pid: int, sig: signal.Signals = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def redis_pending(url: str, deployment: str = "default") -> int:
    """Entries delivered to a consumer of the prefill group and not acknowledged."""
    client = redis.Redis.from_url(url, decode_responses=True)
    stream = RedisKeys(deployment).stream
    if not client.exists(stream):
        return 0
    return sum(int(g["pending"]) for g in client.xinfo_groups(stream))


if __name__ == "__main__":
    sys.exit(main())
