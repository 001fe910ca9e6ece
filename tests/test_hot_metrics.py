"""The per-output series kept as plain numbers (hot_metrics.py) render what prometheus_client's
Counter and Histogram render for the same values (their `_created` timestamps aside)."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Counter, Histogram

from pdserve.serving.hot_metrics import HotCounter, HotHistogram
from pdserve.serving.metrics import ITL_BUCKETS

LABELS = {"model_name": "m", "role": "router"}


def _samples(registry: CollectorRegistry) -> list[tuple[str, tuple[tuple[str, str], ...], float]]:
    return sorted((s.name, tuple(sorted(s.labels.items())), s.value) for family in registry.collect()
                  for s in family.samples if not s.name.endswith("_created"))


def test_hot_series_render_what_prometheus_client_renders() -> None:
    rng = random.Random(7)
    # NOTE: every bound itself (a value on a bound is in that bucket), around it, past the last, 0, < 0
    values = [*ITL_BUCKETS, *(b * 1.0001 for b in ITL_BUCKETS), *(b * 0.9999 for b in ITL_BUCKETS), 1e6, 0.0, -1.0,
              *(rng.expovariate(20.0) for _ in range(500))]
    reference, hot = CollectorRegistry(), CollectorRegistry()
    histogram = Histogram("x:latency_seconds", "doc", list(LABELS), buckets=ITL_BUCKETS,
                          registry=reference).labels(**LABELS)
    counter = Counter("x:tokens", "doc", list(LABELS), registry=reference).labels(**LABELS)
    hot_histogram = HotHistogram("x:latency_seconds", "doc", LABELS, ITL_BUCKETS)
    hot_counter = HotCounter("x:tokens", "doc", LABELS)
    hot.register(hot_histogram)
    hot.register(hot_counter)
    for number, value in enumerate(values):
        histogram.observe(value)
        hot_histogram.observe(value)
        counter.inc(number % 3)
        hot_counter.inc(number % 3)
    expected = _samples(reference)
    assert _samples(hot) == expected
    names = {name for name, _, _ in expected}
    assert names == {"x:latency_seconds_bucket", "x:latency_seconds_count", "x:latency_seconds_sum", "x:tokens_total"}
