"""What the autoscaler reads from a router: windowed quantiles of cumulative histograms (as
Prometheus computes them), the router's series parsed into `Signals` (from a fake pool and from a
real router under load, whose latency histograms must agree with its TTFT phases and ITL), the
queue depth while prefill jobs wait, and the Redis queue's backlog (its consumer group's lag)."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis
from helpers import random_prompt
from metrics_helpers import scrape as scrape_metrics
from pd_fixtures import start_cluster, stop_cluster
from process_cluster import start_redis
from server_fixtures import free_port

from pdserve.disagg.control import PrefillJob, WireSamplingParams
from pdserve.disagg.queue.redis_streams import GROUP, RedisPrefillQueue
from pdserve.disagg.router.metrics import RouterCollector
from pdserve.disagg.router.stats import Rejections, RouterEvents, RouterStats, WorkerLoad, WorkerView
from pdserve.engine.sampling_params import SamplingParams
from pdserve.ops.signals import HistogramSnapshot, Signals, mean, parse_router_metrics, quantile, scrape
from pdserve.serving.metrics import RequestObserver, ServerMetrics

INF = math.inf


def snap(buckets: dict[float, float], total: float = 0.0) -> HistogramSnapshot:
    return HistogramSnapshot(buckets, total, buckets[INF])


def test_quantile_interpolates_inside_the_bucket_like_prometheus() -> None:
    empty = HistogramSnapshot.empty()
    newer = snap({0.1: 1, 0.5: 3, 1.0: 4, INF: 4}, 1.6)
    assert quantile(empty, newer, 0.5) == pytest.approx(0.3)  # rank 2: halfway through (0.1, 0.5]
    assert quantile(empty, newer, 0.25) == pytest.approx(0.1)  # rank 1: the top of the first bucket
    assert quantile(empty, newer, 0.1) == pytest.approx(0.04)  # the first bucket starts at 0
    assert quantile(empty, newer, 1.0) == pytest.approx(1.0)
    assert mean(empty, newer) == pytest.approx(0.4)
    # a rank in the +Inf bucket: the highest finite bound
    assert quantile(empty, snap({1.0: 1, INF: 3}), 0.9) == 1.0
    # only what happened between the snapshots counts
    older = snap({0.1: 1, 0.5: 1, 1.0: 1, INF: 1}, 0.05)
    assert quantile(older, newer, 0.5) == pytest.approx(0.1 + 0.4 * 1.5 / 2)
    assert mean(older, newer) == pytest.approx((1.6 - 0.05) / 3)
    # nothing observed in between: no value (not 0)
    assert quantile(newer, newer, 0.9) is None and mean(newer, newer) is None
    assert quantile(empty, empty, 0.9) is None
    # counters that went back (the router restarted): the newer snapshot alone
    assert quantile(snap({0.1: 9, 0.5: 9, 1.0: 9, INF: 9}), newer, 0.5) == pytest.approx(0.3)
    with pytest.raises(ValueError, match="quantile must be in"):
        quantile(empty, newer, 0)


@dataclass
class FakeRouter:
    """RouterState with a fixed pool and queue backlog."""

    views: list[WorkerView]
    backlog: int

    def workers(self) -> list[WorkerView]:
        return self.views

    def stats(self) -> RouterStats:
        return RouterStats(queued_requests=0, queued_tokens=0, dispatch_pending=0, queue_backlog=self.backlog,
                           queue="redis", live_queue_consumers=2, queue_error="", rejections=Rejections(),
                           events=RouterEvents())


def view(role: str, ready: bool, running: int, waiting: int, reachable: bool = True) -> WorkerView:
    load = WorkerLoad(running, waiting, 10, 10) if reachable else None
    return WorkerView(role, f"http://{role}-{running}-{waiting}", ready, 0, not ready, load)  # type: ignore[arg-type]


def test_depth_and_running_count_ready_workers_only() -> None:
    metrics = ServerMetrics("m", "router")
    pool = [view("prefill", True, 1, 3), view("prefill", True, 0, 2), view("prefill", False, 0, 7),
            view("prefill", False, 0, 50, reachable=False), view("decode", True, 5, 1), view("decode", True, 6, 0),
            view("decode", False, 9, 0)]
    metrics.registry.register(RouterCollector(metrics, RequestObserver(metrics), FakeRouter(pool, backlog=4)))
    signals = parse_router_metrics(metrics.render().decode(), now=12.5)
    assert signals.time == 12.5
    assert signals.prefill_queue_depth == 4 + 3 + 2  # the backlog + what the ready prefill workers have waiting
    assert signals.decode_running == 5 + 6
    assert signals.ready == {"prefill": 2, "decode": 2}
    assert signals.queue_latency.count == 0 and quantile(HistogramSnapshot.empty(), signals.tpot, 0.9) is None
    with pytest.raises(ValueError, match="the router.s metrics have no pdserve:workers_ready"):
        parse_router_metrics("# a worker's metrics\nvllm:num_requests_running 1\n", now=0)


def test_scrape_gives_none_when_the_router_does_not_answer() -> None:
    assert scrape(f"http://127.0.0.1:{free_port()}", timeout_s=0.5) is None


async def _load_and_watch(url: str, prompts: list[list[int]], max_tokens: int) -> list[Signals]:
    """All prompts at once; the router read every 0.1 s until they are done."""
    readings: list[Signals] = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        async def one(prompt: list[int]) -> None:
            body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
            reply = await http.post("/v1/completions", json=body)
            assert reply.status_code == 200, reply.text

        requests = asyncio.gather(*(one(p) for p in prompts))
        while not requests.done():
            reading = await asyncio.to_thread(scrape, url, 5.0)
            assert reading is not None
            readings.append(reading)
            await asyncio.sleep(0.1)
        await requests
    return readings


def _settled(url: str) -> Signals:
    """The router's reading once its next polls of the pool show the workers idle (depth and
    running 0): the load it shows is what the workers last advertised (polled every 0.5 s)."""
    deadline = time.monotonic() + 10
    while True:
        reading = scrape(url, 5.0)
        assert reading is not None
        if (reading.prefill_queue_depth, reading.decode_running) == (0, 0) or time.monotonic() > deadline:
            assert (reading.prefill_queue_depth, reading.decode_running) == (0, 0)
            return reading
        time.sleep(0.1)


@pytest.mark.slow
def test_a_real_router_reports_the_signals(model_dirs: dict[str, Path]) -> None:
    cluster = start_cluster(model_dirs["tiny"], "tcp", 1, 1)
    try:
        url = cluster.router.url
        before, phases_before = scrape(url), scrape_metrics(url)
        assert before is not None and before.ready == {"prefill": 1, "decode": 1}
        max_tokens, prompts = 200, [random_prompt(20 + 10 * i, seed=40 + i) for i in range(4)]
        readings = asyncio.run(_load_and_watch(url, prompts, max_tokens))
        cluster.wait_until_idle()
        after, phases = _settled(url), scrape_metrics(url)
        assert max(r.decode_running for r in readings) >= 1  # the decode worker's batch, seen by the router
        n = len(prompts)
        assert after.queue_latency.count - before.queue_latency.count == n
        assert after.tpot.count - before.tpot.count == n
        # queue latency = the router_queue + prefill_queue phases of each request
        phase_sum = sum(phases.value("pdserve:ttft_phase_seconds_sum", phase=p) -
                        phases_before.value("pdserve:ttft_phase_seconds_sum", phase=p)
                        for p in ("router_queue", "prefill_queue"))
        assert after.queue_latency.sum - before.queue_latency.sum == pytest.approx(phase_sum, abs=1e-6)
        # TPOT * (tokens - 1) of each request = its first to last token = the sum of its ITLs
        itl_sum = phases.value("vllm:inter_token_latency_seconds_sum") - \
            phases_before.value("vllm:inter_token_latency_seconds_sum")
        assert (after.tpot.sum - before.tpot.sum) * (max_tokens - 1) == pytest.approx(itl_sum, rel=1e-6)
        p90 = quantile(before.queue_latency, after.queue_latency, 0.9)
        assert p90 is not None and 0 < p90 <= 10
    finally:
        stop_cluster(cluster)


@pytest.mark.slow
def test_queue_depth_counts_the_jobs_waiting_for_a_prefill_worker(model_dirs: dict[str, Path]) -> None:
    """Every KV transfer stalls (then decode recomputes): the one prefill worker holds one 60-token
    job at a time (its budget is 64 tokens), so the others wait in the router's FIFO."""
    cluster = start_cluster(model_dirs["tiny"], "fake", 1, 1, policy="recompute", timeout_s=1.0,
                            prefill_options={"stall_after_layers": 1})
    try:
        prompts = [random_prompt(60, seed=60 + i) for i in range(3)]
        readings = asyncio.run(_load_and_watch(cluster.router.url, prompts, 4))
        cluster.wait_until_idle()
        assert max(r.prefill_queue_depth for r in readings) >= 2
        _settled(cluster.router.url)
    finally:
        stop_cluster(cluster)


@pytest.mark.slow
def test_redis_backlog_is_the_entries_no_consumer_took(tmp_path: Path) -> None:
    server = start_redis(tmp_path)
    try:
        asyncio.run(_redis_backlog(server.url, server.client()))
    finally:
        server.stop()


async def _redis_backlog(url: str, client: redis.Redis) -> None:
    queue = RedisPrefillQueue(url)
    try:
        await queue.refresh()
        assert queue.stats().num_backlog == 0 and queue.error == ""  # nothing ever queued: no stream yet
        params = WireSamplingParams.of(SamplingParams(max_tokens=2))
        for i in range(4):
            await queue.put(PrefillJob(request_id=f"r{i}", transfer_id=f"r{i}@0", prompt_token_ids=[1, 2, 3],
                                       params=params, kv_address="a:1", block_ids=[0], num_cached_tokens=0))
        await queue.refresh()
        assert queue.stats().num_backlog == 4
        stream = queue.keys.stream
        [(_, taken)] = client.xreadgroup(GROUP, "c1", {stream: ">"}, count=2)
        await queue.refresh()
        assert queue.stats().num_backlog == 2
        # the second job finishes first (acknowledged and deleted): Redis no longer knows the lag
        client.xack(stream, GROUP, taken[1][0])
        client.xdel(stream, taken[1][0])
        assert client.xinfo_groups(stream)[0]["lag"] is None
        await queue.refresh()
        assert queue.stats().num_backlog == 2
        client.xack(stream, GROUP, taken[0][0])
        client.xdel(stream, taken[0][0])
        client.xreadgroup(GROUP, "c1", {stream: ">"}, count=1)
        await queue.refresh()
        assert queue.stats().num_backlog == 1
    finally:
        await queue.close()
