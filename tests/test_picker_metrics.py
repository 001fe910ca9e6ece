"""The router's series for an Inference Extension endpoint picker: what it counts as waiting and
how it pools its decode workers' KV usage (the live series on every role: test_metrics.py)."""

from __future__ import annotations

from prometheus_client.core import GaugeMetricFamily

from pdserve.disagg.router.metrics import _decode_cache_series, router_waiting
from pdserve.disagg.router.stats import Rejections, RouterEvents, RouterStats, WorkerLoad, WorkerView


def _view(role: str, ready: bool, waiting: int = 0, free: int = 0, blocks: int = 0) -> WorkerView:
    return WorkerView(role, f"http://{role}", ready, 0, False,  # type: ignore[arg-type]
                      WorkerLoad(0, waiting, free, blocks, block_size=16))


def _stats(backlog: int, pending: int) -> RouterStats:
    return RouterStats(0, 0, pending, backlog, "redis" if not pending else "memory", 0, "", Rejections(),
                       RouterEvents())


def _samples(families: list[GaugeMetricFamily]) -> dict[str, list[tuple[dict[str, str], float]]]:
    return {f.name: [(dict(s.labels), s.value) for s in f.samples] for f in families}


def test_waiting_counts_the_router_the_shared_queue_and_ready_prefill_workers() -> None:
    workers = [_view("prefill", True, waiting=3), _view("prefill", False, waiting=50), _view("decode", True, waiting=7)]
    # Redis: 4 jobs in the group's lag, 2 requests not yet sent on, 3 waiting in the ready prefill worker.
    assert router_waiting(2, _stats(backlog=4, pending=0), workers) == 2 + 4 + 3
    # Memory queue: its FIFO (5) is part of the requests not sent on (6) and is not counted twice.
    assert router_waiting(6, _stats(backlog=5, pending=5), workers) == 6 + 0 + 3


def test_kv_usage_pools_the_ready_decode_workers() -> None:
    workers = [_view("decode", True, free=10, blocks=40), _view("decode", True, free=30, blocks=40),
               _view("decode", False, free=0, blocks=1000), _view("prefill", True, free=0, blocks=100)]
    found = _samples(list(_decode_cache_series({"model_name": "m"}, workers)))
    assert found["vllm:kv_cache_usage_perc"] == [({"model_name": "m"}, (80 - 40) / 80)]
    assert found["vllm:gpu_cache_usage_perc"] == found["vllm:kv_cache_usage_perc"]
    assert found["vllm:cache_config_info"] == [({"model_name": "m", "block_size": "16", "num_gpu_blocks": "80"}, 1)]


def test_no_ready_decode_worker_reads_as_an_empty_cache() -> None:
    found = _samples(list(_decode_cache_series({}, [_view("decode", False, free=0, blocks=10)])))
    assert found["vllm:kv_cache_usage_perc"] == [({}, 0.0)]
    assert found["vllm:cache_config_info"] == [({"block_size": "0", "num_gpu_blocks": "0"}, 1)]
