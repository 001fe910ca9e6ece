"""`pdserve up` end to end, through the CLI: one command starts router + workers and serves; a
worker or the router SIGKILLed is restarted on its port while every other process goes on and
no request fails; Ctrl-C stops everything and orphans nothing."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import generate_texts, greedy, random_prompt
from metrics_helpers import scrape
from process_cluster import engine_process_of, pending_entries, pid_gone, start_redis
from prometheus_client.parser import text_string_to_metric_families
from server_fixtures import free_port

from pdserve import LLM

pytestmark = pytest.mark.slow  # the whole cluster as processes, through the CLI

# NOTE: 2 cores for everything: small pools, small prefill steps (so a prefill lasts several steps)
FLAGS = ["--kv-transport", "tcp", "--num-kv-blocks", "512", "--dtype", "float32", "--max-num-batched-tokens", "32"]
_START_TIMEOUT_S = 180.0
_BACK_WITHIN_S = 60.0


@dataclass
class Up:
    """A running `pdserve up` (its output in `log`) and the ways a test looks into it."""

    popen: subprocess.Popen[bytes]
    log: Path
    port: int
    supervisor_port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def workers(self) -> list[dict[str, Any]]:
        return list(httpx.get(f"{self.url}/workers", timeout=5).json())

    def ready(self, role: str) -> list[str]:
        try:
            return [w["url"] for w in self.workers() if w["role"] == role and w["ready"]]
        except (httpx.HTTPError, ValueError):
            return []

    def metric(self, name: str, **labels: str) -> float:
        text = httpx.get(f"http://127.0.0.1:{self.supervisor_port}/metrics", timeout=5).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return float(sample.value)
        raise AssertionError(f"no {name}{labels} in:\n{text}")

    def restarts(self) -> dict[str, float]:
        return {role: self.metric("pdserve:supervisor_restarts_total", role=role)
                for role in ("router", "prefill", "decode")}

    def exits(self, context: int = 30) -> str:
        """The log before each worker exit the supervisor saw (what an unexpected restart's assertion shows)."""
        lines = self.text().splitlines()
        return "\n---\n".join("\n".join(lines[max(0, i - context):i + 1])
                               for i, line in enumerate(lines) if " exited with " in line)

    def pids(self, url: str) -> list[int]:
        """The processes (children of `up`) started to listen at `url`: one, or none between a death and a restart."""
        port = url.rsplit(":", 1)[1]
        found = subprocess.run(["pgrep", "-P", str(self.popen.pid), "-f", "--", f"--port {port}( |$)"],
                               capture_output=True, text=True).stdout.split()
        return [int(pid) for pid in found]

    def pid(self, url: str) -> int:
        """The process (a child of `up`) that listens at `url`."""
        found = self.pids(url)
        assert len(found) == 1, (url, found)
        return found[0]

    def wait_for(self, what: str, check: Any, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while not (result := check()):
            assert self.popen.poll() is None, f"pdserve up exited while waiting for {what}:\n{self.text()[-4000:]}"
            assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f} s:\n{self.story()}"
            time.sleep(0.2)
        return result

    def tracebacks(self, context: int = 40) -> str:
        """Every logged traceback (an unhandled error in any process `up` started), with the lines
        that lead to it: what a failed request's assertion shows."""
        lines = self.text().splitlines()
        return "\n---\n".join("\n".join(lines[max(0, i - 2):i + context])
                               for i, line in enumerate(lines) if line.startswith("Traceback"))

    def story(self) -> str:
        """What the supervisor and the autoscaler did (its log lines), then the log's tail."""
        lines = [line for line in self.text().splitlines() if "pdserve.ops" in line]
        return "\n".join(lines[-60:]) + "\n...\n" + self.text()[-2000:]

    def wait_pool(self, prefill: int, decode: int, timeout_s: float = _START_TIMEOUT_S) -> None:
        self.wait_for(f"{prefill} prefill + {decode} decode workers ready",
                      lambda: (len(self.ready("prefill")), len(self.ready("decode"))) == (prefill, decode), timeout_s)

    def stop(self) -> None:
        """Ctrl-C, then an impatient second one: exits 0, and no process it started is left (a test
        that stopped it already: that it exited 0)."""
        if self.popen.poll() is not None:
            assert self.popen.returncode == 0, self.text()[-3000:]
            return
        children = subprocess.run(["pgrep", "-P", str(self.popen.pid)], capture_output=True, text=True).stdout.split()
        os.killpg(self.popen.pid, signal.SIGINT)
        time.sleep(0.05)
        os.killpg(self.popen.pid, signal.SIGINT)  # an impatient second Ctrl-C must not orphan a worker
        assert self.popen.wait(timeout=30) == 0, self.text()[-3000:]
        alive = [pid for pid in children if Path(f"/proc/{pid}").exists()]
        assert not alive, (alive, self.text()[-3000:])


@contextmanager
def pdserve_up(model_dir: Path, tmp_path: Path, *flags: str) -> Iterator[Up]:
    """`pdserve up` until "pdserve is up"; stopped (and checked to stop cleanly) at the end."""
    port = free_port()
    # NOTE: a file, not a pipe: workers log to the same output, and a pipe nobody drains blocks them.
    log = tmp_path / "up.log"
    cmd = [sys.executable, "-m", "pdserve.cli", "up", "--model", str(model_dir), "--port", str(port),
           "--supervisor-port", str(free_port()), *FLAGS, *flags]
    with log.open("w") as out:
        popen = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    up = Up(popen, log, port, int(cmd[cmd.index("--supervisor-port") + 1]))
    try:
        up.wait_for("'pdserve is up'", lambda: "pdserve is up" in up.text(), _START_TIMEOUT_S)
        yield up
        up.stop()
    finally:
        if popen.poll() is None:
            os.killpg(popen.pid, signal.SIGKILL)
            popen.wait()


def complete(url: str, prompt: list[int], max_tokens: int) -> str:
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return str(reply.json()["choices"][0]["text"])


def stream(url: str, prompt: list[int], max_tokens: int, on_chunk: Any = None) -> str:
    """A streamed greedy completion's text; `on_chunk(n)` after each text chunk."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True}
    text, chunks = "", 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            data = line.removeprefix("data: ")
            if not line.startswith("data: ") or data == "[DONE]":
                continue
            event = httpx.Response(200, content=data).json()
            assert "error" not in event, event
            text += event["choices"][0]["text"]
            chunks += 1
            if on_chunk is not None:
                on_chunk(chunks)
    return text


def busy_prefill_worker(up: Up, timeout_s: float = 30.0) -> str:
    """The URL of a prefill worker computing a job (polled until one is): its engine runs a prompt,
    so the job is far from its hand-off's end (a job in hand, /pd/stats' `in_flight`, may be in its
    last milliseconds, and a kill then finds nothing left to re-deliver)."""
    urls = up.ready("prefill")

    def find() -> str | None:
        for url in urls:
            try:
                if httpx.get(f"{url}/pd/info", timeout=2).json()["num_running"]:
                    return url
            except httpx.HTTPError:
                pass
        return None

    return str(up.wait_for("a busy prefill worker", find, timeout_s))


def test_up_serves_then_stops_everything_on_ctrl_c(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    with pdserve_up(model_dirs["tiny"], tmp_path) as up:
        workers = up.workers()
        assert sorted(w["role"] for w in workers) == ["decode", "prefill"] and all(w["ready"] for w in workers)
        reply = httpx.post(f"{up.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
        # NOTE: the supervisor learns a worker is ready on its own poll, which may come after the router's
        up.wait_for("the supervisor counts the prefill worker ready",
                    lambda: up.metric("pdserve:supervisor_workers", role="prefill", state="ready") == 1, 15)
        assert f"supervisor: curl -s http://127.0.0.1:{up.supervisor_port}/metrics" in up.text()


# What a healthy start prints (issue 32): each worker's start-up line and join, the banner.
_QUIET_START = [re.compile(p) for p in (
    r"^\S+ \S+ INFO pdserve \[-\]: (prefill|decode) worker serving \S+ on http://",
    r"^\S+ \S+ INFO pdserve\.model\.loader \[-\]: weights of \S+: [\d.]+ M parameters, ",
    r"^\S+ \S+ INFO pdserve\.disagg\.worker\.registrar \[-\]: registered with router http://\S+ "
    r"as (prefill|decode) worker",
    r"^\S+ \S+ INFO pdserve\.disagg\.router\.pool \[-\]: (prefill|decode) worker http://\S+ is in the pool$",
    r"^$", r"^pdserve is up: ", r"^  (workers|supervisor|try): +curl ", r"^Ctrl-C stops everything\.$")]
_ACCESS_LINE = re.compile(r'"(GET|POST|PUT|DELETE) /\S* HTTP/[\d.]+" \d{3}')


def test_up_on_a_quiet_machine_prints_the_banner_and_the_joins_only(model_dirs: dict[str, Path],
                                                                    tmp_path: Path) -> None:
    """Its first minute (start-up, then idle until 60 s after launch: supervisor polls, heartbeats,
    registrations): no access line of the deployment's own traffic, no warning, nothing but the
    start-up and join lines and the banner. A client's request is still logged; `--access-log`
    brings every line back."""
    started = time.monotonic()
    with pdserve_up(model_dirs["tiny"], tmp_path) as up:
        time.sleep(max(10.0, 60.0 - (time.monotonic() - started)))
        lines = up.text().splitlines()
        unexpected = [line for line in lines if not any(p.search(line) for p in _QUIET_START)]
        assert not unexpected, "\n".join(unexpected[:40])
        assert sum("is in the pool" in line for line in lines) == 2 and lines.count("Ctrl-C stops everything.") == 1
        reply = httpx.post(f"{up.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=60)
        assert reply.status_code == 200
        up.wait_for("the client's access line", lambda: '"POST /v1/completions HTTP/1.1" 200' in up.text(), 10)
        assert len([line for line in up.text().splitlines() if _ACCESS_LINE.search(line)]) == 1, up.text()[-3000:]
    (tmp_path / "all").mkdir()
    with pdserve_up(model_dirs["tiny"], tmp_path / "all", "--access-log") as up:
        up.wait_for("the supervisor's polls logged", lambda: up.text().count('"GET /workers HTTP/1.1" 200') >= 2, 15)
        assert '"POST /pd/register HTTP/1.1" 200' in up.text() and "?pdserve-up-probe=1" in up.text()


def test_a_prefill_worker_killed_mid_load_is_restarted_and_no_request_fails(
        model_dirs: dict[str, Path], colocated: LLM, tmp_path: Path) -> None:
    redis = start_redis(tmp_path)
    try:
        # NOTE: long prompts in small chunks: a job computes for ~40 steps, so the kill lands well inside one
        with pdserve_up(model_dirs["tiny"], tmp_path, "--queue", redis.url, "--prefill", "2", "--decode", "1",
                        "--queue-claim-idle-s", "2", "--max-num-batched-tokens", "16") as up:
            up.wait_pool(prefill=2, decode=1)
            prompts = [random_prompt(600, seed=seed) for seed in range(12)]
            with ThreadPoolExecutor(len(prompts)) as pool:
                replies = [pool.submit(complete, up.url, prompt, 6) for prompt in prompts]
                victim = busy_prefill_worker(up)
                old_pid = up.pid(victim)
                os.kill(old_pid, signal.SIGKILL)
                killed_at = time.monotonic()
                texts = [reply.result() for reply in replies]
            assert texts == generate_texts(colocated, prompts, greedy(6))
            # it died holding a job, which was done again: re-delivered by Redis to the other consumer, or
            # (the transfer stalled first) a new attempt, or prefilled on the decode worker
            assert re.search(r"re-delivering prefill job|expecting KV from attempt .*@[1-9]|prefilling it on this "
                             r"decode worker", up.text())
            # back = a new process listens at its URL and the router lists it ready; the router may still list
            # the dead one as ready until its next poll, so readiness alone does not say it came back
            up.wait_for(f"{victim} back", lambda: up.pids(victim) not in ([], [old_pid])
                        and victim in up.ready("prefill"), _BACK_WITHIN_S)
            assert time.monotonic() - killed_at < _BACK_WITHIN_S
            assert pending_entries(redis) == 0
            assert up.restarts() == {"router": 0, "prefill": 1, "decode": 0}
            assert re.search(r"prefill-\d \(prefill, .*\) exited with status -9; restarting in 1 s", up.text())
    finally:
        redis.stop()


def test_a_decode_worker_killed_mid_stream_is_restarted_and_the_streams_resume(
        model_dirs: dict[str, Path], colocated: LLM, tmp_path: Path) -> None:
    with pdserve_up(model_dirs["tiny"], tmp_path, "--prefill", "1", "--decode", "1") as up:
        up.wait_pool(prefill=1, decode=1)
        (victim,) = up.ready("decode")
        pid = up.pid(victim)
        prompts = [random_prompt(40, seed=seed) for seed in range(4)]

        # NOTE: every stream is under way (a first chunk) before the kill: a request admitted while
        # no decode worker is up is a 503, not what this test is about (CI once got one)
        started = [threading.Event() for _ in prompts[1:]]

        def kill_at_5(chunks: int) -> None:
            if chunks == 5:
                assert all(event.wait(60) for event in started), "the other streams never started"
                os.kill(pid, signal.SIGKILL)

        with ThreadPoolExecutor(len(prompts)) as pool:
            others = [pool.submit(stream, up.url, prompt, 120, lambda n, e=event: n == 1 and e.set())
                      for prompt, event in zip(prompts[1:], started, strict=True)]
            first = stream(up.url, prompts[0], 120, kill_at_5)
            texts = [first, *(other.result() for other in others)]
        # no decode worker was left: the streams waited for the restarted one and went on there
        assert texts == generate_texts(colocated, prompts, greedy(120))
        assert up.ready("decode") == [victim] and up.pid(victim) != pid
        assert up.restarts() == {"router": 0, "prefill": 0, "decode": 1}


def test_a_killed_router_is_restarted_and_new_requests_succeed(model_dirs: dict[str, Path], colocated: LLM,
                                                               tmp_path: Path) -> None:
    with pdserve_up(model_dirs["tiny"], tmp_path, "--prefill", "1", "--decode", "1") as up:
        up.wait_pool(prefill=1, decode=1)
        workers = {role: up.ready(role) for role in ("prefill", "decode")}
        os.kill(up.pid(up.url), signal.SIGKILL)
        prompt = random_prompt(30, seed=3)
        (expected,) = generate_texts(colocated, [prompt], greedy(8))

        def served() -> bool:
            try:
                return complete(up.url, prompt, 8) == expected
            except (httpx.HTTPError, AssertionError):
                return False

        up.wait_for("a request through the restarted router", served, _BACK_WITHIN_S)
        # the workers re-registered with it: the same ones, not restarted
        up.wait_pool(prefill=1, decode=1, timeout_s=10)
        assert {role: up.ready(role) for role in ("prefill", "decode")} == workers
        assert up.restarts() == {"router": 1, "prefill": 0, "decode": 0}


class Load:
    """Closed-loop clients on their own threads until stopped; every reply must be a 200."""

    def __init__(self, url: str, clients: list[tuple[int, int]]) -> None:  # (prompt tokens, max tokens) each
        self.url = url
        self.done = threading.Event()
        self.failures: list[str] = []
        self.num_ok = 0
        self.threads = [threading.Thread(target=self._client, args=(i, *c), daemon=True) for i, c in enumerate(clients)]
        for thread in self.threads:
            thread.start()

    def _client(self, index: int, prompt_len: int, max_tokens: int) -> None:
        seed = 1000 * index
        with httpx.Client(timeout=120) as http:
            while not self.done.is_set():
                seed += 1
                body = {"prompt": random_prompt(prompt_len, seed=seed), "max_tokens": max_tokens, "ignore_eos": True}
                try:
                    reply = http.post(f"{self.url}/v1/completions", json=body)
                    ok = reply.status_code == 200
                    why = f"{reply.status_code} {reply.text[:300]}"
                except httpx.HTTPError as exc:
                    ok, why = False, repr(exc)
                if ok:
                    self.num_ok += 1
                else:
                    self.failures.append(why)

    def stop(self) -> None:
        self.done.set()
        for thread in self.threads:
            thread.join(120)


def test_autoscale_grows_on_a_burst_and_drains_back_without_failing_a_request(model_dirs: dict[str, Path],
                                                                               tmp_path: Path) -> None:
    # NOTE: windows and cooldowns of seconds; decode scales on running requests alone (TPOT targets
    # out of reach), prefill on queue depth alone; short prompts are prefilled on decode (pd threshold)
    rules = ["--autoscale-window-s", "3", "--scale-in-cooldown-s", "8", "--prefill-queue-target", "2",
             "--prefill-queue-low", "1", "--prefill-queue-latency-target-s", "100", "--decode-running-high", "3",
             "--decode-running-target", "2", "--decode-running-low", "1", "--decode-tpot-target-ms", "100000",
             "--decode-tpot-avg-target-ms", "100000", "--pd-threshold", "64"]
    with pdserve_up(model_dirs["tiny"], tmp_path, "--autoscale", "--prefill", "1:3", "--decode", "1:3",
                    *rules) as up:
        def live(role: str) -> float:
            return sum(up.metric("pdserve:supervisor_workers", role=role, state=state)
                       for state in ("starting", "ready", "draining"))

        burst = Load(up.url, [(600, 2)] * 6 + [(16, 256)] * 10)
        try:
            # the new workers join the pool and take traffic while the burst lasts
            # NOTE: decisions come within seconds; the bound is for loading new workers on 2 busy cores
            up.wait_for("prefill and decode grown",
                        lambda: len(up.ready("prefill")) >= 2 and len(up.ready("decode")) == 3, 180)
        finally:
            burst.stop()
        trickle = Load(up.url, [(40, 4)])  # requests go on through every scale-in
        try:
            up.wait_for("both roles back to 1", lambda: (live("prefill"), live("decode")) == (1, 1), 120)
            up.wait_pool(prefill=1, decode=1, timeout_s=10)
        finally:
            trickle.stop()
        assert not burst.failures and not trickle.failures, \
            f"{(burst.failures + trickle.failures)[:5]}\n{up.tracebacks()}\n{up.story()}"
        assert trickle.num_ok > 0
        text = up.text()
        assert re.search(r"autoscale: prefill 1 -> 2: queue depth [\d.]+ > 2 for 3 s", text)
        assert re.search(r"autoscale: decode 1 -> 3: running/instance [\d.]+ > 3 for 3 s", text)
        assert re.search(r"autoscale: decode 2 -> 1: running/instance [\d.]+ < 1 for 3 s", text)
        assert re.search(r"autoscale: prefill 2 -> 1: queue depth <= 1 for 3 s", text)
        assert up.metric("pdserve:autoscaler_decisions_total", role="decode", direction="out",
                         reason="running_per_worker") == 1
        assert up.metric("pdserve:autoscaler_decisions_total", role="decode", direction="in", reason="idle") == 2
        assert up.restarts() == {"router": 0, "prefill": 0, "decode": 0}, up.exits()
        # every worker drained after it served exited 0 (one still loading may have been drained too)
        drained = re.findall(r"drained and exited with status (-?\d+)", text)
        assert len(drained) >= 2 and set(drained) == {"0"}, drained


def test_a_worker_whose_engine_process_is_killed_exits_and_is_restarted_and_no_request_fails(
        model_dirs: dict[str, Path], colocated: LLM, tmp_path: Path) -> None:
    """A prefill or decode worker's engine and KV side run in an engine process of its own: killed
    under load, its API process fails what it had, exits non-zero and is restarted; the router
    resumes the decode worker's streams and retries the prefill worker's jobs, so every client gets
    the colocated text."""
    with pdserve_up(model_dirs["tiny"], tmp_path, "--prefill", "1", "--decode", "1",
                    "--max-num-batched-tokens", "16") as up:
        up.wait_pool(prefill=1, decode=1)
        _kill_engine_process_under_load(up, colocated, "decode")
        assert up.restarts() == {"router": 0, "prefill": 0, "decode": 1}
        _kill_engine_process_under_load(up, colocated, "prefill")
        assert up.restarts() == {"router": 0, "prefill": 1, "decode": 1}


def _kill_engine_process_under_load(up: Up, colocated: LLM, role: str) -> None:
    (victim,) = up.ready(role)
    api_pid = up.pid(victim)
    engine_pid = engine_process_of(api_pid)
    prompts = [random_prompt(200 if role == "prefill" else 40, seed=seed) for seed in range(4)]
    started = [threading.Event() for _ in prompts]
    killed: list[int] = []

    def kill_once_all_started(chunks: int, event: threading.Event) -> None:
        if chunks == 1:
            event.set()
            if all(e.is_set() for e in started) and not killed:
                killed.append(engine_pid)
                os.kill(engine_pid, signal.SIGKILL)

    long_prompts = [random_prompt(600, seed=10 + k) for k in range(3)] if role == "prefill" else []
    with ThreadPoolExecutor(len(prompts) + len(long_prompts)) as pool:
        # NOTE: the long prompts compute on prefill in 16-token chunks when the kill comes
        more = [pool.submit(complete, up.url, prompt, 4) for prompt in long_prompts]
        replies = [pool.submit(stream, up.url, prompt, 60, lambda n, e=event: kill_once_all_started(n, e))
                   for prompt, event in zip(prompts, started, strict=True)]
        texts = [reply.result() for reply in replies]
        assert [m.result() for m in more] == generate_texts(colocated, long_prompts, greedy(4))
    assert killed == [engine_pid]
    assert texts == generate_texts(colocated, prompts, greedy(60))
    up.wait_for(f"{victim} back", lambda: up.pids(victim) not in ([], [api_pid]) and victim in up.ready(role),
                _BACK_WITHIN_S)
    assert re.search(rf"{role}-\d \({role}, .*\) exited with status 3; restarting", up.text()), up.exits()
    assert pid_gone(engine_pid, 5) and engine_process_of(up.pid(victim)) != engine_pid


def test_a_colocated_replica_whose_engine_process_is_killed_exits_and_is_restarted(
        model_dirs: dict[str, Path], colocated: LLM, tmp_path: Path) -> None:
    """The engine core runs in a process of its own under each replica's API process: killed, its
    server fails what it had (503), exits non-zero, and the supervisor restarts the replica."""
    with pdserve_up(model_dirs["tiny"], tmp_path, "--colocated", "1") as up:
        (replica,) = up.wait_for("a ready replica", lambda: up.ready("replica"), _START_TIMEOUT_S)
        api_pid = up.pid(replica)
        engine_pid = engine_process_of(api_pid)
        prompt = random_prompt(30, seed=4)
        (expected,) = generate_texts(colocated, [prompt], greedy(8))
        os.kill(engine_pid, signal.SIGKILL)
        up.wait_for(f"{replica} back", lambda: up.pids(replica) not in ([], [api_pid])
                    and replica in up.ready("replica"), _BACK_WITHIN_S)
        assert re.search(r"replica-\d \(replica, .*\) exited with status 3; restarting", up.text()), up.exits()
        assert pid_gone(engine_pid, 5) and engine_process_of(up.pid(replica)) != engine_pid
        assert complete(up.url, prompt, 8) == expected


def test_colocated_replicas_pinned_to_their_own_cores_behind_a_balancer(
        model_dirs: dict[str, Path], colocated: LLM, tmp_path: Path) -> None:
    """The seed's baseline (up --colocated N --cpus-per-worker K): N colocated servers, each pinned to
    K cores of its own, one endpoint; both take requests; one SIGKILLed is restarted and no request fails."""
    with pdserve_up(model_dirs["tiny"], tmp_path, "--colocated", "2", "--cpus-per-worker", "1") as up:
        replicas = up.wait_for("2 ready replicas", lambda: len(up.ready("replica")) == 2 and up.ready("replica"),
                               _START_TIMEOUT_S)
        cores = sorted(os.sched_getaffinity(0))
        pinned = [Path(f"/proc/{up.pid(url)}/status").read_text().split("Cpus_allowed_list:")[1].split()[0]
                  for url in replicas]
        assert sorted(pinned) == sorted({str(cores[0]), str(cores[1 % len(cores)])})
        prompts = [random_prompt(60, seed=seed) for seed in range(8)]
        with ThreadPoolExecutor(len(prompts)) as pool:
            texts = list(pool.map(lambda p: complete(up.url, p, 8), prompts))
        assert texts == generate_texts(colocated, prompts, greedy(8))
        assert stream(up.url, prompts[0], 8) == texts[0]
        served = [scrape(url).value("vllm:e2e_request_latency_seconds_count") for url in replicas]
        assert sum(served) == len(prompts) + 2 and min(served) >= 3, served  # + the readiness check and a stream
        victim = replicas[0]
        old_pid = up.pid(victim)
        os.kill(old_pid, signal.SIGKILL)
        # the balancer takes it out of rotation: requests meanwhile go to the other replica
        assert [complete(up.url, p, 8) for p in prompts[:4]] == texts[:4]
        up.wait_for(f"{victim} back", lambda: up.pids(victim) not in ([], [old_pid])
                    and victim in up.ready("replica"), _BACK_WITHIN_S)
        assert up.metric("pdserve:supervisor_restarts_total", role="replica") == 1
        reply = httpx.post(f"{up.url}/v1/completions", json={"prompt": "x", "max_tokens": -1}, timeout=30)
        assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"


def test_up_listens_where_host_says_and_stops_quietly(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """`up --host 0.0.0.0` (a container): the router answers on every interface (here 127.0.0.2,
    which a server on 127.0.0.1 alone does not answer), the workers register the loopback address
    up reaches them at; one Ctrl-C stops everything with exit 0 and not one traceback, warning,
    error or triton leak line on the way out (a CPU run never loads triton)."""
    with pdserve_up(model_dirs["tiny"], tmp_path, "--host", "0.0.0.0") as up:
        reply = httpx.post(f"http://127.0.0.2:{up.port}/v1/completions", json={"prompt": "Hi", "max_tokens": 3},
                           timeout=60)
        assert reply.status_code == 200, reply.text
        assert all(w["url"].startswith("http://127.0.0.1:") for w in up.workers()), up.workers()
        assert "behind http://127.0.0.1:" in up.text()
        before = len(up.text().splitlines())
        os.killpg(up.popen.pid, signal.SIGINT)
        assert up.popen.wait(timeout=60) == 0, up.text()[-3000:]
        shutdown = up.text().splitlines()[before:]
        # NOTE: "Error" outside a log line is a traceback's last line (BrokenPipeError); an INFO line may name the
        # exception a deliberate stop caused (decode's registrar meeting the router stopped first: ConnectError)
        loud = ("Traceback", "WARNING", "ERROR", "nanobind")
        noisy = [line for line in shutdown
                 if any(word in line for word in loud) or ("Error" in line and " INFO " not in line)]
        assert not noisy, "\n".join(shutdown)
