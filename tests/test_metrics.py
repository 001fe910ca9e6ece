"""/metrics on the router and on every worker role: each series moves as the requests say it must
(counts of finished requests, token totals equal to usage, KV usage back to 0 when idle, transfer
timeouts counted, error responses counted by reason), and the TTFT phases add up to the TTFT."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import random_prompt
from metrics_helpers import Scrape, scrape
from pd_fixtures import Cluster, start_cluster, stop_cluster
from server_fixtures import start_server

from pdserve.logs import RequestIdFilter
from pdserve.serving.metrics import TTFT_PHASES

MAX_TOKENS = 6


def _urls(cluster: Cluster) -> dict[str, str]:
    """role -> url for a 1P1D cluster, plus the router."""
    roles = {}
    for served, client in cluster.workers:
        roles["decode" if client.engine.layer_observer is None else "prefill"] = served.url
    return roles | {"router": cluster.router.url}


def _scrape_all(urls: dict[str, str]) -> dict[str, Scrape]:
    return {role: scrape(url) for role, url in urls.items()}


def _delta(after: dict[str, Scrape], before: dict[str, Scrape], role: str, name: str, **labels: str) -> float:
    return after[role].value(name, **labels) - before[role].value(name, **labels)


async def _load(base_url: str, prompts: list[list[int]]) -> list[dict[str, Any]]:
    """All prompts at once, every other one streamed; returns each response's usage."""
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
        async def one(index: int, prompt: list[int]) -> dict[str, Any]:
            body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}
            if index % 2:
                body |= {"stream": True, "stream_options": {"include_usage": True}}
            reply = await http.post("/v1/completions", json=body)
            assert reply.status_code == 200, reply.text
            if not index % 2:
                return reply.json()["usage"]
            events = [line.removeprefix("data: ") for line in reply.text.split("\n\n") if line.startswith("data: {")]
            return httpx.Response(200, content=events[-1]).json()["usage"]
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


PICKER_METRICS = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                  "vllm:gpu_cache_usage_perc", "vllm:cache_config_info")


def assert_picker_metrics(scrapes: dict[str, Scrape], block_size: int) -> None:
    """What an Inference Extension endpoint picker reads, on every role: the five series, the old
    usage name equal to the new, the cache's shape as labels of a gauge of 1."""
    for role, metrics in scrapes.items():
        missing = [name for name in PICKER_METRICS if not metrics.has(name)]
        assert not missing, (role, missing)
        assert metrics.value("vllm:gpu_cache_usage_perc") == metrics.value("vllm:kv_cache_usage_perc"), role
        [(labels, value)] = metrics.samples["vllm:cache_config_info"]
        assert value == 1 and labels["block_size"] == str(block_size), (role, labels)
        assert int(labels["num_gpu_blocks"]) > 0, (role, labels)


@pytest.fixture(scope="module")
def cluster(model_dirs: dict[str, Path]) -> Any:
    started = start_cluster(model_dirs["tiny"], "tcp", 1, 1)
    yield started
    stop_cluster(started)


@pytest.mark.slow
def test_pd_metrics_follow_the_requests(cluster: Cluster) -> None:
    urls = _urls(cluster)
    before = _scrape_all(urls)
    prompts = [random_prompt(n, seed=700 + n) for n in (5, 33, 70, 140)]
    usages = asyncio.run(_load(urls["router"], prompts))
    cluster.wait_until_idle()
    after = _scrape_all(urls)
    n = len(prompts)
    prompt_tokens = sum(u["prompt_tokens"] for u in usages)
    completion_tokens = sum(u["completion_tokens"] for u in usages)
    assert completion_tokens == n * MAX_TOKENS

    def d(role: str, name: str, **labels: str) -> float:
        return _delta(after, before, role, name, **labels)

    # Router: what the clients saw.
    for name in ("vllm:e2e_request_latency_seconds_count", "vllm:time_to_first_token_seconds_count",
                 "vllm:request_queue_time_seconds_count"):
        assert d("router", name) == n, name
    assert d("router", "vllm:inter_token_latency_seconds_count") == completion_tokens - n
    assert d("router", "vllm:prompt_tokens_total") == prompt_tokens
    assert d("router", "vllm:generation_tokens_total") == completion_tokens
    assert after["router"].value("vllm:num_requests_running") == 0
    assert after["router"].value("vllm:num_requests_waiting") == 0
    assert after["router"].value("pdserve:workers_ready", worker_role="decode") == 1
    # The TTFT phases add up to the TTFT (the transfer phase is the rest, never negative).
    phase_sum = 0.0
    for phase in TTFT_PHASES:
        assert d("router", "pdserve:ttft_phase_seconds_count", phase=phase) == n, phase
        assert d("router", "pdserve:ttft_phase_seconds_sum", phase=phase) >= 0, phase
        phase_sum += d("router", "pdserve:ttft_phase_seconds_sum", phase=phase)
    ttft_sum = d("router", "vllm:time_to_first_token_seconds_sum")
    assert phase_sum == pytest.approx(ttft_sum, abs=1e-3 * n)
    assert d("router", "pdserve:ttft_phase_seconds_sum", phase="prefill_compute") > 0
    # Prefill: computed every prompt token (fresh prompts: no prefix hits), one first token each.
    assert d("prefill", "pdserve:prefill_tokens_total") == prompt_tokens
    assert d("prefill", "vllm:prefix_cache_queries_total") == prompt_tokens
    assert d("prefill", "vllm:time_to_first_token_seconds_count") == n
    assert d("prefill", "pdserve:prefill_queue_time_seconds_count") == n
    assert d("prefill", "pdserve:kv_transfers_completed_total") == n
    assert after["prefill"].value("pdserve:prefill_batch_requests") == 0  # idle: no current batch
    assert after["prefill"].value("pdserve:prefill_queue_size") == 0
    # Decode: every token the clients got, every hand-off measured, the pool empty again.
    assert d("decode", "vllm:generation_tokens_total") == completion_tokens
    assert d("decode", "vllm:e2e_request_latency_seconds_count") == n
    assert d("decode", "pdserve:decode_time_per_output_token_seconds_count") == n
    assert d("decode", "pdserve:kv_transfer_duration_seconds_count") == n
    assert d("decode", "pdserve:kv_transfers_completed_total") == n
    assert d("decode", "pdserve:kv_transfer_bytes_total") > 0
    assert d("decode", "pdserve:kv_transfer_size_bytes_sum") == d("decode", "pdserve:kv_transfer_bytes_total")
    assert d("decode", "pdserve:kv_transfer_timeouts_total") == 0
    assert after["decode"].value("vllm:kv_cache_usage_perc") == 0.0
    assert after["decode"].value("pdserve:decode_active_requests") == 0
    assert_picker_metrics(after, block_size=16)
    assert after["decode"].value("pdserve:decode_reserved_requests") == 0


@pytest.mark.slow
def test_error_responses_are_counted_by_reason(cluster: Cluster) -> None:
    router = cluster.router.url
    before = scrape(router)
    with httpx.Client(base_url=router, timeout=30) as http:
        assert http.post("/v1/completions", json={"prompt": random_prompt(2000, seed=1)}).status_code == 400
        assert http.post("/v1/completions", json={"prompt": [1, 2], "model": "nope"}).status_code == 404
        assert http.post("/v1/completions", json={"prompt": [10**9], "max_tokens": 2}).status_code == 400
    after = scrape(router)
    name = "pdserve:rejections_total"
    for code, reason, count in (("400", "invalid_request", 2), ("404", "not_found", 1)):
        assert after.value(name, code=code, reason=reason) - before.value(name, code=code, reason=reason) == count
    # ...and the router's own admission reasons: only the out-of-vocabulary prompt reached its
    # validation (the handler's length check refuses the too-long one first).
    name = "pdserve:router_rejections_total"
    assert after.value(name, reason="invalid") - before.value(name, reason="invalid") == 1
    assert after.value(name) - before.value(name) == 1
    assert after.value("pdserve:router_queued_requests") == 0 and after.value("pdserve:router_dispatch_pending") == 0


@pytest.mark.slow
def test_transfer_timeouts_are_counted(model_dirs: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    """...and logged with the stable message, on lines that name the request."""
    caplog.set_level(logging.WARNING, logger="pdserve")
    caplog.handler.addFilter(RequestIdFilter())
    cluster = start_cluster(model_dirs["tiny"], "fake", 1, 1, policy="recompute", timeout_s=0.2,
                            prefill_options={"stall_after_layers": 1})
    try:
        urls = _urls(cluster)
        with httpx.Client(base_url=urls["router"], timeout=60) as http:
            reply = http.post("/v1/completions", json={"prompt": random_prompt(40, seed=3), "max_tokens": 4})
        assert reply.status_code == 200, reply.text
        cluster.wait_until_idle()
        decode, router = scrape(urls["decode"]), scrape(urls["router"])
        assert decode.value("pdserve:kv_transfer_timeouts_total") == 2  # the window, then the retry
        assert decode.value("pdserve:kv_transfer_retries_total") == 1
        assert decode.value("pdserve:kv_recomputations_total") == 1
        assert decode.value("pdserve:kv_transfer_failures_total", reason="timeout") == 1
        assert decode.value("pdserve:kv_transfers_completed_total") == 0
        # The client got its answer; with no hand-off there is no phase breakdown to report.
        assert router.value("vllm:e2e_request_latency_seconds_count") == 1
        assert router.value("pdserve:ttft_phase_seconds_count") == 0
        timed_out = [r for r in caplog.records if r.getMessage().startswith("KV cache transfer timed out")]
        assert len(timed_out) == 2
        ids = [getattr(r, "request_id", "-") for r in timed_out]
        assert all(rid.startswith("cmpl-") and rid in r.getMessage() for rid, r in zip(ids, timed_out, strict=True))
    finally:
        stop_cluster(cluster)


@pytest.mark.parametrize("in_process", [False, True], ids=["engine-process", "engine-thread"])
def test_colocated_metrics_preemption_and_allocation_failures(model_dirs: dict[str, Path], in_process: bool,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """A tiny pool: concurrent requests preempt each other (`No available block`), one that can
    never fit is refused (`Cannot allocate for request`); the counters match the usage. The engine's
    log lines are checked where it logs into this process (on a thread)."""
    server = start_server(model_dirs["tiny"], "colo", in_process=in_process, dtype="float32", num_kv_blocks=8,
                          max_num_batched_tokens=64)
    try:
        caplog.set_level(logging.WARNING, logger="pdserve")
        prompts = [random_prompt(30, seed=900 + i) for i in range(3)]
        body = {"max_tokens": 60, "ignore_eos": True, "temperature": 0}

        async def run() -> list[dict[str, Any]]:
            async with server.async_http() as http:
                replies = await asyncio.gather(*(http.post("/v1/completions", json=body | {"prompt": p})
                                                 for p in prompts))
            assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
            return [r.json()["usage"] for r in replies]

        usages = asyncio.run(run())
        with server.http() as http:
            too_big = http.post("/v1/completions", json={"prompt": prompts[0], "max_tokens": 200})
        assert too_big.status_code == 400 and "Cannot allocate for request" in too_big.json()["error"]["message"]
        server.wait_until_idle()
        metrics = scrape(server.base_url)
        assert metrics.value("vllm:prompt_tokens_total", role="colocated") == sum(u["prompt_tokens"] for u in usages)
        assert metrics.value("vllm:generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
        assert metrics.value("vllm:e2e_request_latency_seconds_count") == len(prompts)
        assert metrics.value("vllm:num_preemptions_total") > 0
        assert metrics.value("pdserve:no_available_block_total") >= metrics.value("vllm:num_preemptions_total")
        assert metrics.value("vllm:kv_cache_usage_perc") == 0.0
        assert metrics.value("vllm:num_requests_running") == 0
        assert_picker_metrics({"colocated": metrics}, block_size=16)
        assert metrics.value("pdserve:rejections_total", code="400", reason="invalid_request") == 1
        assert metrics.value("pdserve:cannot_allocate_total") == 1
        if not in_process:
            return
        messages = [r for r in caplog.records if r.name.startswith("pdserve")]
        no_block = [r for r in messages if r.getMessage().startswith("No available block")]
        assert no_block and all(getattr(r, "request_id", "-") != "-" for r in no_block)
        assert any(r.getMessage().startswith("Cannot allocate for request") for r in messages)
    finally:
        server.stop()
