"""The hand-off record (disagg/handoff.py): every field round-trips, through its own encoding and
through a KV transport that carries it unread; a record of a newer version, or a malformed one, is
refused with a clear error, and the decode service fails that request (no crash, the next goes on)."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import pytest
from kv_transport_helpers import PoolSpec

from pdserve.disagg import handoff
from pdserve.disagg.attempt_states import RESERVATION, State
from pdserve.disagg.handoff import HANDOFF_VERSION, HandOffDone, HandOffError
from pdserve.disagg.phases import PrefillPhases
from pdserve.disagg.prompt_logprobs_wire import pack
from pdserve.disagg.transport import KVDone, KVProgress, KVTransferError, make_receiver, make_sender, nixl_available
from pdserve.disagg.worker.decode_service import DecodeService, _Reserved
from pdserve.engine.commands import CompleteRemote
from pdserve.engine.sampler import PromptLogprobs

SPEC = PoolSpec()
LOGPROBS = [None, PromptLogprobs(5, -0.5, 1, ((5, -0.5), (9, -1.25))), PromptLogprobs(3, -math.inf, 7, ((2, -0.25),
                                                                                                       (4, -3.0)))]
FULL = HandOffDone(42, bytes(range(256)) * 2, PrefillPhases(0.25, 1.5), prefill_cached_tokens=48,
                   prompt_logprobs=pack(LOGPROBS))


def test_every_field_round_trips() -> None:
    assert FULL.version == HANDOFF_VERSION
    assert HandOffDone.decode(FULL.encode()) == FULL
    bare = HandOffDone(0)  # unseeded, unmeasured, nothing cached, no prompt logprobs: nulls and defaults
    assert HandOffDone.decode(bare.encode()) == bare
    assert len(FULL.encode()) <= handoff.max_record_bytes(len(LOGPROBS))
    assert "token" not in json.loads(FULL.encode())  # the reservation's token is the transport's to carry


_DROP = object()


def _with(**changes: Any) -> bytes:
    """FULL's encoding with fields changed, added, or dropped (`_DROP`)."""
    obj = json.loads(FULL.encode())
    obj.update(changes)
    return json.dumps({k: v for k, v in obj.items() if v is not _DROP}).encode()


def test_a_newer_version_is_refused_by_name() -> None:
    with pytest.raises(HandOffError, match=f"version {HANDOFF_VERSION + 1} is newer than this worker's"):
        HandOffDone.decode(_with(version=HANDOFF_VERSION + 1, new_field=1))


@pytest.mark.parametrize(("data", "match"), [
    (b"\xff\x00not json", "not JSON"),
    (b"[1, 2]", "no valid version"),
    (_with(version=_DROP), "no valid version"),
    (_with(version="1"), "no valid version"),
    (_with(version=True), "no valid version"),
    (_with(version=0), "no valid version"),
    (_with(first_token_id=_DROP), "expected keys"),
    (_with(first_token_id="42"), "first_token_id: expected int"),
    (_with(generator_state="@@"), "base64"),
    (_with(prefill_phases={"queue_s": "NaN", "compute_s": 1.5}), "finite number"),
    (_with(prefill_phases={"queue_s": 0.25}), "PrefillPhases: expected keys"),
    (_with(unknown=1), "expected keys"),  # a field of this version it does not have: malformed
])
def test_a_malformed_record_is_refused_clearly(data: bytes, match: str) -> None:
    with pytest.raises(HandOffError, match=match):
        HandOffDone.decode(data)


def test_an_older_record_without_a_later_fields_takes_its_default() -> None:
    assert HandOffDone.decode(_with(prompt_logprobs=_DROP, prefill_cached_tokens=_DROP)) == HandOffDone(
        42, FULL.generator_state, PrefillPhases(0.25, 1.5))


@pytest.mark.parametrize("transport", ["fake", "tcp", pytest.param("nixl", marks=pytest.mark.skipif(
    not nixl_available(), reason="nixl_cu12 is not installed"))])
def test_a_transport_carries_the_record_unread(transport: str) -> None:
    decode_pool, prefill_pool = SPEC.pool(1), SPEC.pool(2)
    receiver = make_receiver(transport, SPEC.layout(decode_pool), decode_pool)
    sender = make_sender(transport, SPEC.layout(prefill_pool), prefill_pool)
    opaque = b"\x00not a record at all\xff"  # the transport never reads it
    try:
        sender.connect(receiver.address)
        for rid, record in (("r", FULL.encode()), ("o", opaque)):
            receiver.expect(rid, [3], "t")
            for layer in range(SPEC.num_layers):
                sender.send_layer(rid, layer, [5], [3], token="t")
            sender.send_done(rid, record, token="t")
            asyncio.run(sender.flush(rid, 10.0))
            events = asyncio.run(_until_done(receiver, rid))
            assert events[-1] == KVDone(rid, record)
    finally:
        sender.close()
        receiver.close()


async def _until_done(receiver: Any, rid: str) -> list[object]:
    events = [await receiver.wait(rid, 10.0)]
    while isinstance(events[-1], KVProgress):
        events.append(await receiver.wait(rid, 10.0))
    return events


class _Client:
    """The engine client, as the decode service uses it on a hand-off."""

    def __init__(self) -> None:
        self.sent: list[object] = []
        self.aborted: list[str] = []

    async def send(self, command: object, sink: object = None) -> None:
        self.sent.append(command)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


class _Receiver:
    """Hands the decode service's watcher one KVDone."""

    def __init__(self, record: bytes) -> None:
        self.layout = SPEC.layout(SPEC.pool(0))
        self.record = record
        self.num_dtype_conversions = 0

    async def wait(self, request_id: str, timeout_s: float) -> KVDone:
        return KVDone(request_id, self.record)

    def cancel(self, request_id: str) -> None: ...

    async def settled(self) -> None: ...


def _hand_over(record: bytes) -> tuple[DecodeService, _Client, asyncio.Queue[Any]]:
    client = _Client()
    service = DecodeService(client, _Receiver(record), "fail", transfer_timeout_s=5.0)  # type: ignore[arg-type]
    stream: asyncio.Queue[Any] = asyncio.Queue()
    service._requests["r"] = _Reserved(stream, (3,), "t", "r@0", State(RESERVATION, "r"))
    asyncio.run(service._watch("r", "r@0"))
    return service, client, stream


def test_decode_completes_with_every_field_of_the_record() -> None:
    service, client, stream = _hand_over(FULL.encode())
    assert client.sent == [CompleteRemote("r", 42, FULL.generator_state, 48, LOGPROBS)]
    assert not client.aborted and stream.empty() and service.stats().completed == 1
    assert service._meter._transfers["r"].prefill == PrefillPhases(0.25, 1.5)  # the TTFT phases' prefill part


@pytest.mark.parametrize(("record", "match"), [
    (_with(version=HANDOFF_VERSION + 1), "invalid hand-off: hand-off record version .* is newer"),
    (b"garbage", "invalid hand-off: hand-off record: not JSON"),
])
def test_decode_fails_the_request_of_a_record_it_cannot_take(record: bytes, match: str) -> None:
    service, client, stream = _hand_over(record)
    assert client.sent == [] and client.aborted == ["r"] and service.stats().failed == 1
    error = stream.get_nowait()
    assert isinstance(error, KVTransferError)
    with pytest.raises(KVTransferError, match=match):
        raise error
