"""Where an engine's plain stats and a server's request outputs become Prometheus metrics
(`GET /metrics`).

Every server (router, colocated, prefill, decode) gets its own `CollectorRegistry` (tests run
several servers in one process) and labels every series with `model_name` and `role`. Two kinds:

  - histograms and live counters, observed as requests produce outputs (`RequestObserver`): on
    workers from the engine thread's deliveries (`AsyncLLM.output_listener`), on a server in front
    of others from the outputs its client receives (the PD router: disagg/router/metrics.py), so
    its latencies are the client's;
  - gauges and running totals read at scrape time, from `EngineStats` (`_EngineCollector`) and
    from whatever else a server registers (a PD worker's service counters, the router's pool and
    queue: disagg/worker/metrics.py, disagg/router/metrics.py): nothing to keep in sync, and a
    scrape never touches the engine thread.

Names and units follow vLLM (`vllm:*`); disaggregation-specific series use `pdserve:*`.
docs/OBSERVABILITY.md lists them all; `deploy/observability/` queries them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.engine.async_llm import AsyncLLM
from pdserve.engine.core_client import EngineCoreClient
from pdserve.engine.llm_engine import EngineStats
from pdserve.engine.output import RequestOutput
from pdserve.serving.errors import DRAINING_HEADER
from pdserve.serving.hot_metrics import HotCounter, HotHistogram
from pdserve.serving.kv_tier_metrics import kv_tier_series
from pdserve.serving.trace import RequestTrace, TransferRecord

ServerRole = Literal["router", "colocated", "prefill", "decode"]

# vLLM's buckets (seconds), so dashboards built for vLLM read pdserve the same way.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BYTES_BUCKETS = tuple(float(4**k) for k in range(5, 18))  # 1 KiB .. 16 GiB
THROUGHPUT_BUCKETS = tuple(float(10**k) for k in range(5, 12))  # 100 kB/s .. 100 GB/s
# The router's autoscaling signals (pdserve/ops/autoscale.py): the default targets (queue latency P90
# 1.5 s, scale-in below half of it; TPOT P99 60 ms) are bucket bounds, so those decisions do not hang
# on interpolation inside a bucket.
QUEUE_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0,
                         120.0)
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)
TTFT_PHASES = ("router_queue", "prefill_queue", "prefill_compute", "transfer", "first_decode_step")
_RECENT = 512  # latencies kept for the live dashboard's percentiles
_MAX_TRACKED = 65536  # bound on per-request state (requests whose end was never observed)


class ServerMetrics:
    """The metric objects of one server; `registry` is what `GET /metrics` renders."""

    def __init__(self, model_name: str, role: ServerRole) -> None:
        self.model_name, self.role = model_name, role
        self.registry = CollectorRegistry()
        labels = ["model_name", "role"]
        self.labels = {"model_name": model_name, "role": role}

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry).labels(**self.labels)

        def count(name: str, doc: str) -> Any:
            return Counter(name, doc, labels, registry=self.registry).labels(**self.labels)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token (s)", TTFT_BUCKETS)
        # NOTE: the two series updated per streamed output: plain numbers (hot_metrics.py)
        self.itl = HotHistogram("vllm:inter_token_latency_seconds", "Time between successive outputs of a request (s)",
                                self.labels, ITL_BUCKETS)
        self.generation_tokens = HotCounter("vllm:generation_tokens", "Generated tokens", self.labels)
        self.registry.register(self.itl)
        self.registry.register(self.generation_tokens)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Arrival to last token of finished requests (s)",
                        REQUEST_BUCKETS)
        self.queue = hist("vllm:request_queue_time_seconds",
                          "Arrival to first scheduled (router: until the prefill job leaves the router) (s)",
                          QUEUE_BUCKETS)
        self.prompt_tokens = count("vllm:prompt_tokens", "Prompt tokens of requests that produced a first token")
        self.rejections = Counter("pdserve:rejections", "Error responses by HTTP status and reason",
                                  [*labels, "code", "reason"], registry=self.registry)
        if role in ("prefill", "colocated"):
            self.prefill_queue = hist("pdserve:prefill_queue_time_seconds",
                                      "Prefill: job arrival to first scheduled (s)", QUEUE_BUCKETS)
        if role in ("decode", "colocated"):
            self.tpot = hist("pdserve:decode_time_per_output_token_seconds",
                             "Decode: (last token - first token) / (tokens - 1) of finished requests (s)",
                             ITL_BUCKETS)
        if role == "decode":
            self.transfer_s = hist("pdserve:kv_transfer_duration_seconds",
                                   "KV hand-off: first payload received to the final message (s)", TRANSFER_BUCKETS)
            self.transfer_bytes = hist("pdserve:kv_transfer_size_bytes", "KV bytes received per hand-off",
                                       BYTES_BUCKETS)
            self.transfer_bytes_total = count("pdserve:kv_transfer_bytes", "KV bytes received")
            self.transfer_rate = hist("pdserve:kv_transfer_throughput_bytes_per_second",
                                      "Bytes / duration of each hand-off that moved any", THROUGHPUT_BUCKETS)
        if role == "router":
            self._add_router_histograms(hist)
        self.recent_ttft_s: deque[float] = deque(maxlen=_RECENT)
        self.recent_tpot_s: deque[float] = deque(maxlen=_RECENT)

    def _add_router_histograms(self, hist: Callable[[str, str, tuple[float, ...]], Any]) -> None:
        """The TTFT breakdown, and the latencies the autoscaler reads (pdserve/ops/signals.py)."""
        phases = Histogram("pdserve:ttft_phase_seconds",
                           "TTFT breakdown per request: router_queue, prefill_queue, prefill_compute, "
                           "transfer (rest: hand-off tail + hops), first_decode_step (0: the first token came "
                           "from prefill) (s)",
                           [*self.labels, "phase"], buckets=TTFT_BUCKETS, registry=self.registry)
        self.phases = {p: phases.labels(**self.labels, phase=p) for p in TTFT_PHASES}
        self.queue_latency = hist("pdserve:prefill_queue_latency_seconds",
                                  "Router: arrival to prefill start (the router_queue + prefill_queue phases) of "
                                  "requests handed off (s)", QUEUE_LATENCY_BUCKETS)
        self.request_tpot = hist("pdserve:request_time_per_output_token_seconds",
                                 "Router: (last token - first token) / (tokens - 1) of finished requests, as the "
                                 "client saw them (s)", TPOT_BUCKETS)

    def observe_transfer(self, record: TransferRecord) -> None:
        self.transfer_s.observe(record.duration_s)
        self.transfer_bytes.observe(record.num_bytes)
        self.transfer_bytes_total.inc(record.num_bytes)
        if record.num_bytes and record.duration_s > 0:
            self.transfer_rate.observe(record.num_bytes / record.duration_s)

    def observe_phases(self, trace: RequestTrace, ttft_s: float) -> None:
        if trace.left_router_time is None or trace.phases is None:
            return  # no KV hand-off (e.g. decode recomputed the prompt): no breakdown
        router_queue = trace.left_router_time - trace.arrival_time
        p = trace.phases
        rest = ttft_s - router_queue - p.prefill_queue_s - p.prefill_compute_s - p.first_decode_step_s
        for phase, value in zip(TTFT_PHASES, (router_queue, p.prefill_queue_s, p.prefill_compute_s, max(0.0, rest),
                                              p.first_decode_step_s), strict=True):
            self.phases[phase].observe(max(0.0, value))
        self.queue_latency.observe(max(0.0, router_queue) + max(0.0, p.prefill_queue_s))

    def render(self) -> bytes:
        return generate_latest(self.registry)


@dataclass(slots=True)
class _Progress:
    arrival_time: float
    num_tokens: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    trace: RequestTrace | None = None


class RequestObserver:
    """Turns a request's cumulative outputs into histogram observations and token counts.
    Single-threaded per instance (a worker's engine thread, or the router's event loop)."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self._requests: dict[str, _Progress] = {}

    @property
    def num_in_flight(self) -> int:
        return len(self._requests)

    def num_sent_on(self) -> int:
        """Router: requests sent on to the workers (the rest wait in the router)."""
        return sum(1 for p in list(self._requests.values()) if p.trace and p.trace.left_router_time is not None)

    def start(self, request_id: str, arrival_time: float, trace: RequestTrace | None = None) -> None:
        if len(self._requests) >= _MAX_TRACKED:
            self._requests.pop(next(iter(self._requests)))
        self._requests[request_id] = _Progress(arrival_time, trace=trace)

    def on_output(self, output: RequestOutput) -> None:
        progress = self._requests.get(output.request_id)
        if progress is None:
            if _aborted(output):
                return
            arrival = output.metrics.arrival_time if output.metrics is not None else time.monotonic()
            self.start(output.request_id, arrival)
            progress = self._requests[output.request_id]
        now = time.monotonic()
        seqs = output.outputs
        num_tokens = len(seqs[0].token_ids) if len(seqs) == 1 else sum(len(seq.token_ids) for seq in seqs)
        new = num_tokens - progress.num_tokens
        if new > 0:
            self._on_tokens(progress, output, new, now)
        if output.finished:
            self._on_finished(progress, output, now)
            del self._requests[output.request_id]

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def _on_tokens(self, progress: _Progress, output: RequestOutput, new: int, now: float) -> None:
        m = self.metrics
        if progress.first_token_time is None:
            first = output.metrics.first_token_time if output.metrics and output.metrics.first_token_time else now
            progress.first_token_time = first
            ttft = first - progress.arrival_time
            m.ttft.observe(ttft)
            m.recent_ttft_s.append(ttft)
            m.prompt_tokens.inc(len(output.prompt_token_ids))
            self._on_first_token(progress, output, ttft)
        else:
            m.itl.observe(now - (progress.last_token_time or now))
        progress.last_token_time = now
        progress.num_tokens += new
        m.generation_tokens.inc(new)

    def _on_first_token(self, progress: _Progress, output: RequestOutput, ttft: float) -> None:
        m = self.metrics
        if progress.trace is not None:  # router
            if progress.trace.left_router_time is not None:
                m.queue.observe(progress.trace.left_router_time - progress.arrival_time)
            m.observe_phases(progress.trace, ttft)
            return
        scheduled = output.metrics.first_scheduled_time if output.metrics is not None else None
        if scheduled is not None:
            m.queue.observe(scheduled - progress.arrival_time)
            if m.role in ("prefill", "colocated"):
                m.prefill_queue.observe(scheduled - progress.arrival_time)

    def _on_finished(self, progress: _Progress, output: RequestOutput, now: float) -> None:
        if _aborted(output) or progress.first_token_time is None:
            return
        m = self.metrics
        m.e2e.observe(now - progress.arrival_time)
        if progress.num_tokens > 1 and progress.last_token_time is not None:
            tpot = (progress.last_token_time - progress.first_token_time) / (progress.num_tokens - 1)
            m.recent_tpot_s.append(tpot)
            if m.role in ("decode", "colocated"):
                m.tpot.observe(tpot)
            elif m.role == "router":
                m.request_tpot.observe(tpot)


def _aborted(output: RequestOutput) -> bool:
    return any(seq.finish_reason == "abort" for seq in output.outputs)


@dataclass(frozen=True, slots=True)
class OneSample:
    """Scrape-time metric families of one sample each, carrying a server's constant labels."""

    labels: dict[str, str]

    def gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), value)
        return family

    def counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), value)
        return family


class _EngineCollector(Collector):
    """Scrape-time series from a worker's `EngineStats`."""

    def __init__(self, metrics: ServerMetrics, stats: Callable[[], EngineStats]) -> None:
        self.metrics, self.stats = metrics, stats

    def collect(self) -> Iterator[Metric]:
        series = OneSample(self.metrics.labels)
        stats = self.stats()
        yield from _engine_series(stats, series.gauge, series.counter)
        yield from cache_series(self.metrics.labels, stats.kv_cache_usage, stats.block_size, stats.num_kv_blocks)
        if stats.max_lora:
            yield lora_series(self.metrics.labels, stats.max_lora, stats.running_lora_adapters,
                              stats.waiting_lora_adapters)
        if stats.kv_tier is not None:
            yield from kv_tier_series(stats.kv_tier, self.metrics.labels)


def cache_series(labels: dict[str, str], usage: float, block_size: int,
                 num_blocks: int) -> Iterator[GaugeMetricFamily]:
    """The KV cache series an Inference Extension endpoint picker reads besides
    `vllm:kv_cache_usage_perc`: its older name and the cache's shape (vLLM's `cache_config_info`,
    a gauge of 1 whose labels carry the configuration)."""
    yield OneSample(labels).gauge("vllm:gpu_cache_usage_perc", "KV cache usage (vllm:kv_cache_usage_perc's older "
                                  "name)", usage)
    info = GaugeMetricFamily("vllm:cache_config_info", "Information of the KV cache configuration (always 1)",
                             labels=[*labels, "block_size", "num_gpu_blocks"])
    info.add_metric([*labels.values(), str(block_size), str(num_blocks)], 1)
    yield info


def lora_series(labels: dict[str, str], max_lora: int, running: Iterable[str],
                waiting: Iterable[str]) -> GaugeMetricFamily:
    """vLLM's `vllm:lora_requests_info`, which LoRA-affinity pickers (the Inference Extension's)
    read: the adapters of running and of waiting requests as comma-joined labels; its value is the
    time of the scrape (vLLM's: the time of its last update)."""
    info = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on LoRA requests",
                             labels=[*labels, "max_lora", "running_lora_adapters", "waiting_lora_adapters"])
    info.add_metric([*labels.values(), str(max_lora), ",".join(running), ",".join(waiting)], time.time())
    return info


def _engine_series(s: EngineStats, gauge: Callable[..., GaugeMetricFamily],
                   counter: Callable[..., CounterMetricFamily]) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    yield gauge("vllm:num_requests_running", "Requests in the running batch", s.num_running)
    yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled (prefill: the prefill queue)",
                s.num_waiting + s.num_swapped)
    yield gauge("vllm:kv_cache_usage_perc", "KV cache usage: fraction of blocks in use (1 = full)", s.kv_cache_usage)
    yield counter("vllm:num_preemptions", "Preemptions", s.num_preemptions)
    yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", s.num_prefix_query_tokens)
    yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", s.num_prefix_hit_tokens)
    yield gauge("pdserve:prefill_queue_size", "Requests waiting for prefill", s.num_waiting)
    yield gauge("pdserve:prefill_batch_requests", "Requests with a prefill chunk in the last step",
                s.num_batch_prefill_requests)
    yield gauge("pdserve:prefill_batch_tokens", "Prefill tokens in the last step", s.num_batch_prefill_tokens)
    yield counter("pdserve:prefill_tokens", "Prompt tokens computed (prefix hits and received KV excluded)",
                  s.num_prefill_tokens)
    yield gauge("pdserve:decode_active_requests", "Requests decoding (the running batch)", s.num_running)
    yield gauge("pdserve:decode_reserved_requests", "Decode: reservations waiting for their KV", s.num_remote_waiting)
    yield gauge("pdserve:kv_blocks_total", "KV blocks in the pool", s.num_kv_blocks)
    yield gauge("pdserve:kv_blocks_free", "Free KV blocks", s.num_free_kv_blocks)
    yield gauge("pdserve:kv_blocks_quarantined", "KV blocks kept from reuse after a cancelled nixl hand-off "
                "(a late WRITE may still land)", s.num_quarantined_kv_blocks)
    yield counter("pdserve:kv_block_evictions", "Cached KV blocks evicted from the prefix cache", s.num_evictions)
    yield counter("pdserve:no_available_block", "Events logged as `No available block` (preemption, refused "
                  "reservation)", s.num_no_available_block)
    yield counter("pdserve:cannot_allocate", "Requests refused as `Cannot allocate for request` (larger than the "
                  "pool)", s.num_cannot_allocate)
    yield counter("pdserve:kv_events_dropped_batches", "KV-cache event batches dropped because the publisher's "
                  "queue was full (--kv-events-config max_queue_size)", s.num_kv_events_dropped_batches)


_DRAINING = DRAINING_HEADER.encode()
_REASONS = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed", 409: "kv_layout_mismatch",
            413: "too_large", 429: "too_many_requests", 499: "client_closed", 500: "internal_error",
            502: "worker_failed", 503: "unavailable", 504: "timeout"}


def rejection_reason(path: str, status: int, draining: bool = False) -> str:
    """`draining`: the response carries DRAINING_HEADER (a worker that takes nothing new)."""
    if status == 503 and draining:
        return "draining"
    if status == 503 and path == "/pd/reserve":
        return "no_available_block"
    return _REASONS.get(status, "other")


class RejectionCounter:
    """ASGI middleware: counts every error response (status >= 400) by code and reason."""

    def __init__(self, app: Callable[..., Awaitable[None]], metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counting_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                status = int(message["status"])
                draining = any(name == _DRAINING for name, _ in message.get("headers", ()))
                self.metrics.rejections.labels(**self.metrics.labels, code=str(status),
                                               reason=rejection_reason(scope.get("path", ""), status, draining)).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


def install_metrics(app: FastAPI, metrics: ServerMetrics) -> None:
    """`GET /metrics` (whatever `metrics.registry` holds) and the rejection counter on `app`."""
    app.add_middleware(RejectionCounter, metrics=metrics)

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)


LocalEngine = AsyncLLM | EngineCoreClient  # an engine this server owns (on a thread, or in its own process)


def instrument_engine_app(app: FastAPI, engine: LocalEngine, model_name: str, role: ServerRole) -> ServerMetrics:
    """A colocated worker: observe the engine thread's (or engine process's) outputs, read its stats."""
    metrics = ServerMetrics(model_name, role)
    install_engine_metrics(app, engine, metrics)
    return metrics


def install_engine_metrics(app: FastAPI, engine: LocalEngine, metrics: ServerMetrics,
                           extra: Collector | None = None) -> None:
    """A worker whose `metrics` exist before its app (a PD worker's service reports transfers to
    them): observe the engine thread's outputs, read its stats at scrape time, and `extra`'s series
    (a PD worker's service counters: disagg/worker/metrics.py)."""
    engine.output_listener = RequestObserver(metrics).on_output
    metrics.registry.register(_EngineCollector(metrics, engine.stats))
    if extra is not None:
        metrics.registry.register(extra)
    install_metrics(app, metrics)

