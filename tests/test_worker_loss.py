"""Workers as processes behind the router (in-memory prefill queue): SIGTERM drains a worker (what
it has in flight finishes, it exits 0), SIGKILL of a decode worker mid-stream resumes the request
on another decode worker with no duplicated and no missing token (the prompt's KV re-sent from the
prefill worker's cache when it holds it, counted), and with no decode worker left
the client gets an in-band error, then [DONE]."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers import generate_texts, greedy, random_prompt
from process_cluster import ProcessCluster, WorkerProcess, spawn_worker, start_router, wait_healthy

from pdserve import LLM, SamplingParams
from pdserve.disagg.router.stats import Recoveries
from pdserve.engine.structured import StructuredOutput

pytestmark = pytest.mark.slow  # workers as processes, killed and replaced

# NOTE: a transfer timeout well above a loaded machine's stalls: a retried resume counts as recompute
FLAGS = ["--num-kv-blocks", "512", "--max-num-batched-tokens", "16", "--kv-transfer-timeout-ms", "2000"]
_EXIT_TIMEOUT_S = 30


@pytest.fixture(scope="module")
def cluster(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProcessCluster]:
    logs = tmp_path_factory.mktemp("logs")
    decode = [spawn_worker("decode", model_dirs["tiny"], logs, FLAGS) for _ in range(2)]
    prefill = [spawn_worker("prefill", model_dirs["tiny"], logs, FLAGS) for _ in range(2)]
    cluster = ProcessCluster(prefill, decode, None)  # type: ignore[arg-type]
    try:
        wait_healthy(decode + prefill)
        cluster.router = start_router(model_dirs["tiny"], prefill, decode, accept_registrations=True)
        yield cluster
    finally:
        cluster.stop()


def greedy_text(llm: LLM, prompt: list[int], max_tokens: int) -> str:
    return generate_texts(llm, [prompt], greedy(max_tokens))[0]


def busy(workers: list[WorkerProcess]) -> WorkerProcess:
    """The live worker that has a request in flight (waits for one)."""
    deadline = time.monotonic() + 20
    while True:
        for worker in workers:
            if worker.popen.poll() is None and worker.stats()["in_flight"]:
                return worker
        assert time.monotonic() < deadline, "no worker took the request"
        time.sleep(0.01)


def signal_busy(workers: list[WorkerProcess], sig: int) -> WorkerProcess:
    """Send `sig` to the worker that has a request in flight (waits for one); returns it."""
    victim = busy(workers)
    victim.kill(sig)
    return victim


def stream_events(url: str, prompt: list[int], max_tokens: int, on_tokens: int, action,  # type: ignore[no-untyped-def]
                  extra: dict[str, object] | None = None) -> list[object]:
    """Stream a greedy completion; call `action()` once `on_tokens` text chunks arrived."""
    events: list[object] = []
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}} | (extra or {})
    with httpx.Client(base_url=url, timeout=120) as http, http.stream("POST", "/v1/completions", json=body) as reply:
        assert reply.status_code == 200
        chunks = 0
        for line in reply.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                events.append("[DONE]")
                continue
            event = httpx.Response(200, content=data).json()
            events.append(event)
            if event.get("choices"):
                chunks += 1
                if chunks == on_tokens:
                    action()
    return events


def text_of(events: list[object]) -> str:
    return "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict) and e.get("choices"))


def test_a_hung_worker_leaves_the_pool_within_seconds_and_comes_back(cluster: ProcessCluster) -> None:
    def ready(worker: WorkerProcess) -> bool:
        return next(w.ready for w in cluster.router.client.workers() if w.url == worker.url)

    def wait(worker: WorkerProcess, state: bool) -> float:
        start = time.monotonic()
        while ready(worker) != state:
            assert time.monotonic() - start < 5.0, f"still ready={not state} after 5 s"
            time.sleep(0.05)
        return time.monotonic() - start

    hung = cluster.prefill[0]
    hung.kill(signal.SIGSTOP)
    try:
        wait(hung, False)
        with httpx.Client(base_url=cluster.router.url, timeout=60) as http:  # served by the other one
            assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    finally:
        hung.kill(signal.SIGCONT)
    wait(hung, True)
    cluster.wait_until_idle()


def test_sigterm_drains_a_decode_worker(cluster: ProcessCluster, colocated: LLM, model_dirs: dict[str, Path],
                                        tmp_path: Path) -> None:
    prompt = random_prompt(40, seed=11)
    drained: list[WorkerProcess] = []

    events = stream_events(cluster.router.url, prompt, 120, 5,
                           lambda: drained.append(signal_busy(cluster.decode, signal.SIGTERM)))
    assert text_of(events) == greedy_text(colocated, prompt, 120)  # the request in flight finished
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 120
    assert drained[0].popen.wait(_EXIT_TIMEOUT_S) == 0, drained[0].tail()
    # the pool goes on without it, and a replacement joins
    replacement = spawn_worker("decode", model_dirs["tiny"], tmp_path, FLAGS + ["--register", cluster.router.url])
    cluster.decode.append(replacement)  # stopped with the cluster, whatever happens
    wait_healthy([replacement])
    deadline = time.monotonic() + 10
    while not any(w.url == replacement.url and w.ready for w in cluster.router.client.workers()):
        assert time.monotonic() < deadline, "the replacement did not join by registering"
        time.sleep(0.1)
    with httpx.Client(base_url=cluster.router.url, timeout=60) as http:
        for seed in range(3):
            reply = http.post("/v1/completions", json={"prompt": random_prompt(30, seed=seed), "max_tokens": 4})
            assert reply.status_code == 200, reply.text
    cluster.wait_until_idle()


def test_sigterm_drains_a_prefill_worker(cluster: ProcessCluster, colocated: LLM) -> None:
    prompt = random_prompt(900, seed=12)  # 57 steps of 16 tokens: caught mid-prefill
    with httpx.Client(base_url=cluster.router.url, timeout=120) as http:
        result: dict[str, httpx.Response] = {}
        request = threading.Thread(target=lambda: result.setdefault("reply", http.post(
            "/v1/completions", json={"prompt": prompt, "max_tokens": 6, "ignore_eos": True, "temperature": 0})))
        request.start()
        victim = signal_busy(cluster.prefill, signal.SIGTERM)
        request.join(120)
    assert result["reply"].status_code == 200, result["reply"].text
    assert result["reply"].json()["choices"][0]["text"] == greedy_text(colocated, prompt, 6)
    assert victim.popen.wait(_EXIT_TIMEOUT_S) == 0, victim.tail()
    cluster.wait_until_idle()


def sigkill_mid_stream(cluster: ProcessCluster, colocated: LLM, prompt: list[int]) -> Recoveries:
    """Stream `prompt`, SIGKILL its decode worker after 10 chunks: the request resumes on another
    one with the colocated greedy text. Returns the recoveries the router counted meanwhile."""
    before = cluster.router.client.stats()
    killed: list[WorkerProcess] = []
    events = stream_events(cluster.router.url, prompt, 150, 10,
                           lambda: killed.append(signal_busy(cluster.decode, signal.SIGKILL)))
    assert text_of(events) == greedy_text(colocated, prompt, 150)  # nothing missing, nothing twice
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 150
    after = cluster.router.client.stats()
    assert after.events.resumed == before.events.resumed + 1
    killed[0].popen.wait(10)
    cluster.wait_until_idle()
    return Recoveries(after.recoveries.prefill_cache - before.recoveries.prefill_cache,
                      after.recoveries.recompute - before.recoveries.recompute)


def test_decode_sigkill_mid_stream_resumes_with_the_prompt_kv_from_prefill_cache(
        cluster: ProcessCluster, colocated: LLM) -> None:
    # the prefill worker still caches the prompt's 3 full blocks: it re-sends them, computes the rest
    assert sigkill_mid_stream(cluster, colocated, random_prompt(50, seed=13)) == Recoveries(prefill_cache=1)


def add_decode_worker(cluster: ProcessCluster, model_dir: Path, logs: Path) -> None:
    """A decode worker that joins by registering (the cluster has two ready ones again)."""
    replacement = spawn_worker("decode", model_dir, logs, FLAGS + ["--register", cluster.router.url])
    cluster.decode.append(replacement)
    wait_healthy([replacement])
    deadline = time.monotonic() + 10
    while sum(w.role == "decode" and w.ready for w in cluster.router.client.workers()) < 2:
        assert time.monotonic() < deadline, "the replacement did not join by registering"
        time.sleep(0.1)


def test_decode_sigkill_mid_stream_recomputes_what_prefill_does_not_cache(
        cluster: ProcessCluster, colocated: LLM, model_dirs: dict[str, Path], tmp_path: Path) -> None:
    add_decode_worker(cluster, model_dirs["tiny"], tmp_path)
    # a prompt shorter than a block: prefill never held a full block of what the resume computes
    assert sigkill_mid_stream(cluster, colocated, random_prompt(10, seed=15)) == Recoveries(recompute=1)


# twenty numbers: ~60 tokens of JSON, so the decode worker dies in the middle of it
NUMBERS_SCHEMA = {"type": "object", "properties": {"numbers": {
    "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 20, "maxItems": 20}},
    "required": ["numbers"], "additionalProperties": False}


def test_decode_sigkill_mid_stream_under_a_schema_still_ends_in_valid_json(
        cluster: ProcessCluster, colocated: LLM, model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """The resumed request's new decode worker (and its prefill) replay the tokens sent so far into
    their matchers: the output continues the same grammar, the colocated greedy text, valid JSON."""
    add_decode_worker(cluster, model_dirs["tiny"], tmp_path)
    prompt = random_prompt(30, seed=17)
    schema = json.dumps(NUMBERS_SCHEMA)
    want = colocated.generate([{"prompt_token_ids": prompt}], SamplingParams(
        temperature=0, max_tokens=200, structured=StructuredOutput("json", schema)))[0].outputs[0]
    assert want.finish_reason == "stop" and len(want.token_ids) > 30
    before = cluster.router.client.stats()
    killed: list[WorkerProcess] = []
    events = stream_events(cluster.router.url, prompt, 200, 10,
                           lambda: killed.append(signal_busy(cluster.decode, signal.SIGKILL)),
                           {"ignore_eos": False, "response_format": {
                               "type": "json_schema", "json_schema": {"name": "numbers", "schema": NUMBERS_SCHEMA}}})
    assert cluster.router.client.stats().events.resumed == before.events.resumed + 1
    assert text_of(events) == want.text
    assert len(json.loads(text_of(events))["numbers"]) == 20
    assert events[-2]["usage"]["completion_tokens"] == len(want.token_ids)  # type: ignore[index]
    killed[0].popen.wait(10)
    cluster.wait_until_idle()


def test_no_decode_worker_left_is_an_in_band_error_then_done(cluster: ProcessCluster) -> None:
    def kill_all() -> None:
        for worker in cluster.decode:
            worker.kill(signal.SIGKILL)

    events = stream_events(cluster.router.url, random_prompt(20, seed=14), 150, 3, kill_all)
    assert events[-1] == "[DONE]"
    error = events[-2]
    assert isinstance(error, dict) and "error" in error, events[-3:]
    assert error["error"]["code"] in (502, 503)
