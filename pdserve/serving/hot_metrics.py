"""The two series updated once per streamed output (`RequestObserver`: the tokens generated and the
inter-token latency), kept as plain numbers and written out at scrape time.

prometheus_client's `Counter.inc` and `Histogram.observe` take a lock per value (three a
histogram observation) and check their state on every call: ~2 µs an output on the router, a
few % of what relaying a token costs it. These hold the same values (a histogram's bucket is the
first bound >= the value, as prometheus_client's) and render the same series (`*_total`;
`*_bucket{le}`, `*_count`, `*_sum`), less the `*_created` timestamps.

One writer at a time (a worker's engine thread, or the router's event loop); a scrape may read
while it writes, so it can see a value counted in a bucket and not yet in the sum: the same
skew prometheus_client's separate locks allow.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString


class HotCounter(Collector):
    """A counter with one sample (the server's labels)."""

    def __init__(self, name: str, doc: str, labels: dict[str, str]) -> None:
        self.name, self.doc, self.labels = name, doc, labels
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.doc, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), self.value)
        yield family


class HotHistogram(Collector):
    """A histogram with one set of samples (the server's labels) over `buckets` (+Inf added)."""

    def __init__(self, name: str, doc: str, labels: dict[str, str], buckets: tuple[float, ...]) -> None:
        self.name, self.doc, self.labels = name, doc, labels
        self.bounds = [*sorted(buckets), math.inf]
        self.counts = [0] * len(self.bounds)  # per bucket, not cumulative
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def collect(self) -> Iterator[HistogramMetricFamily]:
        counts, total = list(self.counts), self.sum
        cumulative, buckets = 0, []
        for bound, count in zip(self.bounds, counts, strict=True):
            cumulative += count
            buckets.append((floatToGoString(bound), float(cumulative)))
        family = HistogramMetricFamily(self.name, self.doc, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), buckets, total)
        yield family
