"""Scrape-time series of the KV tiers (`EngineStats.kv_tier`, present with --kv-disk-dir): the
pool's prefix hits and the disk tier's hits, misses, traffic, load latency and usage. Hits and
misses count blocks."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from pdserve.engine.disk_offload import TierStats
from pdserve.engine.kv_disk_tier import LOAD_LATENCY_BUCKETS_S


def kv_tier_series(stats: TierStats, labels: dict[str, str]) -> Iterator[Metric]:
    names, values = [*labels, "tier"], list(labels.values())
    disk = stats.disk

    def per_tier(family: CounterMetricFamily | GaugeMetricFamily,
                 **by_tier: float) -> CounterMetricFamily | GaugeMetricFamily:
        for tier, value in by_tier.items():
            family.add_metric([*values, tier], value)
        return family

    yield per_tier(CounterMetricFamily("pdserve:kv_tier_hits", "Prefix blocks served by each KV tier", labels=names),
                   pool=stats.num_pool_hit_blocks, disk=disk.num_hit_blocks)
    yield per_tier(CounterMetricFamily("pdserve:kv_tier_misses", "Lookups beyond the pool that found no usable "
                                       "block in the tier", labels=names), disk=disk.num_miss_blocks)
    yield per_tier(CounterMetricFamily("pdserve:kv_tier_read_bytes", "KV bytes loaded from the tier", labels=names),
                   disk=disk.bytes_read)
    yield per_tier(CounterMetricFamily("pdserve:kv_tier_written_bytes", "KV bytes written to the tier",
                                       labels=names), disk=disk.bytes_written)
    yield per_tier(CounterMetricFamily("pdserve:kv_tier_bad_files", "Torn, truncated, corrupt or foreign block "
                                       "files found (each a miss, removed)", labels=names), disk=disk.num_bad_files)
    yield per_tier(CounterMetricFamily("pdserve:kv_tier_dropped_writes", "Blocks not written: the write-behind "
                                       "buffer was full", labels=names), disk=disk.num_dropped_writes)
    yield per_tier(GaugeMetricFamily("pdserve:kv_tier_usage_bytes", "Bytes the tier holds", labels=names),
                   disk=disk.used_bytes)
    yield per_tier(GaugeMetricFamily("pdserve:kv_tier_capacity_bytes", "Most bytes the tier keeps", labels=names),
                   disk=disk.capacity_bytes)
    yield per_tier(GaugeMetricFamily("pdserve:kv_tier_enabled", "1 while the tier serves; 0 once it turned itself "
                                     "off (unwritable or full disk)", labels=names), disk=float(disk.enabled))
    latency = HistogramMetricFamily("pdserve:kv_tier_load_duration_seconds", "Time to read one request's blocks "
                                    "from the tier (s)", labels=names)
    cumulative, buckets = 0, []
    for bound, count in zip((*LOAD_LATENCY_BUCKETS_S, float("inf")), disk.load_latency_counts, strict=True):
        cumulative += count
        buckets.append((_bound(bound), cumulative))
    latency.add_metric([*values, "disk"], buckets, disk.load_latency_sum_s)
    yield latency


def _bound(value: float) -> str:
    return "+Inf" if value == float("inf") else repr(value)
