"""The router's metrics: latencies as the client sees them (`ObservedClient` feeds serving's
`RequestObserver` from the outputs the client receives), scrape-time series of the router itself
(`RouterCollector`: requests waiting or sent on, the pool's readiness, admission queue, the
autoscaler's queue depth and decode concurrency, rejections and events, read from `RouterState`),
and its live dashboard over the pool (serving/dashboard.py). `instrument_router_app` puts them on
the router's app (through serving's `AppExtras`: router/app.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable, Iterator

from fastapi import FastAPI
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pdserve.disagg.router.stats import RouterState, RouterStats, WorkerLoad, WorkerView
from pdserve.engine.output import RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.serving.dashboard import PoolMember, install_dashboard
from pdserve.serving.engine_client import EngineClient
from pdserve.serving.metrics import (
    OneSample,
    RequestObserver,
    ServerMetrics,
    cache_series,
    install_metrics,
    lora_series,
)
from pdserve.serving.trace import start_trace
from pdserve.tokenizer import Tokenizer


class ObservedClient:
    """Router: the PD router seen through a `RequestObserver` (EngineClient by delegation)."""

    def __init__(self, inner: EngineClient, observer: RequestObserver) -> None:
        self.inner = inner
        self.observer = observer
        self.tokenizer: Tokenizer = inner.tokenizer
        self.max_model_len = inner.max_model_len
        self.vocab_size = inner.vocab_size
        self.model_path = inner.model_path

    @property
    def alive(self) -> bool:
        return self.inner.alive

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.inner.validate_request(prompt_token_ids, params)

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        trace = start_trace()
        self.observer.start(request_id, trace.arrival_time, trace)
        try:
            async for output in self.inner.generate(request_id, prompt_token_ids, params):
                self.observer.on_output(output)
                yield output
        finally:
            self.observer.forget(request_id)


class RouterCollector(Collector):
    """Scrape-time series of the router: its in-flight requests (`observer`) and `state`."""

    def __init__(self, metrics: ServerMetrics, observer: RequestObserver, state: RouterState) -> None:
        self.metrics, self.observer, self.state = metrics, observer, state

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        labels = self.metrics.labels
        gauge = OneSample(labels).gauge

        in_flight = self.observer.num_in_flight
        sent_on = self.observer.num_sent_on()
        workers = self.state.workers()
        stats = self.state.stats()
        yield gauge("vllm:num_requests_running", "Router: requests sent on to the workers, not finished",
                    sent_on)
        yield gauge("vllm:num_requests_waiting", "Router: requests waiting for prefill: in the router (admission, "
                    "its own FIFO) + in the shared queue + waiting in ready prefill workers",
                    router_waiting(in_flight - sent_on, stats, workers))
        yield from _decode_cache_series(labels, workers)
        yield from _lora_series(labels, workers)
        ready = GaugeMetricFamily("pdserve:workers_ready", "Workers in the router's pool that answer and are ready",
                                  labels=[*labels, "worker_role"])
        for role in ("prefill", "decode"):
            ready.add_metric([*labels.values(), role], sum(1 for w in workers if w.role == role and w.ready))
        yield ready
        yield gauge("pdserve:router_queued_requests", "Router: admitted requests whose first token is not out yet",
                    stats.queued_requests)
        yield gauge("pdserve:router_queued_tokens", "Router: prompt tokens of those requests", stats.queued_tokens)
        yield gauge("pdserve:router_dispatch_pending", "Router: prefill jobs in the router's own FIFO (memory queue)",
                    stats.dispatch_pending)
        yield from _autoscaling_series(stats, workers, gauge)
        yield from _counter_series(stats, labels)


def _ready_loads(workers: list[WorkerView], role: str) -> list[WorkerLoad]:
    return [w.load for w in workers if w.role == role and w.ready and w.load is not None]


def router_waiting(not_sent_on: int, stats: RouterStats, workers: list[WorkerView]) -> int:
    """The router's `vllm:num_requests_waiting`: requests that have not left it (its admission queue
    and its own FIFO, which is part of them), the shared queue's jobs no prefill worker has taken
    (Redis: the consumer group's lag; `queue_backlog` counts the router's FIFO too, taken out here)
    and the jobs waiting in ready prefill workers."""
    shared = max(0, stats.queue_backlog - stats.dispatch_pending)
    return not_sent_on + shared + sum(load.num_waiting for load in _ready_loads(workers, "prefill"))


def _decode_cache_series(labels: dict[str, str], workers: list[WorkerView]) -> Iterator[GaugeMetricFamily]:
    """The router's KV usage: the ready decode workers' pools taken as one (used blocks / blocks,
    0 with none), and their shape (block size, blocks summed) as `vllm:cache_config_info`."""
    loads = _ready_loads(workers, "decode")
    total = sum(load.num_kv_blocks for load in loads)
    usage = (total - sum(load.num_free_kv_blocks for load in loads)) / total if total else 0.0
    yield OneSample(labels).gauge("vllm:kv_cache_usage_perc", "Router: KV cache usage of its ready decode workers "
                                  "taken as one pool (used blocks / blocks; 1 = full)", usage)
    yield from cache_series(labels, usage, max((load.block_size for load in loads), default=0), total)


def _lora_series(labels: dict[str, str], workers: list[WorkerView]) -> Iterator[GaugeMetricFamily]:
    """The router's `vllm:lora_requests_info` (with LoRA workers): its ready workers' adapters taken
    together, those of running requests and those of waiting ones (each worker's own, as it says)."""
    loads = [w.load for w in workers if w.ready and w.load is not None and w.load.max_lora]
    if loads:
        running = sorted({name for load in loads for name in load.running_lora_adapters})
        waiting = sorted({name for load in loads for name in load.waiting_lora_adapters})
        yield lora_series(labels, max(load.max_lora for load in loads), running, waiting)


def _autoscaling_series(stats: RouterStats, workers: list[WorkerView],
                        gauge: Callable[[str, str, float], GaugeMetricFamily]) -> Iterator[GaugeMetricFamily]:
    """What the autoscaler (pdserve/ops/autoscale.py) reads besides the two latency histograms."""
    waiting = sum(w.load.num_waiting for w in workers if w.role == "prefill" and w.ready and w.load is not None)
    yield gauge("pdserve:prefill_queue_depth", "Router: prefill jobs no prefill worker has started: not taken yet "
                "(the router's FIFO, or the Redis consumer group's lag) + waiting in ready prefill workers. Over "
                "several routers: max of (this - router_dispatch_pending) + sum of router_dispatch_pending (each "
                "router's own FIFO on the memory queue; 0 on Redis, whose lag every router counts)",
                stats.queue_backlog + waiting)
    yield gauge("pdserve:decode_running", "Router: requests in the running batch of the ready decode workers",
                sum(w.load.num_running for w in workers if w.role == "decode" and w.ready and w.load is not None))


def _counter_series(stats: RouterStats, labels: dict[str, str]) -> Iterator[CounterMetricFamily]:
    rejections = CounterMetricFamily("pdserve:router_rejections", "Router: requests refused, by admission reason",
                                     labels=[*labels, "reason"])
    for reason, count in dataclasses.asdict(stats.rejections).items():  # one series per field
        rejections.add_metric([*labels.values(), reason], count)
    yield rejections
    events = CounterMetricFamily("pdserve:router_events", "Router: kv_retries (new prefill attempts after a stalled "
                                 "transfer), redispatched, resumed (on another decode worker), prefilled_on_decode",
                                 labels=[*labels, "event"])
    for event, count in dataclasses.asdict(stats.events).items():
        events.add_metric([*labels.values(), event], count)
    yield events
    recoveries = CounterMetricFamily("pdserve:kv_recoveries", "Router: requests resumed after a decode loss, by "
                                     "where the prompt's KV came from: prefill_cache (a prefill worker's pool or "
                                     "disk tier) or recompute", labels=[*labels, "source"])
    for source, count in dataclasses.asdict(stats.recoveries).items():
        recoveries.add_metric([*labels.values(), source], count)
    yield recoveries
    resets = CounterMetricFamily("pdserve:kv_events_index_resets", "Router: a worker's KV-event index dropped (it "
                                 "fills again from new events), by the role followed and reason: gap (batches missed "
                                 "and not replayed), restart, bad_batch, worker_changed",
                                 labels=[*labels, "worker_role", "reason"])
    for role, by_reason in stats.index_resets.items():
        for reason, count in dataclasses.asdict(by_reason).items():
            resets.add_metric([*labels.values(), role, reason], count)
    yield resets


def instrument_router_app(app: FastAPI, client: EngineClient, router: RouterState,
                          model_name: str) -> ObservedClient:
    """GET /metrics and the live dashboard of the router: latencies as the client sees them
    (`client`, the router as the handlers call it; the one to serve with is returned), the TTFT
    breakdown, the pool's readiness and the router's stats (`router`)."""
    metrics = ServerMetrics(model_name, "router")
    observer = RequestObserver(metrics)
    metrics.registry.register(RouterCollector(metrics, observer, router))
    install_metrics(app, metrics)
    install_dashboard(app, metrics, lambda: [PoolMember(w.role, w.url, w.ready) for w in router.workers()])
    return ObservedClient(client, observer)
