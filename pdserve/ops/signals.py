"""What the autoscaler reads from a router: one `Signals` reading of its GET /metrics.

    scrape(router_url, timeout_s)     GET /metrics -> Signals; None when the router does not answer
    parse_router_metrics(text, now)   the Prometheus text -> Signals

Latencies come as cumulative histogram snapshots (`HistogramSnapshot`), so a latency over a window
is computed from two snapshots, the way Prometheus computes `histogram_quantile(q,
rate(x_bucket[w]))` (`quantile`) and `rate(x_sum[w]) / rate(x_count[w])` (`mean`). A window in
which nothing was observed has no value (None), never 0: "no request finished" is not "latency 0".
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

logger = logging.getLogger(__name__)

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, ...] = ("prefill", "decode")

# The router's series (disagg/router/metrics.py, serving/metrics.py).
QUEUE_DEPTH = "pdserve:prefill_queue_depth"
DISPATCH_PENDING = "pdserve:router_dispatch_pending"  # the part of QUEUE_DEPTH in the router's own FIFO
DECODE_RUNNING = "pdserve:decode_running"
WORKERS_READY = "pdserve:workers_ready"
QUEUE_LATENCY = "pdserve:prefill_queue_latency_seconds"
TPOT = "pdserve:request_time_per_output_token_seconds"


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    """A cumulative histogram at one instant, as Prometheus exposes it (summed over label sets)."""

    buckets: dict[float, float]  # upper bound (`le`, +Inf included) -> observations <= it since the start
    sum: float
    count: float

    @classmethod
    def empty(cls) -> HistogramSnapshot:
        return cls({math.inf: 0.0}, 0.0, 0.0)


@dataclass(frozen=True, slots=True)
class Signals:
    """One reading of the router, what the supervisor scrapes every ~1 s."""

    time: float  # monotonic seconds, when the reading was taken
    prefill_queue_depth: float  # prefill jobs not started by any prefill worker
    decode_running: float  # requests running on the ready decode workers, in total
    ready: dict[Role, int]  # ready workers per role in the router's pool
    queue_latency: HistogramSnapshot  # per request: arrival at the router -> prefill started
    tpot: HistogramSnapshot  # per finished request: time per output token as the router saw it


def _increase(older: HistogramSnapshot, newer: HistogramSnapshot) -> tuple[list[tuple[float, float]], float, float]:
    """(bound, cumulative increase) ascending, and the increase of sum and count, from `older` to
    `newer`. A count that went down means the router restarted: then `newer` is all there is."""
    if newer.count < older.count:
        older = HistogramSnapshot.empty()
    buckets = [(bound, newer.buckets[bound] - older.buckets.get(bound, 0.0)) for bound in sorted(newer.buckets)]
    return buckets, newer.sum - older.sum, newer.count - older.count


def quantile(older: HistogramSnapshot, newer: HistogramSnapshot, q: float) -> float | None:
    """The q-quantile (0 < q <= 1) of what was observed between two snapshots, as Prometheus'
    `histogram_quantile`: the bucket holding rank q * n, linear interpolation inside it (the first
    bucket starts at 0); a rank in the +Inf bucket gives the highest finite bound. None when
    nothing was observed in between."""
    if not 0 < q <= 1:
        raise ValueError(f"quantile must be in (0, 1], got {q}")
    buckets, _, _ = _increase(older, newer)
    total = buckets[-1][1]  # the +Inf bucket counts every observation
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for bound, cumulative in buckets:
        if cumulative >= rank:
            if math.isinf(bound):
                return lower
            # NOTE: below < rank <= cumulative here, so the bucket is not empty
            return lower + (bound - lower) * (rank - below) / (cumulative - below)
        lower, below = bound, cumulative
    return lower  # unreachable while the +Inf bucket holds every observation


def mean(older: HistogramSnapshot, newer: HistogramSnapshot) -> float | None:
    """The mean of what was observed between two snapshots; None when nothing was."""
    _, total, count = _increase(older, newer)
    return total / count if count > 0 else None


def parse_router_metrics(text: str, now: float) -> Signals:
    """A router's GET /metrics text as one reading taken at `now` (monotonic seconds). Raises
    ValueError when a series the autoscaler needs is missing (not a router, or an older one)."""
    samples = _Samples(text)
    ready = {role: int(sum(s.value for s in samples.named(WORKERS_READY) if s.labels.get("worker_role") == role))
             for role in ROLES}
    return Signals(time=now, prefill_queue_depth=samples.total(QUEUE_DEPTH),
                   decode_running=samples.total(DECODE_RUNNING), ready=ready,
                   queue_latency=samples.histogram(QUEUE_LATENCY), tpot=samples.histogram(TPOT))


class _Samples:
    """One scrape's samples by name, each series summed over its label sets."""

    def __init__(self, text: str) -> None:
        self._by_name: dict[str, list[Sample]] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                self._by_name.setdefault(sample.name, []).append(sample)

    @classmethod
    def from_samples(cls, other: _Samples, keep: Callable[[Sample], bool]) -> _Samples:
        """The samples of `other` that `keep` says yes to (one label set of a labelled series)."""
        kept = cls("")
        kept._by_name = {name: [s for s in samples if keep(s)] for name, samples in other._by_name.items()}
        return kept

    def named(self, name: str) -> list[Sample]:
        if name not in self._by_name:
            raise ValueError(f"the router's metrics have no {name}: is this a pdserve router, and a recent one?")
        return self._by_name[name]

    def total(self, name: str) -> float:
        return float(sum(s.value for s in self.named(name)))

    def histogram(self, name: str) -> HistogramSnapshot:
        buckets: dict[float, float] = {}
        for sample in self.named(f"{name}_bucket"):
            bound = float(sample.labels["le"])  # "+Inf" parses as inf
            buckets[bound] = buckets.get(bound, 0.0) + sample.value
        if math.inf not in buckets:
            raise ValueError(f"the router's {name} has no +Inf bucket")
        return HistogramSnapshot(buckets, self.total(f"{name}_sum"), self.total(f"{name}_count"))


def histograms_by_label(text: str, name: str, label: str) -> dict[str, HistogramSnapshot]:
    """Histogram `name` of a /metrics text, one snapshot per value of `label` (e.g. the TTFT
    phases of `pdserve:ttft_phase_seconds` by `phase`); {} when the series is absent."""
    samples = _Samples(text)
    try:
        values = {s.labels[label] for s in samples.named(f"{name}_count") if label in s.labels}
    except ValueError:
        return {}

    def labelled(value: str) -> Callable[[Sample], bool]:
        return lambda sample: sample.labels.get(label) == value

    return {value: _Samples.from_samples(samples, labelled(value)).histogram(name) for value in values}


def scrape(router_url: str, timeout_s: float = 1.0) -> Signals | None:
    """One reading of the router at `router_url`; None when it does not answer in `timeout_s` (or
    answers without the series: logged), so a caller polling it carries on."""
    try:
        reply = httpx.get(f"{router_url.rstrip('/')}/metrics", timeout=timeout_s)
        reply.raise_for_status()
    except httpx.HTTPError as exc:
        logger.debug("autoscale: the router at %s does not answer: %r", router_url, exc)
        return None
    try:
        return parse_router_metrics(reply.text, time.monotonic())
    except ValueError as exc:
        logger.warning("autoscale: cannot read the router at %s: %s", router_url, exc)
        return None
