"""Every record a KV transport moves: the events a receiver delivers to decode (`KVEvent`), then
the wire records that travel between prefill and decode (`Message`). One tag per wire record
(`MessageType`) so a frame or a NIXL notification says which record its JSON holds."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pdserve.disagg import wire
from pdserve.disagg.kv_layout import KVLayout


@dataclass(frozen=True, slots=True)
class KVProgress:
    """Layer `layer` of these destination blocks is in the decode pool."""

    request_id: str
    layer: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class KVDone:
    """All of the request's payloads are in the pool; `record` is what prefill sent with them (the
    encoded hand-off record, disagg/handoff.py: its first token and the rest), which the transport
    passes on as it arrived, unread. Always the request's last event."""

    request_id: str
    record: bytes


@dataclass(frozen=True, slots=True)
class KVRejected:
    """A payload for this request failed validation; nothing of it reached the pool and the
    request accepts no further payloads. Always the request's last event."""

    request_id: str
    reason: str


KVEvent = KVProgress | KVDone | KVRejected


@dataclass(frozen=True, slots=True)
class Challenge:
    """decode -> prefill, first frame of a connection: the nonce prefill's proof must cover."""

    nonce: str


@dataclass(frozen=True, slots=True)
class Hello:
    """prefill -> decode, the answer to the challenge. `nixl_metadata` is empty for tcp; `proof`
    is HMAC(cluster secret, "kv-hello", challenge nonce, `nonce`) ("" without a secret)."""

    layout: KVLayout
    nixl_metadata: bytes
    nonce: str = ""
    proof: str = ""


@dataclass(frozen=True, slots=True)
class Welcome:
    """decode -> prefill, the handshake's answer. A non-empty `refusal` means decode refused the
    layout and closes the connection; decode's layout is sent either way so prefill checks too.
    `nixl_metadata` (nixl): decode's agent connection info, without any memory registration.
    `proof`: HMAC(cluster secret, "kv-welcome", both nonces), so prefill knows decode holds it too."""

    layout: KVLayout
    refusal: str
    nixl_metadata: bytes
    proof: str = ""


@dataclass(frozen=True, slots=True)
class LayerHeader:
    """Announces one layer's K and V for some destination blocks. The payload is `num_bytes` raw
    bytes shaped `shape` = [k|v, block, slot, head, dim] of `dtype`, blocks in `dst_block_ids` order.
    Over tcp the payload follows in the same frame; over nixl it travels inside Claim and Written.
    `token`: the reservation's (decode checks it before anything of the payload is admitted).
    `kv_head_start`: the model's KV head that `shape`'s heads start at (a tensor-parallel rank
    sends its own heads; decode writes them into those heads of its blocks).
    `k_scale`, `v_scale`: what the payload's K and V elements are multiplied by to give the values
    (the sender's FP8 pool's scales of this layer; 1.0 for a float payload)."""

    request_id: str
    layer: int
    dst_block_ids: tuple[int, ...]
    num_bytes: int
    dtype: str
    shape: tuple[int, ...]
    token: str = ""
    kv_head_start: int = 0
    k_scale: float = 1.0
    v_scale: float = 1.0

    @property
    def scales(self) -> tuple[float, float]:
        return self.k_scale, self.v_scale


@dataclass(frozen=True, slots=True)
class DoneHeader:
    """The request's final message: decode emits KVDone with its `record` once `num_layer_payloads`
    layer payloads of the request have been accepted (over nixl, notifications may overtake each
    other). `record`: the hand-off record's bytes, opaque to the transport (disagg/handoff.py)."""

    request_id: str
    num_layer_payloads: int
    record: bytes
    token: str = ""  # the reservation's, as in LayerHeader

    def event(self) -> KVDone:
        return KVDone(self.request_id, self.record)


@dataclass(frozen=True, slots=True)
class Ack:
    """decode -> prefill: one more payload (a layer or the final message) of the request was accepted."""

    request_id: str


@dataclass(frozen=True, slots=True)
class Reject:
    """decode -> prefill: a payload or claim was refused; the request is failed on decode."""

    request_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Claim:
    """nixl only, prefill -> decode: asks for the destination addresses of one layer payload.
    `claim_id` is unique per sender; chunked prefill may send the same layer of a request again."""

    claim_id: int
    header: LayerHeader


@dataclass(frozen=True, slots=True)
class Grant:
    """nixl only, decode -> prefill: the addresses of exactly the claimed destination regions, in
    payload order (the K region of each block of `dst_block_ids`, then each V region), each
    `region_bytes` long. `nixl_metadata`: decode's agent metadata for the registration that covers
    them (the reservation's regions, or a staging range), which prefill loads before it WRITEs;
    empty when this prefill agent already got it with an earlier grant. `dst_device_id`: the
    device id the WRITE's remote descriptors name (that registration's, nixl/agent.register)."""

    request_id: str
    claim_id: int
    dst_addrs: tuple[int, ...]
    region_bytes: int
    nixl_metadata: bytes = b""
    dst_device_id: int = 0


@dataclass(frozen=True, slots=True)
class Written:
    """nixl only, prefill -> decode: the notification of the WRITE for a granted claim."""

    claim_id: int
    header: LayerHeader


class MessageType(enum.IntEnum):
    HELLO = 1
    WELCOME = 2
    LAYER = 3
    DONE = 4
    ACK = 5
    REJECT = 6
    CLAIM = 7
    GRANT = 8
    WRITTEN = 9
    CHALLENGE = 10


Message = Challenge | Hello | Welcome | LayerHeader | DoneHeader | Ack | Reject | Claim | Grant | Written

_RECORDS: dict[MessageType, type] = {
    MessageType.HELLO: Hello,
    MessageType.WELCOME: Welcome,
    MessageType.LAYER: LayerHeader,
    MessageType.DONE: DoneHeader,
    MessageType.ACK: Ack,
    MessageType.REJECT: Reject,
    MessageType.CLAIM: Claim,
    MessageType.GRANT: Grant,
    MessageType.WRITTEN: Written,
    MessageType.CHALLENGE: Challenge,
}


_TYPES = {cls: kind for kind, cls in _RECORDS.items()}


def message_type(message: Message) -> MessageType:
    return _TYPES[type(message)]


def decode_message(kind: int, data: bytes) -> Message:
    """JSON of a record tagged `kind` -> the record; WireFormatError for anything else."""
    try:
        cls = _RECORDS[MessageType(kind)]
    except ValueError as e:
        raise wire.WireFormatError(f"unknown message type {kind}") from e
    return wire.loads(cls, data)


def encode_message(message: Message) -> bytes:
    return wire.dumps(message)
