"""`pdserve bench`'s client against the stub server (counts, cancellation, failure kinds), and one short
end-to-end `pdserve bench --url` against a real tiny colocated pdserve server."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_fixtures import free_port, start_server

from pdserve.bench.serve import workloads
from pdserve.bench.serve.client import LoadConfig, LoadResult, cancel_plans, run_load
from pdserve.bench.serve.metrics import summarize
from pdserve.bench.serve.stub import StubConfig, StubThread
from pdserve.cli import main


@pytest.fixture
def stub() -> Iterator[StubThread]:
    with StubThread() as server:
        yield server


def _run(work: workloads.Workload, url: str, **config: object) -> LoadResult:
    return asyncio.run(run_load(work, LoadConfig(url, progress=False, **config)))  # type: ignore[arg-type]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("stream", [True, False])
def test_every_request_completes_with_exact_counts(stub: StubThread, endpoint: str, stream: bool) -> None:
    work = workloads.random_lengths(30, 8, 6, range_ratio=0.5, seed=2)
    result = _run(work, stub.url, max_concurrency=4, endpoint=endpoint, stream=stream)
    assert result.model == "stub" and stub.server.num_requests == 30
    assert [r.index for r in result.records] == list(range(30))
    assert all(r.ok for r in result.records)
    assert [r.output_tokens for r in result.records] == [s.max_tokens for s in work.requests]  # from usage
    if stream:
        assert all(len(r.chunk_times_s) == r.output_tokens and r.ttft_s == r.chunk_times_s[0]
                   for r in result.records)
    else:
        assert all(r.ttft_s is None and not r.chunk_times_s for r in result.records)
    if endpoint == "completions":
        assert [r.prompt_tokens for r in result.records] == [s.prompt_len for s in work.requests]
    summary = summarize(result.records, result.duration_s)
    assert summary.completed == 30 and summary.max_concurrent_requests <= 4
    assert summary.total_output_tokens == sum(s.max_tokens for s in work.requests)


def test_cancel_rate_drops_the_planned_requests_mid_stream(stub: StubThread) -> None:
    work = workloads.random_lengths(40, 8, 10, seed=3)
    config = LoadConfig(stub.url, cancel_rate=0.5, seed=5, max_concurrency=8, progress=False)
    plans = cancel_plans(work, config)
    result = asyncio.run(run_load(work, config))
    cancelled = [r for r in result.records if r.cancelled]
    assert 10 <= len(cancelled) <= 30 and sum(r.ok for r in result.records) == 40 - len(cancelled)
    assert {r.index for r in cancelled} == {i for i, p in enumerate(plans) if p.after_chunks is not None}
    for record in cancelled:
        assert len(record.chunk_times_s) == plans[record.index].after_chunks and record.error_kind is None
    summary = summarize(result.records, result.duration_s)
    assert summary.cancelled == len(cancelled) and summary.failed == 0


def test_failures_are_counted_by_kind_and_never_stop_the_run() -> None:
    work = workloads.random_lengths(25, 8, 4, seed=4)
    with StubThread(StubConfig(("ok", "429", "500", "error_frame", "drop"))) as server:
        result = _run(work, server.url, max_concurrency=1)
    summary = summarize(result.records, result.duration_s)
    assert summary.completed == 5
    assert summary.failures == {"connection": 5, "error_frame": 5, "http_429": 5, "http_500": 5}
    assert "stub: 429" in next(r.error for r in result.records if r.error_kind == "http_429")


def test_timeouts_and_refused_connections_are_failures() -> None:
    work = workloads.random_lengths(2, 4, 2, seed=5)
    with socket.socket() as silent:  # accepts connections (backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        result = _run(work, f"http://127.0.0.1:{silent.getsockname()[1]}", model="m", timeout_s=0.3)
    assert [r.error_kind for r in result.records] == ["timeout", "timeout"]
    refused = _run(work, f"http://127.0.0.1:{free_port()}", model="m", timeout_s=5)
    assert [r.error_kind for r in refused.records] == ["connection", "connection"]


@pytest.mark.slow  # a real server and the bench command
def test_bench_command_against_a_real_pdserve_server(model_dirs: dict[str, Path], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    server = start_server(model_dirs["tiny"], "tiny", dtype="float32", num_kv_blocks=128, num_threads=1)
    try:
        save = tmp_path / "result.json"
        argv = ["bench", "--url", server.base_url, "--scale", "0.01", "--num-prompts", "10", "--max-concurrency",
                "3", "--slo", "ttft=60000,tpot=60000", "--save", str(save), "--plot", str(tmp_path), "--no-progress"]
        assert main(argv) == 0
        assert "Serving Benchmark Result" in capsys.readouterr().out
        doc = json.loads(save.read_text())
        work = workloads.seed_mix(10, scale=0.01)  # 5/20/50-token prompts, 5 output tokens
        assert doc["completed"] == 10 and doc["failed"] == 0 and doc["model_id"] == "tiny"
        assert doc["total_input_tokens"] == sum(s.prompt_len for s in work.requests)  # token ids: exact
        assert doc["total_output_tokens"] == 50 and doc["output_lens"] == [5] * 10  # ignore_eos + max_tokens
        assert doc["request_goodput"] == pytest.approx(doc["request_throughput"])
        for key in ("p99_ttft_ms", "median_tpot_ms", "output_throughput", "request_goodput", "mean_itl_ms",
                    "completed", "total_input_tokens", "mean_e2el_ms", "p90_tpot_ms", "max_concurrency"):
            assert isinstance(doc[key], (int, float)), key
        assert 0 < doc["p99_ttft_ms"] < doc["p99_e2el_ms"]
        assert (tmp_path / "latency_cdf.png").stat().st_size > 0
        server.wait_until_idle()
    finally:
        server.stop()


def test_sweep_concurrency_ladder_against_the_stub(stub: StubThread, tmp_path: Path) -> None:
    save = tmp_path / "sweep.json"
    argv = ["bench", "sweep", "--url", stub.url, "--workload", "random", "--input-len", "8", "--output-len", "4",
            "--num-prompts", "12", "--concurrencies", "1,4", "--no-progress", "--save", str(save), "--plot",
            str(tmp_path)]
    assert main(argv) == 0
    doc = json.loads(save.read_text())
    assert [(p["label"], p["completed"], p["max_concurrent_requests"]) for p in doc["points"]] == [
        ("1", 12, 1), ("4", 12, 4)]
    assert stub.server.num_requests == 24 and (tmp_path / "concurrency_sweep.png").stat().st_size > 0
