"""The router's admission (429 / 503 / 400, counted by reason), its decode-selection policies and
conditional disaggregation, on thread-based clusters with the in-memory prefill queue."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from helpers import generate_texts, greedy, random_prompt
from pd_fixtures import MODEL, serve, start_cluster, stop_cluster
from server_fixtures import free_port

from pdserve import LLM, SamplingParams
from pdserve.disagg.config import RouterConfig
from pdserve.disagg.control import ReserveRequest, WireSamplingParams
from pdserve.disagg.router.app import create_router_app
from pdserve.disagg.router.core import PDRouter
from pdserve.disagg.worker.decode_service import DecodeService
from pdserve.disagg.worker.prefill_service import PrefillService
from pdserve.disagg.worker.stats import DecodeStats
from pdserve.model.qwen3_config import Qwen3ModelConfig
from pdserve.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow  # every test starts a cluster

MAX_TOKENS = 6
GREEDY = {"max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}


def greedy_text(llm: LLM, prompt: list[int]) -> str:
    return generate_texts(llm, [prompt], greedy(MAX_TOKENS))[0]


def test_queue_bound_gives_exactly_the_expected_429s(model_dirs: dict[str, Path], colocated: LLM) -> None:
    # A 64-block decode pool filled by two reservations whose KV never comes: every routed request
    # waits for room (it is "queued"), so admission sees a deterministic queue.
    cluster = start_cluster(model_dirs["tiny"], "tcp", 1, 1, decode_kv_blocks=64, max_queued_requests=3)
    decode_url = cluster.workers[0][0].url
    prompts = [random_prompt(60, seed=700 + i) for i in range(5)]
    try:
        with httpx.Client(timeout=30) as http:
            for i in range(2):
                hold = ReserveRequest(request_id=f"hold-{i}", transfer_id=f"hold-{i}@0",
                                      prompt_token_ids=random_prompt(500, seed=i),
                                      params=WireSamplingParams.of(SamplingParams(max_tokens=1)))
                assert http.post(f"{decode_url}/pd/reserve", json=hold.model_dump()).status_code == 200

        async def run() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=cluster.router.url, timeout=60) as client:
                tasks = [asyncio.create_task(client.post("/v1/completions", json=GREEDY | {"prompt": p}))
                         for p in prompts]
                deadline = time.monotonic() + 20
                while sum(t.done() for t in tasks) < 2 or cluster.pd.stats().queued_requests < 3:
                    assert time.monotonic() < deadline, (cluster.pd.stats(), [t.done() for t in tasks])
                    await asyncio.sleep(0.02)
                rejected = [t.result() for t in tasks if t.done()]
                assert [r.status_code for r in rejected] == [429, 429], [r.text for r in rejected]
                assert all(r.headers["retry-after"] == "1" for r in rejected)
                assert all(r.json()["error"]["type"] == "rate_limit_error" for r in rejected)
                for i in range(2):  # room again: the three queued requests go through
                    await client.post(f"{decode_url}/pd/abort/hold-{i}")
                return [await t for t in tasks]

        replies = asyncio.run(run())
        ok = [(p, r) for p, r in zip(prompts, replies, strict=True) if r.status_code == 200]
        assert len(ok) == 3 and sum(r.status_code == 429 for r in replies) == 2
        for prompt, reply in ok:
            assert reply.json()["choices"][0]["text"] == greedy_text(colocated, prompt)
        stats = cluster.pd.stats()
        assert stats.rejections.queue_full == 2
        assert stats.queued_requests == 0 and stats.queued_tokens == 0
        cluster.wait_until_idle()
    finally:
        stop_cluster(cluster)


def test_prompt_too_long_is_a_400_before_anything_is_queued(model_dirs: dict[str, Path]) -> None:
    cluster = start_cluster(model_dirs["tiny"], "tcp", 1, 1)
    try:
        with httpx.Client(base_url=cluster.router.url, timeout=30) as http:
            for stream in (False, True):
                reply = http.post("/v1/completions", json={"prompt": random_prompt(1100, seed=1), "stream": stream})
                assert reply.status_code == 400, reply.text
                assert "maximum context length" in reply.json()["error"]["message"]
        decode = cluster.service(DecodeService)
        assert decode.stats() == DecodeStats() and decode.num_in_flight == 0  # nothing was reserved
        assert cluster.pd.stats().queued_requests == 0
    finally:
        stop_cluster(cluster)


def test_no_ready_worker_is_a_503_streamed_or_not(model_dirs: dict[str, Path]) -> None:
    """Workers that never come: in the router's first 2 s (its startup window) a request waits for
    them, then gets the 503 (retry after 1 s); one sent after that window gets it at once."""
    model_dir = model_dirs["tiny"]
    nowhere = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    config = RouterConfig(prefill=tuple(nowhere[:1]), decode=tuple(nowhere[1:]), startup_window_s=2.0,
                          restart_window_s=5.0)
    client = PDRouter.from_config(config, load_tokenizer(str(model_dir)), Qwen3ModelConfig.from_dir(model_dir),
                                  str(model_dir), 1024)
    router = serve(create_router_app(client, MODEL))
    try:
        with httpx.Client(base_url=router.url, timeout=30) as http:
            elapsed = []
            for stream in (False, True):
                start = time.monotonic()
                reply = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": stream})
                elapsed.append(time.monotonic() - start)
                assert reply.status_code == 503 and reply.headers["retry-after"] == "1", reply.text
                assert reply.json()["error"]["type"] == "service_unavailable"
            assert 0.5 < elapsed[0] < 4.0 and elapsed[1] < 0.3, elapsed
            # alive (restarting it would bring no worker), not ready (Kubernetes sends it no client)
            assert http.get("/health").status_code == 200
            ready = http.get("/ready")
            assert ready.status_code == 503 and ready.json()["reason"] == "no prefill worker is ready"
        assert client.stats().rejections.no_prefill_worker == 2
    finally:
        router.stop()


def _until(condition: Callable[[], bool], timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_ready_routes_follow_draining_workers_and_the_pool(model_dirs: dict[str, Path]) -> None:
    """GET /ready (Kubernetes' readiness probe) on workers and router; GET /health (liveness)
    stays 200 throughout: nothing here is cured by a restart."""
    cluster = start_cluster(model_dirs["tiny"], "tcp", 1, 1)
    decode_url, prefill_url = (served.url for served, _ in cluster.workers)
    decode = cluster.service(DecodeService)
    try:
        with httpx.Client(timeout=30) as http:
            def ready(url: str) -> httpx.Response:
                return http.get(f"{url}/ready")

            assert ready(decode_url).json() == {"status": "ready", "role": "decode"}
            assert ready(prefill_url).json() == {"status": "ready", "role": "prefill"}
            assert ready(cluster.router.url).json() == {"status": "ready"}
            decode.draining = True  # what SIGTERM does first (Worker.drain)
            reply = ready(decode_url)
            assert reply.status_code == 503 and reply.json()["reason"] == "draining"
            assert http.get(f"{decode_url}/pd/info").json()["ready"] is False
            _until(lambda: ready(cluster.router.url).status_code == 503)  # its next poll of the pool
            assert ready(cluster.router.url).json() == {"status": "not ready", "reason": "no decode worker is ready"}
            assert all(http.get(f"{url}/health").status_code == 200
                       for url in (decode_url, prefill_url, cluster.router.url))
            decode.draining = False
            _until(lambda: ready(cluster.router.url).status_code == 200)
            assert ready(decode_url).status_code == 200
            assert http.post(f"{cluster.router.url}/v1/completions",
                             json=GREEDY | {"prompt": "hi"}).status_code == 200
        cluster.wait_until_idle()
    finally:
        stop_cluster(cluster)


@pytest.mark.parametrize("policy", ["round-robin", "prefix-affinity"])
def test_decode_selection_policy(model_dirs: dict[str, Path], colocated: LLM, policy: str) -> None:
    cluster = start_cluster(model_dirs["tiny"], "tcp", 1, 2, decode_policy=policy)
    shared = random_prompt(256, seed=42)
    prompts = [shared + random_prompt(20, seed=900 + i) for i in range(4)]
    try:
        cached = []
        with httpx.Client(base_url=cluster.router.url, timeout=60) as http:
            for prompt in prompts:
                reply = http.post("/v1/completions", json=GREEDY | {"prompt": prompt})
                assert reply.status_code == 200, reply.text
                assert reply.json()["choices"][0]["text"] == greedy_text(colocated, prompt)
                cached.append(reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        served = sorted(cluster.service(DecodeService, i).stats().completed for i in range(2))
        if policy == "round-robin":
            assert served == [2, 2]
        else:  # every request goes where the shared prefix already is, and hits it there
            assert served == [0, 4]
            assert cached[0] == 0 and all(c == 256 for c in cached[1:]), cached
        cluster.wait_until_idle()
    finally:
        stop_cluster(cluster)


def test_short_uncached_rest_is_prefilled_on_decode(model_dirs: dict[str, Path], colocated: LLM) -> None:
    cluster = start_cluster(model_dirs["tiny"], "tcp", 1, 1, pd_threshold=64)
    short, long = random_prompt(40, seed=1), random_prompt(260, seed=2)
    try:
        with httpx.Client(base_url=cluster.router.url, timeout=60) as http:
            for prompt in (short, long, long):  # the second `long` finds 256 tokens cached on decode
                reply = http.post("/v1/completions", json=GREEDY | {"prompt": prompt})
                assert reply.status_code == 200, reply.text
                assert reply.json()["choices"][0]["text"] == greedy_text(colocated, prompt)
        assert cluster.pd.stats().events.prefilled_on_decode == 2
        assert cluster.service(DecodeService).stats().prefilled_locally == 2
        assert cluster.service(PrefillService).stats().handed_off == 1
        cluster.wait_until_idle()
    finally:
        stop_cluster(cluster)


@pytest.mark.parametrize("window_s", [3.0, 0.0], ids=["window", "no-window"])
def test_a_request_sent_while_the_only_decode_worker_restarts_waits_for_it(model_dirs: dict[str, Path],
                                                                           colocated: LLM, window_s: float) -> None:
    """The only decode worker goes away (draining, as before a restart) and comes back 0.8 s later:
    a request sent meanwhile waits for it (the restart window) and gets its answer; without the
    window it gets a 503 with Retry-After at once."""
    cluster = start_cluster(model_dirs["tiny"], "tcp", 1, 1, restart_window_s=window_s)
    decode = cluster.service(DecodeService)
    prompt = random_prompt(24, seed=77)
    try:
        with httpx.Client(base_url=cluster.router.url, timeout=30) as http:
            decode.draining = True
            _until(lambda: http.get("/ready").status_code == 503)  # the router's pool saw it go
            threading_timer = threading.Timer(0.8, lambda: setattr(decode, "draining", False))
            threading_timer.start()
            start = time.monotonic()
            reply = http.post("/v1/completions", json=GREEDY | {"prompt": prompt})
            elapsed = time.monotonic() - start
            threading_timer.join()
            if window_s:
                assert reply.status_code == 200, reply.text
                assert reply.json()["choices"][0]["text"] == greedy_text(colocated, prompt)
                assert elapsed >= 0.5
            else:
                assert reply.status_code == 503 and reply.headers["retry-after"] == "1", reply.text
                assert elapsed < 0.5
        cluster.wait_until_idle()
    finally:
        stop_cluster(cluster)


def test_a_fresh_router_waits_for_its_first_decode_worker(model_dirs: dict[str, Path], colocated: LLM) -> None:
    """Within its startup window, a router that has not seen any decode worker ready yet (it is
    loading, or registering) holds a request up to its restart window instead of a 503 at once
    (`up`'s router, polled on /v1/models, once refused a request 30 ms before its decode worker
    registered)."""
    cluster = start_cluster(model_dirs["tiny"], "tcp", 1, 1)
    decode = cluster.service(DecodeService)
    decode.draining = True  # not ready when the fresh router below first polls it
    config = RouterConfig(prefill=(cluster.workers[1][0].url,), decode=(cluster.workers[0][0].url,),
                          restart_window_s=3.0)
    fresh = PDRouter.from_config(config, load_tokenizer(str(model_dirs["tiny"])),
                                 Qwen3ModelConfig.from_dir(model_dirs["tiny"]), str(model_dirs["tiny"]), 1024)
    router = serve(create_router_app(fresh, MODEL))
    prompt = random_prompt(24, seed=78)
    timer = threading.Timer(0.8, lambda: setattr(decode, "draining", False))
    try:
        with httpx.Client(base_url=router.url, timeout=30) as http:
            assert http.get("/ready").status_code == 503
            timer.start()
            start = time.monotonic()
            reply = http.post("/v1/completions", json=GREEDY | {"prompt": prompt})
            elapsed = time.monotonic() - start
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["text"] == greedy_text(colocated, prompt)
            assert elapsed >= 0.5
        timer.join()
        cluster.wait_until_idle()
    finally:
        timer.cancel()
        router.stop()
        stop_cluster(cluster)
