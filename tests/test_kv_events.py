"""KV-cache events (`--kv-events-config`): the records the block pool and KV cache manager make, the
engine's hooks on a real model, and vLLM's wire format over ZMQ, read by a consumer written here from
vLLM's published struct definitions (not from pdserve's encoder), replay included."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq
from helpers import assert_kv_clean, greedy, make_request, random_prompt

from pdserve import LLM
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.kv_cache_manager import KVCacheManager, hash_block
from pdserve.engine.kv_event_publisher import KVEventPublisher, ZmqPublisher, binds
from pdserve.engine.kv_event_wire import KVEventWireError, decode_batch, encode_batch
from pdserve.engine.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
    KVEventLog,
    KVEventsConfig,
    external_block_hash,
)
from pdserve.engine.llm import TokensPrompt

# -- a consumer written from vLLM's definitions (vllm/distributed/kv_events.py) ---------------------
# class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True): ts: float; events: list;
#     data_parallel_rank: int | None = None
# class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, tag=True)
# class BlockStored(KVCacheEvent): block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name
# class BlockRemoved(KVCacheEvent): block_hashes, medium
# class AllBlocksCleared(KVCacheEvent)
# ZmqEventPublisher: send_multipart((topic, seq.to_bytes(8, "big"), payload)); replay ROUTER answers
# (identity, b"", seq, payload) per buffered batch from the requested seq, then (identity, b"", -1, b"").
VLLM_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def vllm_decode(payload: bytes) -> tuple[float, list[dict[str, Any]], int | None]:
    """(ts, events as {"type": tag, field: value}, data_parallel_rank), exactly as vLLM lays them out."""
    batch = msgpack.unpackb(payload, raw=False)
    assert isinstance(batch, list) and 2 <= len(batch) <= 3, batch
    ts, events = batch[0], batch[1]
    assert isinstance(ts, float)
    decoded = []
    for event in events:
        tag, *values = event
        names = VLLM_FIELDS[tag]
        assert len(values) == len(names), f"{tag}: {values} for {names}"
        decoded.append({"type": tag, **dict(zip(names, values, strict=True))})
    return ts, decoded, batch[2] if len(batch) == 3 else None


def chain(token_ids: list[int], block_size: int) -> list[int]:
    """Every full block's hash as an event carries it (the engine's chained digest, last 8 bytes)."""
    parent, hashes = b"", []
    for start in range(0, len(token_ids) // block_size * block_size, block_size):
        parent = hash_block(parent, token_ids[start:start + block_size])
        hashes.append(int.from_bytes(parent[-8:], "big"))
    return hashes


class Recording(KVEventPublisher):
    """The in-tree fake publisher: keeps every batch it is handed."""

    def __init__(self) -> None:
        self.batches: list[list[KVCacheEvent]] = []

    def publish(self, events: list[KVCacheEvent]) -> None:
        self.batches.append(list(events))

    def close(self) -> None:
        return

    def events(self) -> list[KVCacheEvent]:
        taken = [event for batch in self.batches for event in batch]
        self.batches.clear()
        return taken


# -- config ----------------------------------------------------------------------------------------
def test_config_is_vllms_json() -> None:
    config = KVEventsConfig.parse('{"enable_kv_cache_events": true, "topic": "kv@p@m", "replay_endpoint": '
                                  '"tcp://*:5558", "buffer_steps": 5, "hwm": 10, "max_queue_size": 3}')
    assert config.enabled and config.publisher_name == "zmq" and config.endpoint == "tcp://*:5557"
    assert (config.topic, config.replay_endpoint, config.buffer_steps) == ("kv@p@m", "tcp://*:5558", 5)
    assert KVEventsConfig.parse('{"enable_kv_cache_events": false}').publisher_name == "null"
    assert KVEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "null"}').publisher_name == "null"
    for bad, why in [("[1]", "JSON object"), ("{", "not JSON"), ('{"enable": true}', "unknown key"),
                     ('{"publisher": "kafka"}', "publisher"), ('{"endpoint": "http://x"}', "endpoint"),
                     ('{"buffer_steps": 0}', ">= 1"), ('{"hwm": "x"}', "integers")]:
        with pytest.raises(ValueError, match=why):
            KVEventsConfig.parse(bad)
    assert binds("tcp://*:5557") and binds("ipc:///tmp/x") and not binds("tcp://10.0.0.1:5557")


# -- records: the block pool and the KV cache manager -----------------------------------------------
def test_log_splits_stored_blocks_into_chained_runs() -> None:
    digests = [hash_block(b"", [n]) for n in range(5)]
    log = KVEventLog(block_size=2)
    log.stored(digests, list(range(10)), [0, 1, 3, 4], lora_name=None)
    first, second = log.take()
    h = [external_block_hash(d) for d in digests]
    assert first == BlockStored((h[0], h[1]), None, (0, 1, 2, 3), 2)
    assert second == BlockStored((h[3], h[4]), h[2], (6, 7, 8, 9), 2)
    assert not log.take()


def test_manager_records_each_full_block_once_and_evictions() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_caching=True)
    log = kv.pool.events = KVEventLog(4)
    request = make_request("a", list(range(10)), max_tokens=1)
    assert kv.allocate(request, 10)
    request.num_computed_tokens = 10
    kv.cache_computed_blocks(request)
    kv.cache_computed_blocks(request)  # nothing new
    hashes = chain(list(range(10)), 4)
    assert log.take() == [BlockStored(tuple(hashes), None, tuple(range(8)), 4)]
    kv.free(request)
    other = make_request("b", list(range(100, 116)), max_tokens=1)
    assert kv.allocate(other, 16)  # the whole pool: both cached blocks are evicted
    removed = log.take()
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(hashes)  # type: ignore[union-attr]
    assert all(isinstance(e, BlockRemoved) for e in removed)
    kv.free(other)
    assert_kv_clean(kv)


def test_duplicate_content_is_not_stored_twice() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True)
    log = kv.pool.events = KVEventLog(4)
    a, b = make_request("a", list(range(8)), max_tokens=1), make_request("b", list(range(8)), max_tokens=1)
    for request in (a, b):  # both computed without sharing (as two prefills in one step)
        assert kv.allocate(request, 8)
        request.num_computed_tokens = 8
    kv.cache_computed_blocks(a)
    kv.cache_computed_blocks(b)
    assert len(log.take()) == 1
    kv.free(a)
    kv.free(b)


def test_reset_prefix_cache_clears_all() -> None:
    pool = BlockPool(4, enable_caching=True)
    log = pool.events = KVEventLog(1)
    blocks = pool.allocate(2)
    pool.cache_block(blocks[0], b"x" * 16)
    pool.cache_block(blocks[1], b"y" * 16)
    pool.free(blocks[1:])
    pool.reset_prefix_cache()  # block 0 still in use: only block 1 left
    assert log.take() == [BlockRemoved((external_block_hash(b"y" * 16),))]
    pool.free(blocks[:1])
    pool.reset_prefix_cache()
    assert log.take() == [BlockRemoved((external_block_hash(b"x" * 16),)), AllBlocksCleared()]


# -- the engine's hooks on the tiny model ----------------------------------------------------------
@pytest.fixture
def recorded(model_dirs: dict[str, Any]) -> Iterator[tuple[LLM, Recording]]:
    """An engine with events on ("null" publisher swapped for the recording fake) and a 12-block pool."""
    llm = LLM(model=str(model_dirs["tiny"]), dtype="float32", num_kv_blocks=12, block_size=16,
              kv_events_config='{"enable_kv_cache_events": true, "publisher": "null"}')
    recording = Recording()
    llm.engine.kv_event_publisher = recording
    yield llm, recording
    llm.engine.close()


def test_engine_stores_every_full_prompt_block_and_removes_evicted(recorded: tuple[LLM, Recording]) -> None:
    llm, recording = recorded
    first = random_prompt(70, seed=1)  # 4 full blocks + 6 tokens; 70 + 5 generated stay under 5 blocks
    llm.generate([TokensPrompt(prompt_token_ids=first)], greedy(5))
    stored = recording.events()
    assert all(isinstance(e, BlockStored) for e in stored)
    assert [h for e in stored for h in e.block_hashes] == chain(first, 16)  # type: ignore[union-attr]
    assert [t for e in stored for t in e.token_ids] == first[:64]  # type: ignore[union-attr]
    assert stored[0].parent_block_hash is None  # type: ignore[union-attr]
    # a second prompt needing the whole pool evicts every block of the first
    second = random_prompt(180, seed=2)
    llm.generate([TokensPrompt(prompt_token_ids=second)], greedy(5))
    events = recording.events()
    removed = {h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes}
    assert removed == set(chain(first, 16))
    assert [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes] == chain(second, 16)
    llm.engine.scheduler.kv.pool.reset_prefix_cache()
    llm.engine.publish_kv_events()
    assert recording.events()[-1] == AllBlocksCleared()
    assert_kv_clean(llm.engine.scheduler.kv)


def test_events_off_records_nothing(colocated: LLM) -> None:
    assert colocated.engine.kv_events is None and colocated.engine.scheduler.kv.pool.events is None


# -- the wire: pdserve's encoder against vLLM's layout, ZMQ, replay ----------------------------------
def test_wire_layout_is_vllms() -> None:
    h = external_block_hash(hash_block(b"", [1, 2]))
    batch = KVEventBatch(12.5, (BlockStored((h,), None, (1, 2), 2), BlockRemoved((h,)), AllBlocksCleared()), 0)
    ts, events, rank = vllm_decode(encode_batch(batch))
    assert (ts, rank) == (12.5, 0)
    assert events == [
        {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": None, "token_ids": [1, 2],
         "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None},
        {"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU"},
        {"type": "AllBlocksCleared"},
    ]
    assert decode_batch(encode_batch(batch)) == batch
    # vLLM's older 5-field BlockStored and byte hashes decode too; garbage does not
    old = msgpack.packb([1.0, [["BlockStored", [b"\x00" * 8 + h.to_bytes(8, "big")], None, [1, 2], 2]]])
    assert decode_batch(old).events == (BlockStored((h,), None, (1, 2), 2, medium=None),)
    for bad in (b"\xc1", msgpack.packb({"ts": 1}), msgpack.packb([1.0, [["Nope"]]])):
        with pytest.raises(KVEventWireError):
            decode_batch(bad)


@pytest.fixture
def zmq_context() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.destroy(linger=0)


def subscribe(context: zmq.Context[Any], endpoint: str, topic: bytes = b"") -> zmq.Socket[Any]:
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(endpoint)
    time.sleep(0.3)  # NOTE: PUB drops what it sends before the subscription reached it
    return sub


def receive(sub: zmq.Socket[Any], count: int) -> list[tuple[bytes, int, bytes]]:
    messages = []
    for _ in range(count):
        assert sub.poll(5000), "no KV event message within 5 s"
        topic, seq, payload = sub.recv_multipart()
        messages.append((topic, int.from_bytes(seq, "big"), payload))
    return messages


def replay_from(context: zmq.Context[Any], endpoint: str, start: int) -> list[tuple[int, bytes]]:
    dealer = context.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])  # REQ's envelope: the ROUTER sees 3 frames
    answers = []
    while True:
        assert dealer.poll(5000), "no replay answer within 5 s"
        empty, seq, payload = dealer.recv_multipart()
        assert empty == b""
        if int.from_bytes(seq, "big", signed=True) == -1:
            assert payload == b""
            dealer.close(linger=0)
            return answers
        answers.append((int.from_bytes(seq, "big"), payload))


def test_zmq_publisher_sequence_topic_and_replay(zmq_context: zmq.Context[Any]) -> None:
    config = KVEventsConfig(True, "zmq", "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=2, topic="kv@w@m")
    publisher = ZmqPublisher(config)
    try:
        assert publisher.endpoints is not None and publisher.endpoints.replay is not None
        assert publisher.endpoints.publish is not None and publisher.endpoints.topic == "kv@w@m"
        sub = subscribe(zmq_context, publisher.endpoints.publish)
        for n in range(3):
            publisher.publish([BlockRemoved((n,))])
        messages = receive(sub, 3)
        assert [(topic, seq) for topic, seq, _ in messages] == [(b"kv@w@m", 0), (b"kv@w@m", 1), (b"kv@w@m", 2)]
        assert [vllm_decode(p)[1][0]["block_hashes"] for _, _, p in messages] == [[0], [1], [2]]
        # a consumer that missed seq 1 on asks for it: the buffer holds the last 2 batches
        assert [(seq, vllm_decode(p)[1]) for seq, p in replay_from(zmq_context, publisher.endpoints.replay, 1)] == [
            (1, [{"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}]),
            (2, [{"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU"}])]
        assert replay_from(zmq_context, publisher.endpoints.replay, 0) == [(1, messages[1][2]), (2, messages[2][2])]
        sub.close(linger=0)
    finally:
        publisher.close()


def test_zmq_publisher_cannot_bind_is_an_error() -> None:
    with pytest.raises(OSError, match="cannot open"):
        ZmqPublisher(KVEventsConfig(True, "zmq", "tcp://*:not-a-port"))


def test_engine_over_zmq_read_as_vllm(model_dirs: dict[str, Any], zmq_context: zmq.Context[Any]) -> None:
    """The tiny model's engine publishing over ZMQ: a consumer that knows only vLLM's format sees a
    BlockStored for each full prompt block (chained, with its tokens) and the evictions."""
    llm = LLM(model=str(model_dirs["tiny"]), dtype="float32", num_kv_blocks=12, block_size=16,
              kv_events_config='{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:*"}')
    try:
        publisher = llm.engine.kv_event_publisher
        assert publisher is not None and publisher.endpoints is not None and publisher.endpoints.publish
        sub = subscribe(zmq_context, publisher.endpoints.publish)
        prompts = [random_prompt(70, seed=3), random_prompt(180, seed=4)]
        for prompt in prompts:
            llm.generate([TokensPrompt(prompt_token_ids=prompt)], greedy(5))
        events = collect(sub)
        stored = [e for e in events if e["type"] == "BlockStored"]
        assert [h for e in stored for h in e["block_hashes"]] == chain(prompts[0], 16) + chain(prompts[1], 16)
        first_run = [e for e in stored if set(e["block_hashes"]) <= set(chain(prompts[0], 16))]
        assert first_run[0]["parent_block_hash"] is None and first_run[0]["token_ids"] == prompts[0][:16 * len(
            first_run[0]["block_hashes"])]
        for e in stored:  # each event's parent is the hash of the block before its first one
            if e["parent_block_hash"] is not None:
                whole = chain(prompts[0], 16) + chain(prompts[1], 16)
                assert whole[whole.index(e["block_hashes"][0]) - 1] == e["parent_block_hash"]
            assert e["block_size"] == 16 and len(e["token_ids"]) == 16 * len(e["block_hashes"])
        removed = {h for e in events if e["type"] == "BlockRemoved" for h in e["block_hashes"]}
        assert removed == set(chain(prompts[0], 16))
        sub.close(linger=0)
    finally:
        llm.engine.close()


def collect(sub: zmq.Socket[Any], quiet_s: float = 0.5) -> list[dict[str, Any]]:
    """Every event until the publisher has been quiet for `quiet_s`, in sequence order (no gap)."""
    events: list[dict[str, Any]] = []
    expected = 0
    while sub.poll(int(quiet_s * 1000)):
        _, seq, payload = sub.recv_multipart()
        assert int.from_bytes(seq, "big") == expected
        expected += 1
        events.extend(vllm_decode(payload)[1])
    assert expected > 0, "no KV events"
    return events

