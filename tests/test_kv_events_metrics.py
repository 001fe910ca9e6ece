"""What KV-cache events count for metrics: a worker's publisher counts the batches its full queue
dropped (`pdserve:kv_events_dropped_batches_total`), the router counts the times it dropped a
worker's index, by reason (`pdserve:kv_events_index_resets_total{worker_role, reason}`)."""

from __future__ import annotations

import asyncio
from dataclasses import MISSING, fields

from helpers import until
from prometheus_client import generate_latest
from test_kv_index import decode_worker, publisher, run, source, stored

from pdserve.disagg.router.kv_index import KVEventSubscription, KVEventsView, SubscriptionStats
from pdserve.disagg.router.metrics import _counter_series
from pdserve.disagg.router.stats import IndexResets, Recoveries, Rejections, RouterEvents, RouterStats
from pdserve.engine.engine_types import EngineStats
from pdserve.engine.kv_event_publisher import ZmqPublisher, dropped_batches
from pdserve.engine.kv_events import KVEventBatch, KVEventsConfig
from pdserve.serving.metrics import ServerMetrics, _EngineCollector


def test_a_full_publisher_queue_is_counted_and_exported() -> None:
    pub = ZmqPublisher(KVEventsConfig(True, "zmq", "tcp://127.0.0.1:*", max_queue_size=1))
    try:
        for n in range(5000):  # NOTE: far faster than the thread sends (it polls every 50 ms when idle)
            pub.publish([stored([n])])
        assert pub.num_dropped_batches > 0 and dropped_batches(pub) == pub.num_dropped_batches
    finally:
        pub.close()
    assert dropped_batches(None) == 0
    zeros = {f.name: 0 for f in fields(EngineStats) if f.default is MISSING}
    stats = EngineStats(**zeros, num_kv_events_dropped_batches=7)  # type: ignore[arg-type]
    metrics = ServerMetrics("m", "decode")
    metrics.registry.register(_EngineCollector(metrics, lambda: stats))
    text = generate_latest(metrics.registry).decode()
    assert 'pdserve:kv_events_dropped_batches_total{model_name="m",role="decode"} 7.0' in text


def test_index_resets_are_counted_by_reason_and_exported() -> None:
    async def scenario() -> None:
        import zmq.asyncio

        pub, context = publisher(replay=False), zmq.asyncio.Context()
        view = KVEventsView()
        try:
            shared = SubscriptionStats()
            sub = KVEventSubscription(context, source(pub), "w", shared)
            await sub.receive(0, KVEventBatch(0.0, (stored([1]),)))
            await sub.receive(3, KVEventBatch(0.0, (stored([4]),)))  # 1, 2 missed, no replay: a gap
            await sub.receive(0, KVEventBatch(0.0, (stored([5]),)))  # back at 0: a restart
            await sub.close()
            late = KVEventSubscription(context, source(pub), "late", shared)
            await late.receive(9, KVEventBatch(0.0, (stored([9]),)))  # a late joiner's missed start: no reset
            await late.close()
            assert dict(shared.resets) == {"gap": 1, "restart": 1} and shared.num_resets == 2
            # the view: a worker that comes back as another instance starts over
            worker = decode_worker("http://127.0.0.1:1", pub, free_blocks=8)
            view.observe([worker])
            view.observe([decode_worker(worker.url, pub, free_blocks=8, instance="i2")])
            await asyncio.sleep(0)
            await until(lambda: view.index(worker.url) is not None, "the new subscription")
            assert dict(view.stats.resets) == {"worker_changed": 1}
            stats = RouterStats(0, 0, 0, 0, "memory", 0, "", Rejections(), RouterEvents(), Recoveries(),
                                {"decode": IndexResets(**view.stats.resets), "prefill": IndexResets(gap=2)})
            families = {f.name: f for f in _counter_series(stats, {"model_name": "m"})}
            samples = {(s.labels["worker_role"], s.labels["reason"]): s.value
                       for s in families["pdserve:kv_events_index_resets"].samples}
            assert samples[("decode", "worker_changed")] == 1 and samples[("prefill", "gap")] == 2
            assert samples[("decode", "gap")] == 0 and len(samples) == 8
        finally:
            await view.close()
            pub.close()
            context.destroy(linger=0)

    run(scenario)
