"""Two routers side by side in front of the same prefill and decode worker (each worker joins both:
`--register URL URL`), with the in-memory queue (each router pushes its own jobs) and with one Redis
stream both routers share. A client cannot tell which router answered:

- a mix of streamed and plain greedy requests sent to both at once: every one answered once, with
  the colocated text, one [DONE] per stream, ids unique across the routers, and each prompt handed
  off exactly once (the workers' counters);
- the same model list and the same error for a bad request from either router;
- streams dropped by their clients mid-way on both routers: the aborts reach both workers, which end
  with no reservation, no request, no prefill attempt and every KV block free (and, with Redis, no
  entry left pending in the consumer group).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from helpers import generate_texts, greedy, random_prompt
from metrics_helpers import scrape
from process_cluster import (
    InProcessRouter,
    RedisServer,
    WorkerProcess,
    pending_entries,
    spawn_worker,
    start_redis,
    start_router,
    wait_healthy,
    wait_router_ready,
)

from pdserve import LLM

pytestmark = pytest.mark.slow  # a Redis server, workers as processes, two routers

MAX_TOKENS = 12
GREEDY = {"max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}
# NOTE: transfers never time out here (a retry would be a second hand-off of the same prompt)
FLAGS = ["--num-kv-blocks", "512", "--max-num-batched-tokens", "64", "--kv-transfer-timeout-ms", "60000"]
_ABORT_MAX_TOKENS = 800  # a dropped stream's length: running it to the end takes far longer than an abort


@dataclass
class TwoRouters:
    redis: RedisServer | None
    routers: list[InProcessRouter] = field(default_factory=list)
    workers: list[WorkerProcess] = field(default_factory=list)  # prefill, decode

    @property
    def prefill(self) -> WorkerProcess:
        return self.workers[0]

    @property
    def decode(self) -> WorkerProcess:
        return self.workers[1]

    def stop(self) -> None:
        for router in self.routers:
            router.stop()
        for worker in self.workers:
            worker.kill()
            worker.popen.wait(10)
        if self.redis is not None:
            self.redis.stop()

    def counters(self) -> dict[str, int]:
        """Hand-offs so far: those prefill made and those decode received whole."""
        return {"handed_off": self.prefill.stats()["counters"].get("handed_off", 0),
                "completed": self.decode.stats()["counters"].get("completed", 0)}

    def leftovers(self) -> dict[str, object]:
        """What any worker (or the shared queue) still holds; empty when all is free."""
        found: dict[str, object] = {}
        for worker in self.workers:
            info = httpx.get(f"{worker.url}/pd/info", timeout=5).json()
            stats = worker.stats()
            metrics = scrape(worker.url)
            held = {"in_flight": stats["in_flight"], "running": info["num_running"], "waiting": info["num_waiting"],
                    "queue_in_flight": (stats["queue"] or {}).get("in_flight", 0),
                    "reserved": metrics.value("pdserve:decode_reserved_requests"),
                    "kv_blocks_not_free": metrics.value("pdserve:kv_blocks_total")
                    - metrics.value("pdserve:kv_blocks_free")}
            found |= {f"{worker.role}.{name}": n for name, n in held.items() if n}
        if self.redis is not None and (pending := pending_entries(self.redis)):
            found["redis.pending"] = pending
        return found

    def wait_until_free(self, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while (left := self.leftovers()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, left


@pytest.fixture(scope="module", params=["memory", "redis"])
def two(request: pytest.FixtureRequest, model_dirs: dict[str, Path],
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoRouters]:
    """The routers first (they accept registrations), then one worker of each role joining both."""
    logs = tmp_path_factory.mktemp(f"logs-{request.param}")
    cluster = TwoRouters(start_redis(tmp_path_factory.mktemp("redis")) if request.param == "redis" else None)
    queue_url = cluster.redis.url if cluster.redis is not None else None
    try:
        for _ in range(2):
            cluster.routers.append(start_router(model_dirs["tiny"], [], [], queue_url, wait_ready=False,
                                                accept_registrations=True))
        register = ["--register", *(r.url for r in cluster.routers)]
        queue = ["--queue", queue_url] if queue_url is not None else []  # prefill pulls from it
        for role, extra in (("prefill", queue), ("decode", [])):
            cluster.workers.append(spawn_worker(role, model_dirs["tiny"], logs, FLAGS + register + extra))
        wait_healthy(cluster.workers)
        for router in cluster.routers:
            wait_router_ready(router, timeout_s=60)
        yield cluster
    finally:
        cluster.stop()


def sse_text(body: str) -> tuple[str, str]:
    """A completed stream's text and its id; asserts one [DONE], last, no error, one id."""
    data = [line.removeprefix("data: ") for line in body.splitlines() if line.startswith("data: ")]
    assert data.count("[DONE]") == 1 and data[-1] == "[DONE]", data[-3:]
    chunks = [json.loads(d) for d in data[:-1]]
    assert all("error" not in c for c in chunks), chunks
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1, ids
    assert sum(1 for c in chunks for choice in c["choices"] if choice.get("finish_reason")) == 1
    return "".join(choice["text"] for c in chunks for choice in c["choices"]), ids.pop()


async def answer(http: httpx.AsyncClient, url: str, prompt: list[int], stream: bool) -> tuple[str, str]:
    """One greedy completion through the router at `url`: its text and its id."""
    reply = await http.post(f"{url}/v1/completions", json=GREEDY | {"prompt": prompt, "stream": stream})
    assert reply.status_code == 200, reply.text
    if stream:
        return sse_text(reply.text)
    body = reply.json()
    assert len(body["choices"]) == 1 and body["usage"]["completion_tokens"] == MAX_TOKENS, body
    return body["choices"][0]["text"], body["id"]


def test_every_request_answered_once_through_either_router(two: TwoRouters, colocated: LLM) -> None:
    prompts = [random_prompt(20 + 13 * i, seed=7100 + i) for i in range(16)]
    want = generate_texts(colocated, prompts, greedy(MAX_TOKENS))
    before = two.counters()

    async def run() -> list[tuple[str, str]]:
        async with httpx.AsyncClient(timeout=120) as http:
            # NOTE: router i % 2, streamed (i // 2) % 2: each router gets both kinds, all at once
            return list(await asyncio.gather(*(answer(http, two.routers[i % 2].url, p, stream=(i // 2) % 2 == 1)
                                               for i, p in enumerate(prompts))))

    replies = asyncio.run(run())
    assert [text for text, _ in replies] == want
    ids = [rid for _, rid in replies]
    assert len(set(ids)) == len(ids), ids
    after = two.counters()
    # exactly one hand-off per request: no job placed twice, none lost
    assert {k: after[k] - before[k] for k in after} == {"handed_off": len(prompts), "completed": len(prompts)}
    two.wait_until_free()


def test_models_and_errors_are_the_same_through_either_router(two: TwoRouters) -> None:
    too_long = GREEDY | {"prompt": random_prompt(1100, seed=7300)}  # past the routers' 1024-token window
    seen = []
    with httpx.Client(timeout=60) as http:
        for router in two.routers:
            models = http.get(f"{router.url}/v1/models").json()
            for card in models["data"]:
                card.pop("created")  # NOTE: the time of the call
            refused = http.post(f"{router.url}/v1/completions", json=too_long)
            seen.append((models, refused.status_code, refused.json()))
    assert seen[0] == seen[1]
    assert seen[0][1] == 400 and seen[0][2]["error"]["type"], seen[0]


async def abandon(http: httpx.AsyncClient, url: str, prompt: list[int], num_chunks: int) -> None:
    """Stream a long completion from `url` and hang up after `num_chunks` text chunks."""
    body = {"prompt": prompt, "max_tokens": _ABORT_MAX_TOKENS, "ignore_eos": True, "temperature": 0,
            "stream": True}
    async with http.stream("POST", f"{url}/v1/completions", json=body) as reply:
        assert reply.status_code == 200
        seen = 0
        async for line in reply.aiter_lines():
            if line.startswith("data: {"):
                assert "error" not in json.loads(line.removeprefix("data: ")), line
                seen += 1
                if seen == num_chunks:
                    return  # NOTE: leaving the block closes the connection mid-stream


def test_streams_dropped_on_both_routers_free_every_worker(two: TwoRouters, colocated: LLM) -> None:
    prompts = [random_prompt(30 + 7 * i, seed=7200 + i) for i in range(6)]
    # NOTE: what running to the end takes (one request alone: six at once take longer), measured here
    with httpx.Client(timeout=120) as http:
        start = time.monotonic()
        reply = http.post(f"{two.routers[0].url}/v1/completions",
                          json=GREEDY | {"prompt": prompts[0], "max_tokens": _ABORT_MAX_TOKENS})
        full_s = time.monotonic() - start
    assert reply.status_code == 200, reply.text
    two.wait_until_free()

    async def run() -> None:
        async with httpx.AsyncClient(timeout=120) as http:
            await asyncio.gather(*(abandon(http, two.routers[i % 2].url, p, 3) for i, p in enumerate(prompts)))

    asyncio.run(run())
    start = time.monotonic()
    two.wait_until_free()
    freed_s = time.monotonic() - start
    # freed by the aborts, not by running to the end
    assert freed_s < full_s / 2, (freed_s, full_s)
    # both routers still answer, with the colocated text
    want = generate_texts(colocated, prompts[1:2], greedy(MAX_TOKENS))[0]
    with httpx.Client(timeout=60) as http:
        for router in two.routers:
            reply = http.post(f"{router.url}/v1/completions", json=GREEDY | {"prompt": prompts[1]})
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["text"] == want
    two.wait_until_free()
