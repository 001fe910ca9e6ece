"""Slow: real decode worker processes publish KV-cache events over ZMQ (`--kv-events-config`, any free
port, advertised in /pd/info) and the router's `kv-events` decode policy sends every request sharing
a prompt prefix to the worker holding it, whose prefix cache then serves it; answers equal the
offline engine's."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import random_prompt
from process_cluster import MODEL, spawn_worker, start_router, wait_healthy

from pdserve import LLM
from pdserve.disagg.router.kv_index import prompt_block_hashes
from pdserve.disagg.router.policy import KVEventsPolicy
from pdserve.engine.llm import TokensPrompt
from pdserve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
EVENTS = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"}'
_HITS = re.compile(r"^vllm:prefix_cache_(hits|queries)_total(?:\{[^}]*\})? ([0-9.e+]+)$", re.M)


def prefix_counters(url: str) -> dict[str, float]:
    return {name: float(value) for name, value in _HITS.findall(httpx.get(f"{url}/metrics", timeout=5).text)}


def complete(router_url: str, prompt: list[int]) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    reply = httpx.post(f"{router_url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return str(reply.json()["choices"][0]["text"])


def test_router_follows_the_workers_events(model_dirs: dict[str, Path], colocated: LLM, tmp_path: Path) -> None:
    model_dir = model_dirs["tiny"]
    flags = ["--kv-events-config", EVENTS, "--num-kv-blocks", "256"]
    prefill = spawn_worker("prefill", model_dir, tmp_path, flags)
    decode = [spawn_worker("decode", model_dir, tmp_path, flags) for _ in range(2)]
    workers = [prefill, *decode]
    router = None
    try:
        wait_healthy(workers)
        info: dict[str, Any] = httpx.get(f"{decode[0].url}/pd/info", timeout=5).json()
        assert info["kv_events_endpoint"].startswith("tcp://0.0.0.0:") and info["kv_events_replay_endpoint"]
        router = start_router(model_dir, [prefill], decode, decode_policy="kv-events", pd_threshold=64)
        policy = router.client.policy
        assert isinstance(policy, KVEventsPolicy)
        shared = random_prompt(160, seed=11)  # 10 blocks of 16
        prompts = [shared + random_prompt(8, seed=20 + n) for n in range(4)]
        hashes = prompt_block_hashes(prompts[0], 16)[:10]
        expected = [out.outputs[0].text for out in colocated.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts],
            SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))]
        assert complete(router.url, prompts[0]) == expected[0]
        deadline = time.monotonic() + 10
        while True:  # the decode worker that received the prompt's KV says so in its events
            holders = [w for w in decode if (index := policy.index(w.url)) is not None
                       and index.num_prefix_blocks(hashes) == len(hashes)]
            if holders or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert len(holders) == 1, [policy.index(w.url) for w in decode]
        holder, other = holders[0], next(w for w in decode if w is not holders[0])
        before = {w.url: prefix_counters(w.url) for w in decode}
        for prompt, text in zip(prompts[1:], expected[1:], strict=True):
            assert complete(router.url, prompt) == text
        time.sleep(0.5)  # NOTE: the engines' stats reach /metrics every few ms
        after = {w.url: prefix_counters(w.url) for w in decode}
        assert after[other.url] == before[other.url], "a request went to the worker without the prefix"
        hits = after[holder.url]["hits"] - before[holder.url]["hits"]
        assert hits >= 3 * 160, f"the prefix was not served from the holder's cache: {hits} hit tokens"
    finally:
        if router is not None:
            router.stop()
        for worker in workers:
            worker.kill()
            worker.popen.wait(10)
