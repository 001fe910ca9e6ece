"""The prefill queue on a real `redis-server`: prefill workers as processes, SIGKILLed mid-load;
a poison job that kills every worker it reaches; Redis itself stopped for 10 s.

After every test: no pending entry in the consumer group, no KV block held on any worker."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers import generate_texts, greedy, random_prompt
from process_cluster import (
    ProcessCluster,
    RedisServer,
    WorkerProcess,
    pending_entries,
    spawn_worker,
    start_redis,
    start_router,
    wait_healthy,
)

from pdserve import LLM

pytestmark = pytest.mark.slow  # a Redis server and workers as processes

MAX_TOKENS = 8
GREEDY = {"max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}
# NOTE: a small step budget makes each prefill take long enough (tens of steps) to be caught mid-job.
PREFILL_FLAGS = ["--max-num-batched-tokens", "8", "--num-kv-blocks", "256", "--queue-claim-idle-s", "1",
                 "--queue-max-deliveries", "2"]
# The decode worker never gives up on a transfer here: re-delivery through the queue must do it.
DECODE_FLAGS = ["--num-kv-blocks", "512", "--kv-transfer-timeout-ms", "60000"]


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def cluster(model_dirs: dict[str, Path], redis_server: RedisServer,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProcessCluster]:
    logs = tmp_path_factory.mktemp("logs")
    queue = ["--queue", redis_server.url]
    decode = [spawn_worker("decode", model_dirs["tiny"], logs, DECODE_FLAGS)]
    prefill = [spawn_worker("prefill", model_dirs["tiny"], logs, PREFILL_FLAGS + queue) for _ in range(2)]
    cluster = ProcessCluster(prefill, decode, None)  # type: ignore[arg-type]
    try:
        wait_healthy(decode + prefill)
        cluster.router = start_router(model_dirs["tiny"], [], decode, queue_url=redis_server.url)
        yield cluster
    finally:
        cluster.stop()


def greedy_texts(llm: LLM, prompts: list[list[int]]) -> list[str]:
    return generate_texts(llm, prompts, greedy(MAX_TOKENS))


def holding(workers: list[WorkerProcess]) -> list[WorkerProcess]:
    """Live prefill workers working on a queue job right now."""
    found = []
    for worker in workers:
        if worker.popen.poll() is None:
            try:
                if worker.stats()["queue"]["in_flight"]:
                    found.append(worker)
            except httpx.HTTPError:
                pass
    return found


def wait_for_holder(workers: list[WorkerProcess], timeout_s: float = 20.0) -> WorkerProcess:
    deadline = time.monotonic() + timeout_s
    while not (found := holding(workers)):
        assert time.monotonic() < deadline, "no prefill worker took the job"
        time.sleep(0.01)
    return found[0]


def check_clean(cluster: ProcessCluster, redis_server: RedisServer) -> None:
    deadline = time.monotonic() + 10
    while pending_entries(redis_server) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pending_entries(redis_server) == 0
    cluster.wait_until_idle()


async def post_all(url: str, prompts: list[list[int]], stream: bool = False) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        return list(await asyncio.gather(*(http.post("/v1/completions", json=GREEDY | {"prompt": p, "stream": stream})
                                           for p in prompts)))


def test_prefill_sigkill_mid_load_loses_no_request(cluster: ProcessCluster, redis_server: RedisServer,
                                                   colocated: LLM) -> None:
    prompts = [random_prompt(120 + 37 * i, seed=3000 + i) for i in range(8)]
    want = greedy_texts(colocated, prompts)

    async def run() -> list[httpx.Response]:
        load = asyncio.create_task(post_all(cluster.router.url, prompts))
        victim = await asyncio.to_thread(wait_for_holder, cluster.prefill[:1])
        victim.kill(signal.SIGKILL)
        return await load

    replies = asyncio.run(run())
    assert [r.status_code for r in replies] == [200] * len(prompts), [r.text for r in replies]
    assert [r.json()["choices"][0]["text"] for r in replies] == want
    survivor = cluster.prefill[1].stats()["queue"]["counters"]
    assert survivor["reclaimed"] >= 1, survivor  # the killed worker's job was delivered again
    assert redis_server.client().xlen("pdserve:default:prefill:dead") == 0
    check_clean(cluster, redis_server)


def test_two_routers_share_one_queue(cluster: ProcessCluster, redis_server: RedisServer, colocated: LLM,
                                     model_dirs: dict[str, Path]) -> None:
    second = start_router(model_dirs["tiny"], [], cluster.decode, queue_url=redis_server.url)
    try:
        prompts = [random_prompt(40 + 10 * i, seed=4000 + i) for i in range(6)]

        async def run() -> list[httpx.Response]:
            halves = await asyncio.gather(post_all(cluster.router.url, prompts[:3]), post_all(second.url, prompts[3:]))
            return halves[0] + halves[1]

        replies = asyncio.run(run())
        assert [r.json()["choices"][0]["text"] for r in replies] == greedy_texts(colocated, prompts)
    finally:
        second.stop()
    check_clean(cluster, redis_server)


def test_poison_job_is_dead_lettered_with_an_error_to_its_client(
        cluster: ProcessCluster, redis_server: RedisServer, model_dirs: dict[str, Path],
        tmp_path: Path) -> None:
    # Two fresh workers beside the survivor of the previous test: the job kills whoever takes it,
    # twice; the third worker to see it finds it delivered more than --queue-max-deliveries times.
    fresh = [spawn_worker("prefill", model_dirs["tiny"], tmp_path, PREFILL_FLAGS + ["--queue", redis_server.url])
             for _ in range(2)]
    cluster.prefill.extend(fresh)  # stopped with the cluster, whatever happens
    wait_healthy(fresh)
    live = [w for w in cluster.prefill if w.popen.poll() is None]
    assert len(live) == 3

    async def run() -> httpx.Response:
        request = asyncio.create_task(post_all(cluster.router.url, [random_prompt(900, seed=77)]))
        for _ in range(2):
            victim = await asyncio.to_thread(wait_for_holder, live)
            victim.kill(signal.SIGKILL)
            live.remove(victim)
        return (await request)[0]

    reply = asyncio.run(run())
    assert reply.status_code == 503, reply.text
    assert "dead-lettered" in reply.json()["error"]["message"]
    dead = redis_server.client().xrange("pdserve:default:prefill:dead")
    assert len(dead) == 1 and "dead-lettered" in dead[0][1]["reason"]
    assert live[0].stats()["queue"]["counters"]["dead_lettered"] == 1
    check_clean(cluster, redis_server)


def test_redis_down_for_10_s_gives_503s_then_recovers_without_restart(
        cluster: ProcessCluster, redis_server: RedisServer, colocated: LLM) -> None:
    prompt = random_prompt(50, seed=5)
    want = greedy_texts(colocated, [prompt])[0]
    with httpx.Client(base_url=cluster.router.url, timeout=60) as http:
        assert http.post("/v1/completions", json=GREEDY | {"prompt": prompt}).status_code == 200
        redis_server.stop()
        down_until = time.monotonic() + 10
        statuses = []
        time.sleep(1.0)  # the router's next poll notices
        while time.monotonic() < down_until:
            reply = http.post("/v1/completions", json=GREEDY | {"prompt": prompt})
            statuses.append(reply.status_code)
            assert reply.status_code == 503, reply.text
            time.sleep(0.5)
        assert cluster.router.client.stats().rejections.queue_unavailable >= len(statuses) > 5
        redis_server.start()
        deadline = time.monotonic() + 20
        while (reply := http.post("/v1/completions", json=GREEDY | {"prompt": prompt})).status_code != 200:
            assert reply.status_code == 503 and time.monotonic() < deadline, reply.text
            time.sleep(0.25)
        assert reply.json()["choices"][0]["text"] == want
    check_clean(cluster, redis_server)
