"""Every phase before the first token has a bound: the decode reservation's lease, the prefill
side's explicit failure (or timeout) message, and the router's first-token deadline. Each test ends with no
block held on any worker."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import generate_texts, random_prompt
from pd_fixtures import start_cluster, stop_cluster

from pdserve import LLM
from pdserve.disagg.client import WorkerClient
from pdserve.disagg.control import HandOff, PrefillJob, WireSamplingParams
from pdserve.disagg.transport.errors import KVTransferError
from pdserve.disagg.transport.fake import FakeKVSender
from pdserve.disagg.worker.decode_service import DecodeService
from pdserve.disagg.worker.prefill_service import PrefillService
from pdserve.disagg.worker.queue_consumer import ConsumerOptions, RedisJobConsumer
from pdserve.engine.commands import GeneratorState
from pdserve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # every test starts a cluster

PROMPT = random_prompt(40, seed=7)
LONG_PROMPT = random_prompt(400, seed=8)  # several prefill steps of the clusters' 64-token budget


def test_a_hand_off_that_times_out_on_the_prefill_side_is_retried_at_once_not_at_the_lease(
        model_dirs: dict[str, Path], colocated: LLM) -> None:
    """The prefill worker computes the prompt but never sends a byte of it, and its hand-off then
    times out on its side. Nothing reached decode, so no transfer clock runs there: only the lease
    (long here) would end its wait. Prefill reports the attempt ended (Keepalive.ended): decode
    asks for a new attempt, which times out the same way, then prefills the request itself
    (failure policy `recompute`): the client gets the colocated answer in seconds."""
    cluster = start_cluster(model_dirs["tiny"], "fake", 1, 1, timeout_s=0.3, prefill_options={"stall_after_layers": 0},
                            worker_options={"reservation_lease_s": 600.0})
    try:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        [want] = generate_texts(colocated, [PROMPT], params)
        with httpx.Client(base_url=cluster.router.url, timeout=30) as http:
            start = time.monotonic()
            reply = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                                                       "ignore_eos": True})
            elapsed = time.monotonic() - start
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == want
        assert elapsed < 10.0, elapsed
        decode: DecodeService = cluster.service(DecodeService)
        stats = decode.stats()
        assert (stats.retried, stats.recomputed, stats.lease_expired) == (1, 1, 0), stats
        cluster.wait_until_idle()
        assert decode.num_in_flight == 0
        # counted where it was seen (and logged): both attempts timed out on the prefill side
        prefill = cluster.service(PrefillService).stats()
        assert (prefill.timed_out, prefill.failed) == (2, 2), prefill
    finally:
        stop_cluster(cluster)


def test_keepalives_extend_the_lease_of_a_reservation_nobody_streams(model_dirs: dict[str, Path]) -> None:
    """A reservation made straight on decode (a router that died before reading its stream): kept
    while a prefill worker says the attempt is being computed, freed a lease after that stops."""
    lease_s = 0.6
    cluster = start_cluster(model_dirs["tiny"], "fake", 1, 1, worker_options={"reservation_lease_s": lease_s})
    decode_url = cluster.workers[0][0].url
    decode: DecodeService = cluster.service(DecodeService)
    try:
        with httpx.Client(base_url=decode_url, timeout=30) as http:
            body = {"request_id": "orphan", "transfer_id": "orphan@0", "prompt_token_ids": PROMPT,
                    "params": {"fields": {"max_tokens": 4}}}
            assert http.post("/pd/reserve", json=body).status_code == 200
            for _ in range(8):  # 2.4 s, four leases: kept alive
                time.sleep(lease_s / 2)
                http.post("/pd/alive", json={"transfer_ids": ["orphan@0"]})
            assert decode.num_in_flight == 1 and cluster.leaks()
            assert decode.stats().lease_expired == 0
            # a failure report for another attempt of the request does not end it
            stale = http.post("/pd/fail/orphan", json={"reason": "x", "transfer_id": "orphan@1"})
            assert stale.status_code == 404 and decode.num_in_flight == 1
            for _ in range(2):  # the attempt ended, says its prefill worker, then its router: counted once
                assert http.post("/pd/alive", json={"transfer_ids": [], "ended": ["orphan@0"]}).status_code == 200
            stats = decode.stats()
            assert (stats.timeouts, stats.retried, stats.recomputed) == (1, 1, 0), stats
        cluster.wait_until_idle(timeout_s=lease_s + 3.0)
        assert decode.num_in_flight == 0 and decode.stats().lease_expired == 1
    finally:
        stop_cluster(cluster)


def _lose_the_kv_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    async def flush(self: FakeKVSender, request_id: str, timeout_s: float) -> None:
        raise KVTransferError(f"request {request_id}: connection to the decode worker lost")

    monkeypatch.setattr(FakeKVSender, "flush", flush)


def _fail_computing(monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE: prefill reads the generator state of seeded requests only (the test's requests are seeded)
    def apply(self: GeneratorState, engine: object) -> bytes | None:
        raise RuntimeError("the sampler's state cannot be read")  # an error computing this request only

    monkeypatch.setattr(GeneratorState, "apply", apply)


@pytest.mark.parametrize("failure", [_lose_the_kv_connection, _fail_computing],
                         ids=["kv-connection-lost", "compute-error"])
def test_a_prefill_side_failure_ends_the_request_at_once(model_dirs: dict[str, Path],
                                                         monkeypatch: pytest.MonkeyPatch, failure: object) -> None:
    """No byte of KV reached decode (so no transfer clock runs there) and the lease is long: only the
    prefill side's failure message can end the request in time."""
    assert callable(failure)
    failure(monkeypatch)
    # NOTE: the first token from decode only: one sent early from prefill would start the stream
    # (status 200) before the hand-off fails (that case: test_pd_first_token.py)
    cluster = start_cluster(model_dirs["tiny"], "fake", 1, 1, prefill_options={"stall_after_layers": 0},
                            worker_options={"reservation_lease_s": 600.0}, early_first_token=False)
    try:
        with httpx.Client(base_url=cluster.router.url, timeout=10) as http:
            start = time.monotonic()
            body = {"prompt": LONG_PROMPT, "max_tokens": 4, "seed": 7}
            reply = http.post("/v1/completions", json=body)
            elapsed = time.monotonic() - start
            streamed = http.post("/v1/completions", json=body | {"stream": True})
        assert reply.status_code == 503, reply.text
        assert "prefill failed" in reply.json()["error"]["message"]
        assert elapsed < 1.5, elapsed
        assert streamed.status_code == 503 and "prefill failed" in streamed.json()["error"]["message"]
        decode: DecodeService = cluster.service(DecodeService)
        assert decode.stats().failed == 2 and decode.stats().lease_expired == 0
        cluster.wait_until_idle()
    finally:
        stop_cluster(cluster)


class _RecordingWorkers(WorkerClient):
    def __init__(self) -> None:
        super().__init__(timeout_s=1.0)
        self.failed: list[tuple[str, str, str]] = []

    async def fail(self, url: str, request_id: str, reason: str, transfer_id: str = "") -> bool:
        self.failed.append((request_id, transfer_id, reason))
        return True


class _Unreachable:
    """A prefill service whose KV sender cannot connect to the job's decode worker."""

    secret = None  # no cluster secret: jobs are not checked

    def holds(self, transfer_id: str) -> bool:
        return False

    async def run(self, job: PrefillJob) -> HandOff:
        raise ConnectionRefusedError(f"cannot connect to {job.kv_address}")


def test_a_redis_consumer_that_cannot_reach_decode_says_so() -> None:
    """On the shared queue the consumer, not the router, learns that the hand-off could not start:
    it must end the request on decode (before, it only logged it and the request hung)."""
    async def scenario() -> None:
        workers = _RecordingWorkers()
        consumer = RedisJobConsumer(_Unreachable(), "redis://127.0.0.1:1/0", options=ConsumerOptions(token_budget=64))  # type: ignore[arg-type]
        await consumer._workers.close()
        consumer._workers = workers
        job = PrefillJob(request_id="r", transfer_id="r@1", decode_url="http://decode", prompt_token_ids=[1, 2, 3],
                         params=WireSamplingParams.of(SamplingParams(max_tokens=2)), kv_address="tcp://nowhere:1",
                         block_ids=[0], num_cached_tokens=0)
        try:
            await consumer._run(job)
        finally:
            await consumer.close()
        assert [(rid, tid) for rid, tid, _ in workers.failed] == [("r", "r@1")]
        assert "cannot connect" in workers.failed[0][2]

    asyncio.run(scenario())


def test_no_first_token_by_the_deadline_is_a_503_and_frees_everything(model_dirs: dict[str, Path]) -> None:
    """The prefill worker computes but never sends a byte, and keeps saying it is alive (its own
    timeout and decode's lease are long): only the router's first-token deadline ends the requests.
    The second one waits in the router's FIFO behind the first (the prefill worker has no room for
    it) until the first is aborted there."""
    deadline_s = 3.0
    # NOTE: the first token from decode only: prefill computes these prompts, and would send their
    # first tokens itself (test_pd_first_token.py)
    cluster = start_cluster(model_dirs["tiny"], "fake", 1, 1, timeout_s=60.0, prefill_options={"stall_after_layers": 0},
                            worker_options={"reservation_lease_s": 600.0}, first_token_timeout_s=deadline_s,
                            early_first_token=False)

    async def both() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=cluster.router.url, timeout=20) as http:
            first = asyncio.create_task(http.post("/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 4}))
            await asyncio.sleep(0.3)
            second = asyncio.create_task(
                http.post("/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 4, "stream": True}))
            waiting: dict = {}
            for _ in range(30):  # NOTE: polled, well within the first one's deadline: a loaded router answers late
                await asyncio.sleep(0.05)
                waiting = (await http.get("/router/stats")).json()
                if waiting["dispatch_pending"] == 1 and waiting["queued_requests"] == 2:
                    break
            assert waiting["dispatch_pending"] == 1 and waiting["queued_requests"] == 2, waiting
            return [await first, await second]

    try:
        start = time.monotonic()
        replies = asyncio.run(both())
        elapsed = time.monotonic() - start
        for reply in replies:
            assert reply.status_code == 503, reply.text
            assert "first-token deadline" in reply.json()["error"]["message"]
        assert deadline_s <= elapsed < deadline_s + 3.0, elapsed
        cluster.wait_until_idle()
        stats = httpx.get(f"{cluster.router.url}/router/stats").json()
        assert stats["counters"]["rejected_first_token_timeout"] == 2, stats
        assert stats["dispatch_pending"] == 0, stats
        prefill = cluster.service(PrefillService).stats()
        assert (prefill.handed_off, prefill.failed, prefill.aborted) == (0, 0, 2), prefill  # aborted where they ran
        metrics = httpx.get(f"{cluster.router.url}/metrics").text
        assert re.search(r'pdserve:router_rejections_total\{[^}]*reason="first_token_timeout"[^}]*\} 2\.0', metrics)
    finally:
        stop_cluster(cluster)


def test_a_slow_first_kv_handshake_does_not_time_the_first_request_out(
        model_dirs: dict[str, Path], colocated: LLM, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 32: the first placement to a decode worker connects its KV sender (the handshake),
    which took longer than the 100-ms transfer timeout at start-up on a loaded machine: the first
    request's hand-off timed out ("no decode reservation named within 0.1 s", a WARNING before up's
    banner) and was retried. The placement came in time: prefill waits for the connection."""
    cluster = start_cluster(model_dirs["tiny"], "tcp", 1, 1, timeout_s=0.1)
    prefill: PrefillService = cluster.service(PrefillService)
    senders = prefill.kv.senders  # type: ignore[attr-defined]  # NOTE: the in-process cluster's PrefillKV
    connect = senders.get

    def slow_connect(address: str) -> Any:
        time.sleep(0.5)  # NOTE: 5 transfer timeouts
        return connect(address)

    senders.get = slow_connect
    try:
        with caplog.at_level(logging.WARNING):
            reply = httpx.post(f"{cluster.router.url}/v1/completions", timeout=60,
                               json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert reply.status_code == 200, reply.text
        greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        assert reply.json()["choices"][0]["text"] == generate_texts(colocated, [PROMPT], greedy)[0]
        # NOTE: but the fixture's own (it runs without a cluster secret)
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING
                    and r.name != "pdserve.disagg.auth"]
        assert prefill.stats().failed == 0 and not warnings, warnings
        cluster.wait_until_idle()
    finally:
        stop_cluster(cluster)
