"""A decode worker SIGKILLed and restarted on the same --port and --kv-port is served again through
the same prefill worker (its KV sender reconnects), with the colocated text."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import pytest
from helpers import generate_texts, greedy, random_prompt
from process_cluster import ProcessCluster, spawn_worker, start_router, wait_healthy
from server_fixtures import free_port

from pdserve import LLM

pytestmark = pytest.mark.slow  # workers as processes, killed and replaced

FLAGS = ["--num-kv-blocks", "256", "--max-num-batched-tokens", "16"]


def complete(url: str, prompt: list[int], max_tokens: int) -> str:
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def test_a_restarted_decode_worker_is_reachable_through_the_same_prefill_worker(
        model_dirs: dict[str, Path], tmp_path: Path, colocated: LLM) -> None:
    port, kv_port = free_port(), free_port()
    decode_flags = [*FLAGS, "--kv-port", str(kv_port)]
    decode = spawn_worker("decode", model_dirs["tiny"], tmp_path, decode_flags, port=port)
    prefill = spawn_worker("prefill", model_dirs["tiny"], tmp_path, FLAGS)
    cluster = ProcessCluster([prefill], [decode], None)  # type: ignore[arg-type]
    try:
        wait_healthy([decode, prefill])
        cluster.router = start_router(model_dirs["tiny"], [prefill], [decode])
        prompts = [random_prompt(30, seed=seed) for seed in (21, 22)]
        expected = generate_texts(colocated, prompts, greedy(12))
        assert complete(cluster.router.url, prompts[0], 12) == expected[0]

        decode.kill(signal.SIGKILL)
        decode.popen.wait(10)
        decode = spawn_worker("decode", model_dirs["tiny"], tmp_path, decode_flags, port=port)
        cluster.decode = [decode]
        wait_healthy([decode])
        deadline = time.monotonic() + 30
        while not cluster.router.client.alive:  # the router sees it back
            assert time.monotonic() < deadline
            time.sleep(0.1)
        for _ in range(2):  # and keeps serving
            assert complete(cluster.router.url, prompts[1], 12) == expected[1]
        cluster.wait_until_idle()
    finally:
        cluster.stop()
