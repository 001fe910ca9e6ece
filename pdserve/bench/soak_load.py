"""The soak's load and probes (soak.py runs them, soak_cluster.py checks with them): requests drawn
from a seeded mix, sent by client threads, and what a process holds (memory, children, the queue)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis

from pdserve.disagg.queue.redis_streams import RedisKeys

OK, CANCELLED, FAILED = "ok", "cancelled", "failed"
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
    status: str = FAILED
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
                outcome.status = CANCELLED
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
        outcome.status, outcome.text = OK, str(reply.json()["choices"][0]["text"])
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
                outcome.status = CANCELLED  # leaving the block closes the connection mid-stream
                return 200
    outcome.status, outcome.text = OK, text
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

