"""The router's KV-event index and the `kv-events` decode policy: prompts hashed as the engine hashes
them, subscriptions that follow real ZMQ publishers (late join and gaps filled by replay, a gap that
cannot be, a restart), and workers ordered by the prompt blocks they hold, then by load."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from helpers import mark_ready, random_prompt, until

from pdserve.disagg.router.kv_index import (
    EventSource,
    KVBlockIndex,
    KVEventSubscription,
    prompt_block_hashes,
    reachable_endpoint,
)
from pdserve.disagg.router.policy import KVEventsPolicy, make_decode_policy
from pdserve.disagg.router.pool import Worker
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.kv_event_publisher import ZmqPublisher
from pdserve.engine.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventLog,
    KVEventsConfig,
)

LOOPBACK = "tcp://127.0.0.1:*"


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(scenario())  # type: ignore[arg-type]


def publisher(replay: bool = True) -> ZmqPublisher:
    return ZmqPublisher(KVEventsConfig(True, "zmq", LOOPBACK, LOOPBACK if replay else None, topic="kv@w@m"))


def source(pub: ZmqPublisher) -> EventSource:
    assert pub.endpoints is not None and pub.endpoints.publish is not None
    return EventSource(pub.endpoints.publish, pub.endpoints.replay, pub.endpoints.topic)


def stored(hashes: list[int], block_size: int = 4) -> BlockStored:
    return BlockStored(tuple(hashes), None, tuple(range(block_size * len(hashes))), block_size)


def test_prompt_hashes_are_the_engines_and_leave_the_last_token_out() -> None:
    """What the engine's events say it stored for a prompt is what the router hashes that prompt to."""
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True)
    log = kv.pool.events = KVEventLog(4)
    from helpers import make_request

    request = make_request("r", list(range(16)), max_tokens=1)
    assert kv.allocate(request, 16)
    request.num_computed_tokens = 16
    kv.cache_computed_blocks(request)
    (event,) = log.take()
    assert isinstance(event, BlockStored)
    assert prompt_block_hashes(list(range(16)), 4) == list(event.block_hashes[:3])  # 4th holds the last token
    assert prompt_block_hashes(list(range(17)), 4) == list(event.block_hashes)
    assert prompt_block_hashes([1, 2, 3], 4) == []
    kv.free(request)


def test_reachable_endpoint() -> None:
    assert reachable_endpoint("tcp://0.0.0.0:5557", "http://10.0.0.7:8000") == "tcp://10.0.0.7:5557"
    assert reachable_endpoint("tcp://*:5557", "http://[fd00::1]:8000") == "tcp://[fd00::1]:5557"
    assert reachable_endpoint("tcp://10.1.1.1:5557", "http://10.0.0.7:8000") == "tcp://10.1.1.1:5557"
    assert reachable_endpoint("ipc:///tmp/kv", "http://h:1") == "ipc:///tmp/kv"


def test_index_follows_stored_removed_cleared() -> None:
    index = KVBlockIndex()
    index.apply(KVEventBatch(0.0, (stored([1, 2, 3]), BlockRemoved((2,)))))
    assert index.num_prefix_blocks([1, 2, 3]) == 1 and index.num_prefix_blocks([1]) == 1 and index.block_size == 4
    index.apply(KVEventBatch(0.0, (stored([2]), AllBlocksCleared(), stored([9]))))
    assert index.hashes == {9} and index.num_prefix_blocks([1]) == 0


def test_late_subscriber_replays_from_zero_and_fills_gaps() -> None:
    async def scenario() -> None:
        import zmq.asyncio

        pub, context = publisher(), zmq.asyncio.Context()
        try:
            for n in range(3):  # before anyone listens
                pub.publish([stored([n])])
            # NOTE: sent by the publisher's thread, later on a loaded machine: a subscription made before
            # it sent them would receive some live, not replayed
            await until(lambda: len(pub._buffer) == 3, "the first three batches sent")
            sub = KVEventSubscription(context, source(pub), "w")
            await asyncio.sleep(0.3)  # NOTE: the subscription reaches the PUB socket
            pub.publish([stored([3])])
            await until(lambda: sub.index.hashes == {0, 1, 2, 3}, "the replayed and live blocks")
            assert sub.stats.num_replayed == 3 and sub.stats.num_resets == 0
            await sub.close()
            # a gap in the live stream (batch 2 lost): filled from the worker's replay buffer. This
            # subscription's topic matches nothing, so only what the test hands it arrives live.
            quiet = KVEventSubscription(context, EventSource(source(pub).publish, source(pub).replay, "other"), "q")
            await quiet.receive(0, KVEventBatch(0.0, (stored([0]),)))
            await quiet.receive(3, KVEventBatch(0.0, (stored([3]),)))
            assert quiet.index.hashes == {0, 1, 2, 3} and quiet.stats.num_replayed == 2 and not quiet.stats.num_resets
            # the worker restarted: its sequence starts at 0 again, with an empty cache
            await quiet.receive(0, KVEventBatch(0.0, (stored([7]),)))
            assert quiet.index.hashes == {7} and quiet.stats.num_resets == 1
            sub = quiet
            await sub.close()
        finally:
            pub.close()
            context.destroy(linger=0)

    run(scenario)


def test_gap_without_replay_drops_the_index() -> None:
    async def scenario() -> None:
        import zmq.asyncio

        pub, context = publisher(replay=False), zmq.asyncio.Context()
        try:
            sub = KVEventSubscription(context, source(pub), "w")
            await sub.receive(0, KVEventBatch(0.0, (stored([1]),)))
            await sub.receive(3, KVEventBatch(0.0, (stored([4]),)))  # 1, 2 missed: what they removed is unknown
            assert sub.index.hashes == {4} and sub.stats.num_resets == 1
            await sub.receive(2, KVEventBatch(0.0, (stored([9]),)))  # older than what was applied: ignored
            assert sub.index.hashes == {4}
            await sub.close()
        finally:
            pub.close()
            context.destroy(linger=0)

    run(scenario)


def decode_worker(url: str, pub: ZmqPublisher | None, free_blocks: int, instance: str = "i1") -> Worker:
    worker = Worker(url, "decode")
    mark_ready(worker)
    assert worker.info is not None
    update: dict[str, object] = {"num_free_kv_blocks": free_blocks, "kv_layout": {"block_size": 4},
                                 "instance_id": instance}
    if pub is not None and pub.endpoints is not None:
        update |= {"kv_events_endpoint": pub.endpoints.publish.replace("127.0.0.1", "0.0.0.0"),  # type: ignore[union-attr]
                   "kv_events_replay_endpoint": pub.endpoints.replay, "kv_events_topic": pub.endpoints.topic}
    worker.info = worker.info.model_copy(update=update)
    return worker


def test_policy_prefers_the_worker_holding_the_prefix_then_load() -> None:
    async def scenario() -> None:
        pubs = [publisher(), publisher()]
        policy = make_decode_policy("kv-events", client=None)  # type: ignore[arg-type]
        assert isinstance(policy, KVEventsPolicy)
        try:
            # a has more room (least-loaded would pick it); c publishes no events
            a = decode_worker("http://127.0.0.1:1", pubs[0], free_blocks=60)
            b = decode_worker("http://127.0.0.1:2", pubs[1], free_blocks=10)
            c = decode_worker("http://127.0.0.1:3", None, free_blocks=50)
            policy.observe([a, b, c])
            prompt = random_prompt(33, seed=5)  # 8 blocks of 4 can hit
            hashes = prompt_block_hashes(prompt, 4)
            assert await policy.order([a, b, c], prompt) == [a, c, b]  # nothing cached anywhere: by load
            a.in_flight = 2  # ties: the fewest requests in flight from this router first (live, not polled)
            assert await policy.order([a, b, c], prompt) == [c, b, a]
            a.in_flight = 0
            await asyncio.sleep(0.3)
            pubs[1].publish([stored(hashes[:6])])
            pubs[0].publish([stored(hashes[:2])])
            await until(lambda: (index := policy.index(b.url)) is not None and len(index.hashes) == 6, "b's blocks")
            await until(lambda: (index := policy.index(a.url)) is not None and len(index.hashes) == 2, "a's blocks")
            assert await policy.order([a, b, c], prompt) == [b, a, c]
            assert await policy.order([a, c], prompt) == [a, c]
            # b evicts its blocks: a holds more now
            pubs[1].publish([BlockRemoved(tuple(hashes[:6]))])
            await until(lambda: not policy.index(b.url).hashes, "b's evictions")  # type: ignore[union-attr]
            assert await policy.order([a, b, c], prompt) == [a, c, b]
            # b restarts (a new instance): its index starts over; a worker no longer listed is dropped
            policy.observe([a, decode_worker(b.url, pubs[1], 10, instance="i2")])
            assert policy.index(b.url) is not None and not policy.index(b.url).hashes  # type: ignore[union-attr]
            assert policy.index(c.url) is None
            policy.observe([b])
            assert policy.index(a.url) is None
        finally:
            await policy.close()
            for pub in pubs:
                pub.close()

    run(scenario)


@pytest.mark.parametrize("name", ["least-loaded", "kv-events"])
def test_policy_names(name: str) -> None:
    async def scenario() -> None:
        policy = make_decode_policy(name, client=None)  # type: ignore[arg-type]
        await policy.close()

    run(scenario)
