"""A PD worker's service counters as Prometheus series: `ServiceCollector` reads `DecodeStats` /
`PrefillStats` (worker/stats.py) at scrape time. worker/app.py hands it to serving's
`install_engine_metrics`, beside the engine's own series (serving/metrics.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from pdserve.disagg.worker.stats import DecodeStats, ServiceStats
from pdserve.serving.metrics import OneSample


class ServiceCollector(Collector):
    """Scrape-time series of a decode or prefill service: its hand-offs, by outcome."""

    def __init__(self, labels: dict[str, str], stats: Callable[[], ServiceStats]) -> None:
        self.labels, self.stats = labels, stats

    def collect(self) -> Iterator[CounterMetricFamily]:
        stats, labels = self.stats(), self.labels
        counter = OneSample(labels).counter
        failures = CounterMetricFamily("pdserve:kv_transfer_failures", "KV hand-offs that failed, by reason",
                                       labels=[*labels, "reason"])
        if isinstance(stats, DecodeStats):
            yield from _decode_series(stats, counter)
            failures.add_metric([*labels.values(), "timeout"], stats.timeouts - stats.retried)
            failures.add_metric([*labels.values(), "rejected"], stats.rejected)
            failures.add_metric([*labels.values(), "lease_expired"], stats.lease_expired)
        else:
            yield counter("pdserve:kv_transfers_completed", "Hand-offs acknowledged by decode", stats.handed_off)
            yield counter("pdserve:kv_transfer_timeouts", "Hand-offs decode did not acknowledge in time (`KV "
                          "cache transfer timed out` lines on this prefill worker)", stats.timed_out)
            yield counter("pdserve:prefill_duplicate_deliveries", "Jobs of an attempt that ran or runs here, "
                          "delivered again (re-delivered or duplicated): not run twice", stats.duplicates)
            failures.add_metric([*labels.values(), "send"], stats.failed)
        yield failures


def _decode_series(stats: DecodeStats,
                   counter: Callable[[str, str, float], CounterMetricFamily]) -> Iterator[CounterMetricFamily]:
    yield counter("pdserve:kv_transfer_timeouts", "Timeout windows without progress (`KV cache transfer "
                  "timed out` lines)", stats.timeouts)
    yield counter("pdserve:kv_transfer_retries", "Hand-offs waited on once more after a timeout", stats.retried)
    yield counter("pdserve:kv_recomputations", "Prompts recomputed on decode after a failed hand-off",
                  stats.recomputed)
    yield counter("pdserve:kv_transfers_completed", "Hand-offs completed", stats.completed)
    yield counter("pdserve:kv_dtype_conversions", "Hand-offs whose KV arrived in another dtype or with other FP8 "
                  "scales (the prefill worker's --kv-cache-dtype) and was converted into this pool's",
                  stats.kv_dtype_conversions)
    yield counter("pdserve:decode_local_prefills", "Short uncached prompts decode prefilled itself (conditional "
                  "disaggregation)", stats.prefilled_locally)
