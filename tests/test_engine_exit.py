"""A real server whose engine broke (PDSERVE_TEST_FAIL_MODEL_STEP, a test-only fault: no request can
break a model step on purpose) answers its requests with an error at once, stops taking work
(a prefill worker's queue consumer stops pulling and leaves Redis), and exits non-zero, so its
supervisor or Kubernetes restarts it."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import httpx
import pytest
from helpers import random_prompt
from process_cluster import ProcessCluster, spawn_worker, start_redis, start_router, wait_healthy

from pdserve.envs import TEST_FAIL_MODEL_STEP

pytestmark = pytest.mark.slow  # workers as processes

FLAGS = ["--num-kv-blocks", "256", "--max-num-batched-tokens", "16"]
ENGINE_FAILED = 3  # cli._ENGINE_FAILED
EXIT_TIMEOUT_S = 30


def completion(url: str, timeout_s: float = 60) -> httpx.Response:
    body = {"prompt": random_prompt(20, seed=51), "max_tokens": 8, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout_s)


def ask(url: str) -> None:
    with contextlib.suppress(httpx.HTTPError):
        completion(url, timeout_s=10)


def test_a_colocated_server_whose_engine_broke_answers_503_and_exits_non_zero(
        model_dirs: dict[str, Path], tmp_path: Path) -> None:
    server = spawn_worker("colocated", model_dirs["tiny"], tmp_path, FLAGS, env={TEST_FAIL_MODEL_STEP: "2"})
    try:
        wait_healthy([server])
        reply = completion(server.url)
        assert reply.status_code == 503, reply.text
        assert "injected model step failure" in reply.json()["error"]["message"]
        assert server.popen.wait(EXIT_TIMEOUT_S) == ENGINE_FAILED, server.tail()
    finally:
        server.kill()


def test_a_prefill_worker_whose_engine_broke_leaves_the_queue_and_exits_non_zero(
        model_dirs: dict[str, Path], tmp_path: Path) -> None:
    redis_server = start_redis(tmp_path)
    queue = ["--queue", redis_server.url]
    decode = spawn_worker("decode", model_dirs["tiny"], tmp_path, FLAGS)
    prefill = spawn_worker("prefill", model_dirs["tiny"], tmp_path, FLAGS + queue, env={TEST_FAIL_MODEL_STEP: "1"})
    cluster = ProcessCluster([prefill], [decode], None)  # type: ignore[arg-type]
    try:
        wait_healthy([decode, prefill])
        redis = redis_server.client()
        assert redis.keys("pdserve:default:consumer:*")  # it heartbeats
        cluster.router = start_router(model_dirs["tiny"], [], [decode], queue_url=redis_server.url)
        # NOTE: the client's answer is not checked here: with no prefill worker left the router waits
        # for one (the first-token deadline is another item); what matters is what the worker does.
        threading.Thread(target=ask, args=(cluster.router.url,), daemon=True).start()
        assert prefill.popen.wait(EXIT_TIMEOUT_S) == ENGINE_FAILED, prefill.tail()
        assert "draining" in prefill.tail()
        deadline = time.monotonic() + 5
        while redis.keys("pdserve:default:consumer:*"):  # it left: no heartbeat, nothing pulled
            assert time.monotonic() < deadline, "the dead worker's consumer still heartbeats"
            time.sleep(0.1)
    finally:
        cluster.stop()
        redis_server.stop()
