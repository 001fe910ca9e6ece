"""vLLM's KV-event wire format, both ways (msgpack only; the ZMQ side is kv_event_publisher.py).

A message on the PUB socket is three frames:

    [topic (utf-8), sequence number (8 bytes, big-endian, from 0), payload]

The payload is a msgpack `KVEventBatch` in msgspec's `array_like=True` form, its events tagged
(`tag=True`: the class name first) with vLLM's `omit_defaults`:

    [ts: float64, [event, ...], data_parallel_rank: int]
    ["BlockStored", [hash, ...], parent_hash | nil, [token_id, ...], block_size, lora_id | nil, medium, lora_name | nil]
    ["BlockRemoved", [hash, ...], medium]
    ["AllBlocksCleared"]

Hashes are unsigned 64-bit integers (engine/kv_events.py `external_block_hash`). The replay
socket (ROUTER) takes `[b"", start_seq (8 bytes, big-endian)]` from a DEALER (or REQ) and answers
`[b"", seq, payload]` for every buffered batch from `start_seq` on, then `[b"", END_SEQ, b""]`.

The decoder reads what vLLM's array form may hold: trailing fields absent (older versions) or
extra (newer ones: `extra_keys`, `group_idx`, ...), hashes as integers or bytes (the last 8 bytes,
big-endian, as llm-d reads them).
"""

from __future__ import annotations

from typing import Any

import msgpack

from pdserve.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, KVEventBatch

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's last answer: no more batches


class KVEventWireError(ValueError):
    """A payload that is not a vLLM KV-event batch."""


def encode_batch(batch: KVEventBatch) -> bytes:
    events = [_event_fields(event) for event in batch.events]
    fields: list[Any] = [batch.ts, events]
    if batch.data_parallel_rank is not None:  # NOTE: omit_defaults: vLLM leaves a None rank out
        fields.append(batch.data_parallel_rank)
    return msgpack.packb(fields, use_bin_type=True)


def _event_fields(event: KVCacheEvent) -> list[Any]:
    if isinstance(event, BlockStored):
        return ["BlockStored", list(event.block_hashes), event.parent_block_hash, list(event.token_ids),
                event.block_size, event.lora_id, event.medium, event.lora_name]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", list(event.block_hashes), event.medium]
    return ["AllBlocksCleared"]


def decode_batch(payload: bytes) -> KVEventBatch:
    """A batch from vLLM (or pdserve); KVEventWireError for anything else."""
    try:
        value = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise KVEventWireError(f"not msgpack: {exc}") from None
    if not isinstance(value, list) or len(value) < 2 or not isinstance(value[1], list):
        raise KVEventWireError("a batch is [ts, events, data_parallel_rank?]")
    ts, raw_events = value[0], value[1]
    rank = value[2] if len(value) > 2 else None
    if not isinstance(ts, (int, float)) or not (rank is None or isinstance(rank, int)):
        raise KVEventWireError("a batch's ts is a number, its data_parallel_rank an integer")
    return KVEventBatch(float(ts), tuple(_decode_event(e) for e in raw_events), rank)


def _decode_event(fields: Any) -> KVCacheEvent:
    if not isinstance(fields, list) or not fields or not isinstance(fields[0], str):
        raise KVEventWireError(f"an event is a tagged array, got {type(fields).__name__}")
    tag = fields[0]
    if tag == "BlockStored":
        if len(fields) < 5:
            raise KVEventWireError("BlockStored needs block_hashes, parent_block_hash, token_ids, block_size")
        tokens, block_size = fields[3], fields[4]
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens) or not isinstance(block_size,
                                                                                                          int):
            raise KVEventWireError("BlockStored's token_ids are integers, its block_size an integer")
        return BlockStored(_hashes(fields[1]), None if fields[2] is None else _hash(fields[2]), tuple(tokens),
                           block_size, lora_id=_optional(fields, 5, int), medium=_optional(fields, 6, str),
                           lora_name=_optional(fields, 7, str))
    if tag == "BlockRemoved":
        if len(fields) < 2:
            raise KVEventWireError("BlockRemoved needs block_hashes")
        return BlockRemoved(_hashes(fields[1]), medium=_optional(fields, 2, str))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise KVEventWireError(f"unknown event {tag!r}")


def _hashes(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise KVEventWireError("block_hashes is an array")
    return tuple(_hash(v) for v in value)


def _hash(value: Any) -> int:
    """An integer hash as it is (as unsigned 64-bit), a byte hash as its last 8 bytes, big-endian."""
    if isinstance(value, bool):
        raise KVEventWireError("a block hash is an integer or bytes")
    if isinstance(value, int):
        return value & ((1 << 64) - 1)
    if isinstance(value, bytes) and value:
        return int.from_bytes(value[-8:], "big")
    raise KVEventWireError("a block hash is an integer or bytes")


def _optional(fields: list[Any], at: int, kind: type) -> Any:
    value = fields[at] if at < len(fields) else None
    if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
        raise KVEventWireError(f"field {at} of {fields[0]} is a {kind.__name__} or nil")
    return value
