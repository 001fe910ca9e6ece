"""KV-cache events: what the prefix cache gained and lost, as vLLM reports it (`--kv-events-config`).

The block pool and the KV cache manager record plain records into a `KVEventLog` as blocks are
indexed (`BlockStored`), evicted (`BlockRemoved`) or the whole index is dropped
(`AllBlocksCleared`); the engine takes them once per step and hands them to its publisher
(engine/kv_event_publisher.py), which encodes and sends them on a thread of its own. Nothing is
recorded when events are off (the log is None), and the engine never waits on the network.

Block hashes. pdserve's prefix cache keys a full block by a chained digest
(kv_cache_manager.py `hash_block`): blake2b-128 over the parent block's digest (b"" for the first
block; a LoRA adapter's root for an adapter's prompt) followed by the block's token ids as signed
64-bit native-endian integers. Events carry vLLM's *external* form of a hash: the digest's last 8
bytes read as a big-endian unsigned integer (`external_block_hash`), which is what vLLM sends with
VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES (its default) and what llm-d's consumer makes of a byte hash.
A consumer that keys blocks by these values (pdserve's router does, hashing prompts the same way)
must hash with the same `--block-size`; llm-d's scorer re-hashes the token ids itself and only
needs the hashes to match between `BlockStored` and `BlockRemoved` (and its `blockSize` to be
this engine's `--block-size`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Literal

MEDIUM_GPU = "GPU"  # vLLM's name for the device pool, whatever the device (its CPU offload tier is "CPU")
_ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")


def external_block_hash(digest: bytes) -> int:
    """An event's hash of a block: the digest's last 8 bytes, big-endian (vLLM's int form)."""
    return int.from_bytes(digest[-8:], "big")


def lora_int_id(hash_root: bytes) -> int | None:
    """An event's `lora_id` for a request chained from `hash_root` (None: the base model's, b"").
    vLLM sends its LoRARequest's `lora_int_id`; pdserve names adapters only, so the id is derived
    from the adapter's root (name and weights' digest, lora_manager.py `hash_root`): its first 4
    bytes, big-endian, shifted to a positive 31-bit int. The same adapter gets the same id on every
    worker and across restarts; a reloaded adapter with other weights gets another."""
    if not hash_root:
        return None
    return int.from_bytes(hash_root[:4], "big") >> 1 or 1


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig, field for field, from the JSON `--kv-events-config` takes."""

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None  # None: zmq when enabled, else null (as vLLM)
    endpoint: str = "tcp://*:5557"  # with * (or ::, ipc://, inproc://) bound, else connected to; port 0: any
    replay_endpoint: str | None = None  # ROUTER socket serving missed batches by sequence number
    buffer_steps: int = 10_000  # batches (steps) kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark (messages)
    max_queue_size: int = 100_000  # batches waiting for the publisher thread; beyond, batches are dropped
    topic: str = ""  # first frame of every message (llm-d expects kv@<pod>@<model>)

    @classmethod
    def parse(cls, text: str) -> KVEventsConfig:
        """From `--kv-events-config`'s JSON object; ValueError naming what is wrong."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"kv_events_config is not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError("kv_events_config must be a JSON object")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(f"kv_events_config: unknown key(s) {', '.join(unknown)} (known: {', '.join(known)})")
        config = cls(**value)
        config.validate()
        return config

    @property
    def publisher_name(self) -> str:
        return self.publisher or ("zmq" if self.enable_kv_cache_events else "null")

    @property
    def enabled(self) -> bool:
        """Whether the engine records events at all (vLLM: events on, whatever the publisher)."""
        return self.enable_kv_cache_events

    def validate(self) -> None:
        ints = {"buffer_steps": self.buffer_steps, "hwm": self.hwm, "max_queue_size": self.max_queue_size}
        checks = [
            (isinstance(self.enable_kv_cache_events, bool), "enable_kv_cache_events must be true or false"),
            (self.publisher in (None, "null", "zmq"), f"publisher must be \"zmq\" or \"null\", got {self.publisher!r}"),
            (isinstance(self.endpoint, str) and self.endpoint.startswith(_ENDPOINT_SCHEMES),
             f"endpoint must be a ZMQ address (tcp://, ipc://, inproc://), got {self.endpoint!r}"),
            (self.replay_endpoint is None or (isinstance(self.replay_endpoint, str)
                                              and self.replay_endpoint.startswith(_ENDPOINT_SCHEMES)),
             f"replay_endpoint must be a ZMQ address, got {self.replay_endpoint!r}"),
            (all(isinstance(v, int) and not isinstance(v, bool) for v in ints.values()),
             "buffer_steps, hwm and max_queue_size must be integers"),
            (isinstance(self.topic, str), "topic must be a string"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"kv_events_config: {message}")
        if self.buffer_steps < 1 or self.hwm < 0 or self.max_queue_size < 1:
            raise ValueError("kv_events_config: buffer_steps and max_queue_size must be >= 1, hwm >= 0")


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Consecutive full blocks of one sequence were indexed: `block_hashes[i]`'s parent is
    `block_hashes[i - 1]`, the first one's `parent_block_hash` (None: the sequence's first block).
    `token_ids` are all of them, `block_size` each."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None  # vLLM's adapter int id (deprecated there); here `lora_int_id`
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None  # the adapter whose prompt this is (None: the base model)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """These blocks left the index (evicted for reuse)."""

    block_hashes: tuple[int, ...]
    medium: str | None = MEDIUM_GPU


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole index was dropped: forget every block of this engine."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    """One step's events (vLLM's KVEventBatch): `ts` is wall-clock seconds."""

    ts: float
    events: tuple[KVCacheEvent, ...]
    data_parallel_rank: int | None = 0


class KVEventLog:
    """Events recorded since the last `take`. The block pool and KV cache manager record (the
    engine's thread only); the engine takes them after each step."""

    __slots__ = ("_events", "block_size")

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._events: list[KVCacheEvent] = []

    def stored(self, block_hashes: Sequence[bytes], token_ids: Sequence[int], indices: Sequence[int],
               lora_name: str | None = None, lora_id: int | None = None) -> None:
        """Blocks `indices` (ascending) of a sequence whose chained digests are `block_hashes` were
        indexed now, under adapter `lora_name` (None: the base model; `lora_id`: `lora_int_id`). One
        event per run of consecutive indices: a block left out (its content was indexed already, by
        another block) breaks the chain an event describes."""
        bs = self.block_size
        start = 0
        for at in range(1, len(indices) + 1):
            if at < len(indices) and indices[at] == indices[at - 1] + 1:
                continue
            first, last = indices[start], indices[at - 1]
            parent = None if first == 0 else external_block_hash(block_hashes[first - 1])
            hashes = tuple(external_block_hash(block_hashes[i]) for i in range(first, last + 1))
            self._events.append(BlockStored(hashes, parent, tuple(token_ids[first * bs:(last + 1) * bs]), bs,
                                            lora_id=lora_id, lora_name=lora_name))
            start = at

    def removed(self, digest: bytes) -> None:
        self._events.append(BlockRemoved((external_block_hash(digest),)))

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        taken, self._events = self._events, []
        return taken

    def __len__(self) -> int:
        return len(self._events)

