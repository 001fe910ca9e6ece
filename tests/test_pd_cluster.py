"""Prefill and decode workers behind the router, over real KV transports on loopback: outputs must
equal colocated ones (greedy and seeded, streamed and not) and no worker may keep a block."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import generate_texts, random_prompt
from pd_fixtures import start_cluster, stop_cluster
from server_fixtures import parse_sse

from pdserve import LLM, SamplingParams
from pdserve.disagg.transport import nixl_available
from pdserve.disagg.worker.decode_service import DecodeService, FailurePolicy
from pdserve.disagg.worker.prefill_service import PrefillService

pytestmark = pytest.mark.slow  # every test starts a cluster

PROMPTS = [random_prompt(n, seed=5000 + n) for n in (3, 40, 130, 260)]
MAX_TOKENS = 10


_NO_NIXL = pytest.mark.skipif(not nixl_available(), reason="nixl_cu12 is not installed")


@pytest.mark.parametrize(("transport", "num_prefill", "num_decode"),
                         [("tcp", 1, 1), ("tcp", 1, 2), ("tcp", 2, 1),
                          *(pytest.param("nixl", p, d, marks=_NO_NIXL) for p, d in ((1, 1), (1, 2), (2, 1)))],
                         ids=["tcp-1P1D", "tcp-1P2D", "tcp-2P1D", "nixl-1P1D", "nixl-1P2D", "nixl-2P1D"])
def test_pd_cluster_matches_colocated(model_dirs: dict[str, Path], colocated: LLM, transport: str,
                                      num_prefill: int, num_decode: int) -> None:
    cluster = start_cluster(model_dirs["tiny"], transport, num_prefill, num_decode)
    try:
        with httpx.Client(base_url=cluster.router.url, timeout=60) as http:
            workers = http.get("/workers").json()
            assert sorted(w["role"] for w in workers) == sorted(["prefill"] * num_prefill + ["decode"] * num_decode)
            assert all(w["ready"] for w in workers)
            for seed, params in ((None, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)),
                                 (77, SamplingParams(temperature=0.9, top_k=40, seed=77, max_tokens=MAX_TOKENS,
                                                     ignore_eos=True))):
                want = generate_texts(colocated, PROMPTS, params)
                body = {"max_tokens": MAX_TOKENS, "ignore_eos": True,
                        "temperature": params.temperature, "top_k": params.top_k, "seed": seed}
                for prompt, text in zip(PROMPTS, want, strict=True):
                    reply = http.post("/v1/completions", json=body | {"prompt": prompt})
                    assert reply.status_code == 200, reply.text
                    assert reply.json()["choices"][0]["text"] == text
                    assert reply.json()["usage"]["completion_tokens"] == MAX_TOKENS
                    streamed = http.post("/v1/completions", json=body | {"prompt": prompt, "stream": True})
                    chunks = [e for e in parse_sse(streamed.text) if isinstance(e, dict)]
                    assert "".join(c["choices"][0]["text"] for c in chunks) == text
            check_prompt_logprobs(http, colocated, PROMPTS[-1])
        cluster.wait_until_idle()
    finally:
        stop_cluster(cluster)


def check_prompt_logprobs(http: httpx.Client, colocated: LLM, prompt: list[int]) -> None:
    """Prefill computes them; its final KV message carries them (over nixl: a NIXL notification,
    ~10 KB for this prompt) through decode to the router: each equal to colocated's."""
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=2)
    want = colocated.generate([{"prompt_token_ids": prompt}], params)[0].prompt_logprobs
    reply = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "ignore_eos": True,
                                               "temperature": 0, "prompt_logprobs": 2})
    assert reply.status_code == 200, reply.text
    got = reply.json()["choices"][0]["prompt_logprobs"]
    assert want is not None and len(got) == len(want) == len(prompt) and got[0] is None
    for entry, expected in zip(got[1:], want[1:], strict=True):
        assert expected is not None
        assert abs(entry[str(expected.token_id)]["logprob"] - expected.logprob) < 1e-5
        # NOTE: a random model's tail holds tokens within 1e-6 of each other, and prefill's chunks
        # round differently from colocated's single pass: a rank deep in the tail may move by one
        assert abs(entry[str(expected.token_id)]["rank"] - expected.rank) <= (0 if expected.rank <= 2 else 2)
        assert {str(t) for t, _ in expected.top} <= set(entry)


def test_client_disconnect_mid_stream_frees_blocks_on_both_workers(model_dirs: dict[str, Path]) -> None:
    cluster = start_cluster(model_dirs["tiny"], "tcp", 1, 1)
    try:
        body = {"prompt": PROMPTS[2], "max_tokens": 500, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=cluster.router.url, timeout=60) as http, \
                http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            received = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: {") for line in received)
        cluster.wait_until_idle(timeout_s=5.0)
    finally:
        stop_cluster(cluster)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_transfer_stall_retries_once_then_applies_the_policy(model_dirs: dict[str, Path], colocated: LLM,
                                                            policy: FailurePolicy) -> None:
    timeout_s = 0.3
    cluster = start_cluster(model_dirs["tiny"], "fake", 1, 1, policy=policy, timeout_s=timeout_s,
                            prefill_options={"stall_after_layers": 1})
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        want = generate_texts(colocated, PROMPTS, params)[1]
        with httpx.Client(base_url=cluster.router.url, timeout=60) as http:
            start = time.monotonic()
            reply = http.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": MAX_TOKENS,
                                                       "ignore_eos": True, "temperature": 0})
            elapsed = time.monotonic() - start
            router_counters = http.get("/router/stats").json()["counters"]
        decode = next(service for service in cluster.services if isinstance(service, DecodeService))
        prefill = next(service for service in cluster.services if isinstance(service, PrefillService))
        decode_stats, prefill_stats = decode.stats(), prefill.stats()
        assert decode_stats.timeouts == 2 and decode_stats.retried == 1
        # the retry is a second prefill attempt (new transfer id), not just a longer wait
        assert router_counters["kv_retries"] == 1
        assert prefill_stats.failed + prefill_stats.aborted == 2, prefill_stats
        assert (decode_stats.recomputed if policy == "recompute" else decode_stats.failed) == 1
        if policy == "recompute":
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["text"] == want
        else:
            assert reply.status_code == 503, reply.text
            assert "KV cache transfer timed out" in reply.json()["error"]["message"]
        # two timeout windows (the first, then the retry), plus compute
        assert 2 * timeout_s <= elapsed < 2 * timeout_s + 5.0, elapsed
        cluster.wait_until_idle()
    finally:
        stop_cluster(cluster)


def test_kv_layout_mismatch_is_refused_with_the_field_named(model_dirs: dict[str, Path]) -> None:
    """Block sizes differ (unmappable) and so do KV dtypes (mappable, test_kv_dtype.py): the refusal
    names block_size."""
    cluster = start_cluster(model_dirs["tiny"], "tcp", 1, 1, decode_block_size=32,
                            engine_options={"decode": {"kv_cache_dtype": "bfloat16"}})
    try:
        with httpx.Client(base_url=cluster.router.url, timeout=60) as http:
            reply = http.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 4})
        assert reply.status_code == 409, reply.text
        assert "KV layout mismatch on block_size" in reply.json()["error"]["message"]
        cluster.wait_until_idle()
    finally:
        stop_cluster(cluster)


def test_concurrent_requests_with_prefix_hits_on_both_sides(model_dirs: dict[str, Path], colocated: LLM) -> None:
    """Mixed-length requests all at once, streamed and not; the second wave shares long prefixes
    with the first, so decode finds them in its prefix cache (never sent again) and prefill in
    its own (computes less)."""
    cluster = start_cluster(model_dirs["tiny"], "tcp", 1, 1)
    base = random_prompt(200, seed=31)
    first_wave = [base[:n] + random_prompt(7, seed=n) for n in (40, 120, 200)] + PROMPTS
    second_wave = [base + random_prompt(n, seed=100 + n) for n in (3, 30, 90)]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

    async def run(prompts: list[list[int]]) -> list[dict[str, Any]]:
        async with httpx.AsyncClient(base_url=cluster.router.url, timeout=120) as http:
            async def one(index: int, prompt: list[int]) -> dict[str, Any]:
                body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}
                if index % 2:
                    reply = await http.post("/v1/completions", json=body | {"stream": True,
                                                                          "stream_options": {"include_usage": True}})
                    chunks = [e for e in parse_sse(reply.text) if isinstance(e, dict)]
                    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
                    return {"text": text, "usage": chunks[-1]["usage"]}
                reply = await http.post("/v1/completions", json=body)
                assert reply.status_code == 200, reply.text
                return {"text": reply.json()["choices"][0]["text"], "usage": reply.json()["usage"]}
            return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))

    try:
        for prompts in (first_wave, second_wave):
            want = generate_texts(colocated, prompts, params)
            got = asyncio.run(run(prompts))
            assert [g["text"] for g in got] == want
        cached = [g["usage"]["prompt_tokens_details"]["cached_tokens"] for g in got]
        assert all(c >= 192 for c in cached), cached  # 12 of base's blocks were on decode already
        prefill = next(s for s in cluster.services if isinstance(s, PrefillService))
        assert prefill.client.stats().num_prefix_hit_tokens > 0
        cluster.wait_until_idle()
    finally:
        stop_cluster(cluster)
