"""The soak's deployment (its Redis and `pdserve up`), the faults it injects on a schedule, and the
checks at the end (pdserve/bench/soak.py runs them)."""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis

from pdserve.bench.soak_load import CANCELLED, OK, Outcome, children, kill, redis_pending, rss_bytes
from pdserve.ops.supervisor import free_port

_READY_TIMEOUT_S = 300.0
_IDLE_TIMEOUT_S = 60.0
_TIE_LOGPROB = 1e-4  # two best candidates this close are a tie float rounding may break either way
CHAOS_INTERVAL_S = (15.0, 30.0)  # --chaos: a SIGKILL every this many seconds (uniform)
FLAGS = ["--kv-transport", "tcp", "--dtype", "float32", "--num-kv-blocks", "1024", "--max-num-batched-tokens", "256"]


@dataclass
class Redis:
    port: int
    workdir: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        # NOTE: an append-only file fsynced on every write: a restart keeps the stream and its groups
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes",
             "--appendfsync", "always", "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                redis.Redis.from_url(self.url).ping()
                return
            except redis.RedisError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not answer on port {self.port}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(20)


@dataclass
class Cluster:
    url: str
    up: subprocess.Popen[bytes]
    log: Path
    redis: Redis
    model: str | None
    rss_before: dict[int, int] = field(default_factory=dict)
    original: set[int] = field(default_factory=set)  # the processes there when the load started
    chaos: random.Random = field(default_factory=random.Random)  # --chaos: draws the kills' times and targets

    @classmethod
    @contextmanager
    def start(cls, ns: argparse.Namespace, workdir: Path) -> Iterator[Cluster]:
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server is not installed (apt-get install -y redis-server)")
        store = Redis(free_port(), workdir / "redis")
        store.workdir.mkdir()
        store.start()
        port, log = free_port(), workdir / "up.log"
        model = ["--model", ns.model] if ns.model else []
        cmd = [sys.executable, "-m", "pdserve.cli", "up", "--port", str(port), "--supervisor-port", "0",
               "--queue", store.url, "--prefill", str(ns.prefill), "--decode", str(ns.decode), *FLAGS, *model]
        with log.open("w") as out:
            up = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        cluster = cls(f"http://127.0.0.1:{port}", up, log, store, ns.model)
        try:
            cluster.wait_for("pdserve is up", lambda: "pdserve is up" in log.read_text(), _READY_TIMEOUT_S)
            yield cluster
        finally:
            cluster.stop()

    def stop(self) -> None:
        if self.up.poll() is None:
            self.up.send_signal(signal.SIGINT)
            try:
                self.up.wait(60)
            except subprocess.TimeoutExpired:
                self.up.kill()
                self.up.wait()
        self.redis.stop()

    def wait_for(self, what: str, check: Any, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not check():
            if self.up.poll() is not None:
                raise RuntimeError(f"pdserve up exited while waiting for {what}:\n{self.log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {what} within {timeout_s:.0f} s:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)

    def workers(self) -> list[dict[str, Any]]:
        try:
            return list(httpx.get(f"{self.url}/workers", timeout=5).json())
        except (httpx.HTTPError, ValueError):
            return []

    def pid(self, url: str) -> int | None:
        port = url.rsplit(":", 1)[1]
        for pid in children(self.up.pid):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"--port" in argv and argv[argv.index(b"--port") + 1] == port.encode():
                return pid
        return None

    def processes(self) -> list[int]:
        """`up` and every process under it: the router, the workers, and the workers' engine
        processes (where their KV pools and transports live)."""
        found, frontier = [self.up.pid], [self.up.pid]
        while frontier:
            frontier = [child for pid in frontier for child in children(pid)]
            found += frontier
        return found

    def run_schedule(self, duration_s: float, warmup_s: float | None, chaos: random.Random | None = None) -> list[str]:
        """Sleeps through the load, injecting the faults; returns what was done, in order. With
        `chaos`, the faults are SIGKILLs every 15-30 s (drawn from it) of a random target instead."""
        start, events = time.monotonic(), []
        self.original = set(self.processes())  # NOTE: a worker restarted later has not warmed up: not measured
        baseline_s = warmup_s if warmup_s is not None else 0.1 * duration_s
        plan = [(baseline_s, "memory baseline"), (duration_s, "end of load")]
        plan += [(f * duration_s, "memory sample") for f in (0.2, 0.4, 0.6, 0.8, 0.9)]
        if chaos is None:
            plan += [(0.25 * duration_s, "SIGKILL a prefill worker"), (0.5 * duration_s, "SIGKILL a decode worker"),
                     (0.75 * duration_s, "restart Redis")]
        else:
            self.chaos = chaos
            at_s = chaos.uniform(*CHAOS_INTERVAL_S)
            while at_s < duration_s - CHAOS_INTERVAL_S[0] / 2:  # NOTE: the last kill has time to heal
                plan.append((at_s, "SIGKILL a random target"))
                at_s += chaos.uniform(*CHAOS_INTERVAL_S)
        for at_s, what in sorted(plan):
            time.sleep(max(0.0, start + at_s - time.monotonic()))
            events.append(f"{time.monotonic() - start:5.0f} s (t={time.monotonic():.1f}): {what}{self._do(what)}")
            print(events[-1], flush=True)
        return events

    def _do(self, what: str) -> str:
        if what == "memory baseline":
            self.rss_before = {pid: rss for pid in self.processes()
                               if pid in self.original and (rss := rss_bytes(pid)) is not None}
            return f" ({len(self.rss_before)} processes)"
        if what == "memory sample":  # NOTE: to tell a leak (steady growth) from a warm-up (a plateau)
            return ": " + ", ".join(f"{pid} {rss / 2**20:.0f} MiB" for pid in self.rss_before
                                    if (rss := rss_bytes(pid)) is not None)
        if what == "SIGKILL a random target":
            return self._kill_random()
        if what.startswith("SIGKILL"):
            role = "prefill" if "prefill" in what else "decode"
            ready = [w["url"] for w in self.workers() if w["role"] == role and w["ready"]]
            pid = self.pid(ready[0]) if ready else None
            if pid is None:
                return " (none ready: skipped)"
            kill(pid)
            return f" ({ready[0]}, pid {pid})"
        if what == "restart Redis":
            self.redis.stop()
            self.redis.start()
        return ""


    def _kill_random(self) -> str:
        """A prefill or decode worker's API process or its engine process, drawn at random among
        the ready workers (waiting up to 15 s for one: the previous kill may still be healing)."""
        role, part = self.chaos.choice(("prefill", "decode")), self.chaos.choice(("api", "engine"))
        deadline = time.monotonic() + 15.0
        while not (ready := sorted(w["url"] for w in self.workers() if w["role"] == role and w["ready"])):
            if time.monotonic() > deadline:
                return f" ({role}: none ready: skipped)"
            time.sleep(0.5)
        url = self.chaos.choice(ready)
        pid = self.pid(url)
        if pid is not None and part == "engine":
            pid = next((child for child in children(pid) if "pdserve.disagg.worker.core" in _argv(child)), None)
        if pid is None:
            return f" ({role} {part} of {url}: not found: skipped)"
        kill(pid)
        return f" ({role} {part} process of {url}, pid {pid})"


def _argv(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    value: str
    ok: bool


def check(cluster: Cluster, outcomes: list[Outcome], ns: argparse.Namespace, events: list[str]) -> list[Check]:
    done = [o for o in outcomes if o.status == OK]
    cancelled = [o for o in outcomes if o.status == CANCELLED]
    failed = [o for o in outcomes if o.status not in (OK, CANCELLED)]
    for outcome in failed[:5]:
        print(f"failed: {outcome.error}", flush=True)
    wrong, ties = _mismatches(done, cluster.model, cluster.log.parent / "mismatches.json")
    held, pending = _settle(cluster)
    growth = _rss_growth(cluster)
    worst = max(growth.values(), default=0.0)
    faults = [e for e in events if "SIGKILL" in e or "Redis" in e]
    expected = (lambda n: n >= 1) if ns.chaos else (lambda n: n == 3)
    return [
        Check("requests sent", str(len(outcomes)), len(outcomes) > 0),
        Check("answered (not cancelled)", str(len(done)), len(done) > 0),
        Check("cancelled by the client", f"{len(cancelled)} ({len(cancelled) / max(1, len(outcomes)):.0%})", True),
        Check("retried after 503/429", str(sum(o.retries for o in outcomes)), True),
        Check("failed", str(len(failed)), not failed),
        Check("answers unlike colocated", f"{wrong} of {len(done)}", wrong == 0),
        Check(f"of them greedy ties (top two within {_TIE_LOGPROB:g} where they part)", str(ties), True),
        Check("faults injected", str(len(faults)), all("skipped" not in e for e in faults) and expected(len(faults))),
        Check("KV blocks held at the end", str(held), not any(held.values())),
        Check("queue entries pending at the end", str(pending), pending == 0),
        Check(f"RSS growth (< {ns.max_rss_growth:.0%})", f"{worst:.1%} worst of {len(growth)} processes",
              worst < ns.max_rss_growth),
    ]


def _mismatches(done: list[Outcome], model: str | None, dump: Path | None = None) -> tuple[int, int]:
    """Answers that differ from the colocated engine's for the same prompt and sampling parameters,
    and how many of those are greedy ties (`_parted_at_a_tie`), not counted as wrong."""
    from pdserve import LLM, SamplingParams
    from pdserve.engine.llm import TokensPrompt
    from pdserve.model.demo_checkpoint import default_model_dir

    if not done:
        return 0, 0
    # NOTE: room for every request at once: the reference never preempts
    llm = LLM(model=model or str(default_model_dir()), dtype="float32", num_kv_blocks=8192)
    params = [SamplingParams(**o.spec.sampling()) for o in done]
    prompts = [TokensPrompt(prompt_token_ids=list(o.spec.prompt)) for o in done]
    want = [out.outputs[0].text for out in llm.generate(prompts, params)]
    differ = [(o, text) for o, text in zip(done, want, strict=True) if o.text != text]
    wrong = [(o, text) for o, text in differ if not _parted_at_a_tie(llm, o)]
    if wrong and dump is not None:  # NOTE: what it takes to replay each one
        dump.write_text(json.dumps([{"prompt": list(o.spec.prompt), "sampling": o.spec.sampling(),
                                     "stream": o.spec.stream, "got": o.text, "want": text} for o, text in wrong]))
        print(f"mismatches written to {dump}", flush=True)
    for o, text in wrong[:5]:
        spec = o.spec
        print(f"unlike colocated: {len(spec.prompt)}-token prompt, {spec.max_tokens} tokens, seed {spec.seed}, "
              f"stream {spec.stream}, retries {o.retries}, from {o.started:.1f} to {o.ended:.1f}:\n"
              f"  got  {o.text!r}\n  want {text!r}", flush=True)
    return len(wrong), len(differ) - len(wrong)


def _parted_at_a_tie(llm: Any, outcome: Outcome) -> bool:
    """A greedy answer that follows the reference up to a token whose two best candidates the
    reference scores within `_TIE_LOGPROB` of each other, and there took the second: a tie that
    float rounding (another batch, another block layout) may break either way, not a wrong answer."""
    from pdserve import SamplingParams
    from pdserve.engine.llm import TokensPrompt

    sampling = outcome.spec.sampling()
    if sampling.get("temperature", 1.0) != 0:
        return False
    params = SamplingParams(**{**sampling, "logprobs": 2})
    [ref] = llm.generate([TokensPrompt(prompt_token_ids=list(outcome.spec.prompt))], params)
    ids, tokenizer, got = ref.outputs[0].token_ids, llm.get_tokenizer(), outcome.text
    parted = next((i for i in range(len(ids)) if not got.startswith(_text(tokenizer, ids[:i + 1]))), None)
    if parted is None or ref.outputs[0].logprobs is None:
        return False
    (first, first_logprob), (second, second_logprob) = ref.outputs[0].logprobs[parted].top[:2]
    other = second if ids[parted] == first else first  # NOTE: an exact tie may list the one taken second
    return first_logprob - second_logprob <= _TIE_LOGPROB and got.startswith(_text(tokenizer, [*ids[:parted], other]))


def _text(tokenizer: Any, token_ids: list[int]) -> str:
    """The text of these tokens, less a character the last one leaves unfinished."""
    return str(tokenizer.decode(token_ids)).rstrip("\ufffd")


def _settle(cluster: Cluster) -> tuple[dict[str, int], int]:
    """Blocks held per worker and pending queue entries, once the cluster had time to go idle."""
    deadline = time.monotonic() + _IDLE_TIMEOUT_S
    while True:
        held = {}
        for worker in cluster.workers():
            try:
                info = httpx.get(f"{worker['url']}/pd/info", timeout=5).json()
                held[worker["url"]] = int(info["num_kv_blocks"]) - int(info["num_free_kv_blocks"])
            except (httpx.HTTPError, ValueError, KeyError):
                held[worker["url"]] = -1  # did not answer: not a clean end
        pending = redis_pending(cluster.redis.url)
        if (not any(held.values()) and pending == 0) or time.monotonic() > deadline:
            return held, pending
        time.sleep(0.5)


def _rss_growth(cluster: Cluster) -> dict[int, float]:
    """Per process alive at the baseline and now: RSS now / RSS then - 1."""
    growth = {}
    for pid, before in cluster.rss_before.items():
        if (now := rss_bytes(pid)) is not None:
            growth[pid] = now / before - 1
            print(f"RSS of {_describe(pid)}: {before / 2**20:.0f} -> {now / 2**20:.0f} MiB", flush=True)
    return growth


def _describe(pid: int) -> str:
    argv = _argv(pid)
    if not argv:
        return str(pid)
    if any(a in ("pdserve.disagg.worker.core", "pdserve.engine.core_proc") for a in argv):
        return f"pid {pid} (engine process)"
    role = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--role"), None)
    command = next((a for a in argv if a in ("up", "router", "serve", "balancer")), "?")
    return f"pid {pid} ({command}{' ' + role if role else ''})"
