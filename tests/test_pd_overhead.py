"""The PD path's fixed per-request costs (issue 19): nothing on a request's path builds an HTTP client
(its TLS context blocks the event loop for tens of milliseconds), a prefill job leaves the router in
the turn of the loop that queued it, a live KV connection is handed out without a thread hop, and
`python -m pdserve.bench.pd_overhead` measures it all."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import generate_texts, mark_ready, random_prompt
from pd_fixtures import StubPrefillClient, start_cluster, stop_cluster
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from pdserve.bench import pd_overhead
from pdserve.disagg.client import WorkerClient
from pdserve.disagg.config import RouterConfig
from pdserve.disagg.control import HandOff, OutputFrame, PrefillJob, ReserveReply, ReserveRequest, WireSamplingParams
from pdserve.disagg.router.core import PDRouter, ServedModel
from pdserve.disagg.router.memory_queue import MemoryPrefillQueue
from pdserve.disagg.router.pool import WorkerPool
from pdserve.disagg.worker import prefill_keepalives
from pdserve.disagg.worker.prefill_service import PrefillService
from pdserve.engine.async_llm import AsyncLLM
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.model.qwen3_config import Qwen3ModelConfig
from pdserve.serving import dashboard
from pdserve.tokenizer import load_tokenizer

PREFILL, DECODE = "http://prefill", "http://decode"


class _Counted:
    """Wraps a class; counts how many instances were made."""

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.made = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.made += 1
        return self.cls(*args, **kwargs)


def test_sequential_requests_take_no_avoidable_detour(model_dirs: dict[str, Path], colocated: LLM,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests after an idle spell (the prefill keepalive task ended in between) build no new
    client for the keepalives, nor does each dashboard poll; prefill asks its engine thread for a
    generator's state only for a seeded request; outputs stay the colocated engine's."""
    keepalive_clients = _Counted(WorkerClient)
    monkeypatch.setattr(prefill_keepalives, "WorkerClient", keepalive_clients)
    # NOTE: keepalives every 25 ms, so the keepalive task ends during each 100 ms pause below
    cluster = start_cluster(model_dirs["tiny"], "fake", 1, 1, timeout_s=0.05)
    try:
        assert keepalive_clients.made == 1  # the prefill service's own, made at start
        commands = _record_commands(cluster.service(PrefillService).client, monkeypatch)
        prompts = [random_prompt(24, seed=i) for i in range(3)]
        params = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)] * 2 + [
            SamplingParams(temperature=0.9, top_k=40, seed=77, max_tokens=4, ignore_eos=True)]
        with httpx.Client(base_url=cluster.router.url, timeout=60) as http:
            texts = []
            for prompt, p in zip(prompts, params, strict=True):
                reply = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "ignore_eos": True,
                                                           "temperature": p.temperature, "top_k": p.top_k,
                                                           "seed": p.seed})
                assert reply.status_code == 200, reply.text
                texts.append(reply.json()["choices"][0]["text"])
                time.sleep(0.1)
            scrape_clients = _Counted(httpx.AsyncClient)
            monkeypatch.setattr(dashboard.httpx, "AsyncClient", scrape_clients)
            for _ in range(2):
                assert http.get("/dashboard/data").status_code == 200
        assert keepalive_clients.made == 1
        assert scrape_clients.made <= 1  # the first poll may make the router's one
        assert commands.count("GeneratorState") == 1  # the seeded request's
        assert texts == [generate_texts(colocated, [prompt], p)[0] for prompt, p in zip(prompts, params, strict=True)]
        cluster.wait_until_idle()
    finally:
        stop_cluster(cluster)


def _record_commands(client: AsyncLLM, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the commands sent to `client`'s engine thread from now on."""
    names: list[str] = []
    send = client.send

    async def recorded(command: Any, sink: Any = None) -> Any:
        names.append(type(command).__name__)
        return await send(command, sink)

    monkeypatch.setattr(client, "send", recorded)
    return names


class _SlowPrefill(StubPrefillClient):
    """A prefill worker that holds every job until released."""

    def __init__(self) -> None:
        super().__init__(timeout_s=1.0)
        self.release = asyncio.Event()

    async def prefill_job(self, url: str, job: PrefillJob, on_first_token: Any = None) -> HandOff | None:
        await self.release.wait()
        return HandOff(transfer_id=job.transfer_id, status="handed_off")


def test_a_job_leaves_the_memory_queue_before_put_returns() -> None:
    """No wait for the queue's loop task: the push to a prefill worker with room starts in `put`."""

    async def scenario() -> None:
        workers = _SlowPrefill()
        pool = WorkerPool(workers, [PREFILL], [DECODE])
        for worker in pool.members("prefill") + pool.members("decode"):
            mark_ready(worker)
        queue = MemoryPrefillQueue(pool, workers)
        job = PrefillJob(request_id="a", transfer_id="a@0", decode_url=DECODE, prompt_token_ids=[1, 2, 3],
                         params=WireSamplingParams.of(SamplingParams(max_tokens=2)), kv_address="a:1",
                         block_ids=[0], num_cached_tokens=0)
        try:
            ticket = await queue.put(job)
            # NOTE: no await between put and these checks: the loop task has not run
            assert queue.stats().num_pending == 0
            assert pool.members("prefill")[0].in_flight == 1
            assert ticket.trace.left_router_time is not None
            workers.release.set()
        finally:
            await queue.close()
            await workers.close()

    asyncio.run(scenario())


class _Recording(_SlowPrefill):
    """One decode and one prefill worker that note which call reached them first."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.release.set()
        self.placed = asyncio.Event()

    async def reserve(self, url: str, request: ReserveRequest) -> ReserveReply | None:
        self.calls.append("reserve")
        return ReserveReply(block_ids=[0], num_cached_tokens=0, kv_address="a:1", token="t")

    async def place(self, url: str, placement: Any) -> bool:
        self.calls.append("place")
        self.placed.set()
        return True

    async def prefill(self, url: str, job: PrefillJob, on_first_token: Any = None,
                      on_accepted: Any = None) -> HandOff | None:
        self.calls.append("prefill")
        if on_accepted is not None:
            on_accepted()
        if not job.placed:  # NOTE: as a prefill worker: no hand-off before the job is placed
            await self.placed.wait()
        return await super().prefill(url, job)

    async def stream(self, url: str, request_id: str) -> AsyncGenerator[OutputFrame, None]:
        self.calls.append("stream")
        yield OutputFrame(text="x", token_ids=[7], finish_reason="length")


def test_the_router_sends_the_prefill_job_before_it_reserves_and_opens_the_stream(
        model_dirs: dict[str, Path]) -> None:
    """The job is on the first token's path: it goes out before the reservation is made (and is
    placed once it is); the stream from decode is only needed once the first token is out."""

    async def scenario() -> None:
        workers = _Recording()
        pool = WorkerPool(workers, [PREFILL], [DECODE])
        for worker in pool.members("prefill") + pool.members("decode"):
            mark_ready(worker)
        model_dir = model_dirs["tiny"]
        router = PDRouter(RouterConfig(prefill=(PREFILL,), decode=(DECODE,)),
                          ServedModel(load_tokenizer(str(model_dir)), Qwen3ModelConfig.from_dir(model_dir),
                                      str(model_dir), 1024),
                          pool=pool,
                          queue=MemoryPrefillQueue(pool, workers), client=workers)
        try:
            outputs = [o async for o in router.generate("r", [1, 2, 3, 4], SamplingParams(max_tokens=1))]
            assert outputs[-1].finished and outputs[-1].outputs[0].token_ids == [7]
            assert workers.calls == ["prefill", "reserve", "place", "stream"]
        finally:
            await router.close()

    asyncio.run(scenario())


# -- the benchmark ---------------------------------------------------------------------------------

def _phase_metrics(observations: dict[str, list[float]]) -> str:
    registry = CollectorRegistry()
    hist = Histogram("pdserve:ttft_phase_seconds", "phases", ["phase"], registry=registry)
    for phase, values in observations.items():
        for value in values:
            hist.labels(phase=phase).observe(value)
    return generate_latest(registry).decode()


def test_phase_means_cover_only_the_requests_between_two_scrapes() -> None:
    before = _phase_metrics({"transfer": [1.0], "router_queue": [0.5]})
    after = _phase_metrics({"transfer": [1.0, 0.002, 0.004], "router_queue": [0.5, 0.001, 0.001],
                            "prefill_compute": [0.010]})
    means = pd_overhead.phase_means(before, after)
    assert means == pytest.approx({"transfer": 0.003, "router_queue": 0.001, "prefill_compute": 0.010})
    assert pd_overhead.phase_means("", "") == {}  # a colocated server has no phases


def test_rows_parse_and_the_table_compares_each_row_with_colocated() -> None:
    cached, fresh = pd_overhead.RowSpec.parse("2000+20"), pd_overhead.RowSpec.parse("4")
    assert (cached.prefix_len, cached.tail_len, str(cached)) == (2000, 20, "2000+20")
    assert (fresh.prefix_len, fresh.tail_len, str(fresh)) == (0, 4, "4")
    prompts = cached.prompts(3, seed=1)
    assert [len(p) for p in prompts] == [2020] * 3 and prompts[0][:2000] == prompts[2][:2000]
    assert prompts[0][2000:] != prompts[1][2000:]  # each tail is new: no full prefix hit
    rows = [pd_overhead.Row("colocated", fresh, (0.010, 0.012, 0.011), {}),
            pd_overhead.Row("pd-tcp", fresh, (0.020, 0.016, 0.030), {"transfer": 0.004})]
    headers, lines = pd_overhead.table(rows)
    assert lines[1][:6] == ["pd-tcp", "4", "20.0", f"{pd_overhead.percentile([20, 16, 30], 99):.1f}", "30.0", "+9.0"]
    assert lines[1][headers.index("transfer ms")] == "4.0" and lines[1][headers.index("router_queue ms")] == "-"


def test_the_engine_row_times_the_first_token_in_process(model_dirs: dict[str, Path]) -> None:
    rows = pd_overhead.measure_engine(str(model_dirs["tiny"]), 1, [pd_overhead.RowSpec(0, 4)], 2, 1, seed=0)
    assert len(rows) == 1 and len(rows[0].ttfts_s) == 2
    assert all(0 < t < 60 and math.isfinite(t) for t in rows[0].ttfts_s)


@pytest.mark.slow
def test_the_benchmark_runs_pd_over_tcp_with_its_phases(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Two requests through a real `pdserve up` (processes): TTFTs, and the router's phases."""
    ns = pd_overhead.parse_args(["--model", str(model_dirs["tiny"]), "--prompt-lens", "4", "--systems", "pd-tcp",
                                 "--requests", "2", "--warmup", "1", "--log-dir", str(tmp_path)])
    [row] = pd_overhead.run(ns)
    assert row.system == "pd-tcp" and len(row.ttfts_s) == 2
    assert set(row.phases_s) == set(pd_overhead.PHASES)
    assert sum(row.phases_s.values()) <= max(row.ttfts_s)  # the phases split the router's TTFT
