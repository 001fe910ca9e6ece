"""KV transports (fake, tcp, nixl): bits land exactly in the reserved blocks and nowhere else, the
handshake refuses layout mismatches on both sides, every bad payload is rejected before it touches
the pool, and flush times out on a stall. Each test ends with nothing left behind."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import re
import socket
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from kv_transport_helpers import PoolSpec, RemotePrefill, record

from pdserve.disagg import wire
from pdserve.disagg.kv_layout import WIRE_VERSION, KVLayout, KVLayoutMismatch
from pdserve.disagg.phases import PrefillPhases
from pdserve.disagg.transport import (
    KVDone,
    KVProgress,
    KVReceiver,
    KVRejected,
    KVSender,
    KVTransferError,
    KVTransferTimeout,
    frames,
    make_receiver,
    make_sender,
    nixl_available,
    regions,
)
from pdserve.disagg.transport.handshake import say_hello
from pdserve.disagg.transport.messages import DoneHeader, Hello, LayerHeader, Reject
from pdserve.disagg.transport.reservations import PayloadRejected, ReservationTable

NIXL = pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(), reason="nixl_cu12 is not installed"))
TRANSPORTS = ["fake", "tcp", NIXL]
REAL_TRANSPORTS = ["tcp", NIXL]
SPEC = PoolSpec()
TIMEOUT_S = 10.0
DECODE_SEED, PREFILL_SEED = 1, 2


# -- helpers ---------------------------------------------------------------------------------------
def run(coro):  # noqa: ANN001, ANN201 - any coroutine
    return asyncio.run(coro)


def placements(seed: int, num_requests: int, num_blocks: int) -> list[tuple[list[int], list[int]]]:
    """Per request: source and destination blocks, placed differently in the two pools, in
    unrelated orders; no block is shared between requests."""
    rng = random.Random(seed)
    total = num_requests * num_blocks
    src, dst = rng.sample(range(SPEC.num_blocks), total), rng.sample(range(SPEC.num_blocks), total)
    return [(src[i:i + num_blocks], dst[i:i + num_blocks]) for i in range(0, total, num_blocks)]


def assert_landed(decode: torch.Tensor, before: torch.Tensor, prefill: torch.Tensor,
                  src: list[int], dst: list[int]) -> None:
    """Reserved destination blocks equal their source blocks bit for bit; every other block is untouched."""
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(decode[:, :, d].view(torch.int32), prefill[:, :, s].view(torch.int32)), (s, d)
    others = torch.ones(decode.shape[2], dtype=torch.bool)
    others[dst] = False
    assert torch.equal(decode[:, :, others], before[:, :, others])


async def drain(receiver: KVReceiver, request_id: str) -> list:
    """All events of a request up to its last one (KVDone or KVRejected)."""
    events = []
    while not events or isinstance(events[-1], KVProgress):
        events.append(await receiver.wait(request_id, TIMEOUT_S))
    return events


def assert_nothing_left(receiver: KVReceiver, *senders: KVSender, registrations: bool = True) -> None:
    """`registrations` (nixl): no NIXL registration of decode's is left either (False: one may be
    held through the late write window, after a cancel with a grant still open)."""
    assert receiver.reserved_request_ids() == frozenset()
    assert not registrations or getattr(receiver, "num_registrations", 0) == 0
    for sender in senders:
        assert sender.pending_request_ids() == frozenset()


class Decode:
    """The decode side of a test: a receiver over a random pool, and a copy of the pool as it was."""

    def __init__(self, transport: str, spec: PoolSpec = SPEC) -> None:
        self.pool = spec.pool(DECODE_SEED)
        self.before = self.pool.clone()
        self.receiver = make_receiver(transport, spec.layout(self.pool), self.pool)

    def untouched(self) -> bool:
        return torch.equal(self.pool.view(torch.int32), self.before.view(torch.int32))


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def decode(transport: str) -> Iterator[Decode]:
    d = Decode(transport)
    yield d
    d.receiver.close()


@pytest.fixture
def prefill(transport: str, decode: Decode) -> Iterator[tuple[KVSender, torch.Tensor]]:
    pool = SPEC.pool(PREFILL_SEED)
    sender = make_sender(transport, SPEC.layout(pool), pool)
    sender.connect(decode.receiver.address)
    yield sender, pool
    sender.close()


@pytest.fixture(scope="module", params=REAL_TRANSPORTS)
def remote(request: pytest.FixtureRequest) -> Iterator[tuple[str, RemotePrefill]]:
    remote = RemotePrefill(request.param)
    yield request.param, remote
    remote.stop()


# -- layout and wire records -----------------------------------------------------------------------
def test_layout_from_pool_json_round_trip_and_mismatch_message() -> None:
    pool = SPEC.pool(0)
    layout = SPEC.layout(pool)
    assert layout == KVLayout("test-model", "float32", "float32", 4, 3, 2, 8, "layer,kv,block,slot,head,dim")
    assert layout.block_bytes_per_layer == 2 * 4 * 2 * 8 * 4
    assert KVLayout.from_json(layout.to_json()) == layout
    with pytest.raises(KVLayoutMismatch, match="KV layout mismatch on block_size: prefill has 4, decode has 16") as e:
        layout.check_compatible(SPEC.with_(block_size=16).layout(SPEC.with_(block_size=16).pool(0)),
                                self_role="prefill", peer_role="decode")
    assert (e.value.field, e.value.local, e.value.peer) == ("block_size", "4", "16")


@pytest.mark.parametrize("text", [
    '{"model_id": "m"}',                                                          # missing fields
    '{"model_id":"m","dtype":"float32","kv_cache_dtype":"float32","block_size":true,"num_layers":3,'
    '"num_kv_heads":2,"head_dim":8,"layout":"x"}',                                # bool is not an int
    '{"model_id":"m","dtype":"float32","kv_cache_dtype":"float32","block_size":4,"num_layers":3,'
    '"num_kv_heads":2,"head_dim":8,"layout":"x","extra":1}',                      # unknown key
    '{"model_id":"m","dtype":"complex64","kv_cache_dtype":"float32","block_size":4,"num_layers":3,'
    '"num_kv_heads":2,"head_dim":8,"layout":"x"}',                                # unsupported dtype
    '[1, 2]', 'not json',
])
def test_layout_json_is_parsed_strictly(text: str) -> None:
    with pytest.raises(wire.WireFormatError):
        KVLayout.from_json(text)


def test_wire_bytes_are_base64_and_checked() -> None:
    done = DoneHeader("r", 3, bytes(range(256)), token="t")  # the record is opaque bytes here
    assert wire.loads(DoneHeader, wire.dumps(done)) == done
    header = '{"request_id":"r","num_layer_payloads":3,"token":"",'
    with pytest.raises(wire.WireFormatError, match="base64"):
        wire.loads(DoneHeader, header + '"record":"@@"}')
    for bad in ("null", "7", "true"):
        with pytest.raises(wire.WireFormatError, match="record"):
            wire.loads(DoneHeader, header + f'"record":{bad}}}')


# -- validation rules, transport-independent -------------------------------------------------------
def header(request_id: str = "r", layer: int = 0, dst: tuple[int, ...] = (3, 5), **changes: object) -> LayerHeader:
    layout = SPEC.layout(SPEC.pool(0))
    fields = dict(request_id=request_id, layer=layer, dst_block_ids=dst, dtype="float32",
                  num_bytes=len(dst) * layout.block_bytes_per_layer, shape=layout.payload_shape(len(dst)))
    return LayerHeader(**{**fields, **changes})  # type: ignore[arg-type]


@pytest.mark.parametrize(("bad", "reason"), [
    (header(request_id="nope"), "unknown request"),
    (header(dst=(3, 6)), r"destination blocks \[6\] are not reserved"),
    (header(layer=3), "layer 3 out of range"),
    (header(layer=-1), "layer -1 out of range"),
    (header(dst=(3, 3)), "must be distinct"),
    (header(num_bytes=1), "byte count 1"),
    (header(dtype="uint8"), "dtype uint8"),  # float16 would be converted (test_kv_dtype.py)
    (header(shape=(2, 2, 8, 2, 4)), "shape"),
    (header(shape=(2, 2, 4, 8, 2)), r"KV heads \[0, 8\) are not within this pool's \[0, 2\)"),
    (header(kv_head_start=1), r"KV heads \[1, 3\)"),
])
def test_reservation_table_rejects_each_bad_header(bad: LayerHeader, reason: str) -> None:
    table = ReservationTable(SPEC.layout(SPEC.pool(0)), SPEC.num_blocks)
    table.expect("r", [5, 3, 9])
    table.check_layer(header())
    with pytest.raises(PayloadRejected, match=reason):
        table.check_layer(bad)


def test_reservation_table_refuses_bad_reservations() -> None:
    table = ReservationTable(SPEC.layout(SPEC.pool(0)), SPEC.num_blocks)
    for ids in ([], [1, 1], [SPEC.num_blocks], [-1]):
        with pytest.raises(ValueError):
            table.expect("r", ids)
    table.expect("r", [1])
    with pytest.raises(ValueError, match="already"):
        table.expect("r", [2])


def test_regions_merge_only_adjacent_blocks() -> None:
    layout = SPEC.layout(SPEC.pool(0))
    size, n = layout.region_bytes, SPEC.num_blocks
    offsets = regions.payload_offsets(layout, n, 1, [4, 5, 9])
    assert offsets.tolist() == [(2 * n + b) * size for b in (4, 5, 9)] + [(3 * n + b) * size for b in (4, 5, 9)]
    spans = regions.coalesce(offsets, size)
    assert spans.starts.tolist() == [offsets[0], offsets[2], offsets[3], offsets[5]]
    assert spans.lengths.tolist() == [2 * size, size, 2 * size, size]
    # a pair merges only when both sides continue the previous pair
    local, remote = regions.coalesce_pairs(np.array([0, 8, 16, 24]), np.array([80, 88, 0, 40]), 8)
    assert (local.starts.tolist(), remote.starts.tolist(), local.lengths.tolist()) == ([0, 16, 24], [80, 0, 40],
                                                                                        [16, 8, 8])
    assert remote.lengths.tolist() == local.lengths.tolist()


def test_recv_stops_landing_bytes_when_the_guard_refuses() -> None:
    """What makes tcp's cancel safe: once the guard says no, no more bytes land in the views."""
    payload = torch.arange(1, 1 + (1 << 20), dtype=torch.int32).view(torch.uint8)
    views = [memoryview(torch.zeros(1 << 20, dtype=torch.uint8).numpy()) for _ in range(4)]

    @contextlib.contextmanager
    def guard() -> Iterator[bool]:
        yield views[0][0] == 0  # refuse as soon as the first bytes have landed

    async def transfer() -> int:
        a, b = socket.socketpair()
        with a, b:
            a.setblocking(False)
            b.setblocking(False)
            sent = asyncio.ensure_future(frames.send_views(a, [memoryview(payload.numpy())]))
            unread = await frames.recv_into_views(b, views, guard)
            await frames.discard(b, unread)
            await sent
            return unread

    unread = run(transfer())
    landed = (1 << 22) - unread
    assert 0 < landed < 1 << 22
    received = torch.cat([torch.frombuffer(v, dtype=torch.uint8) for v in views])
    assert torch.equal(received[:landed], payload[:landed]) and not received[landed:].any()


# -- transfers -------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout_kind", ["scattered", "runs"])
def test_all_layers_land_bit_for_bit(transport: str, decode: Decode, prefill: tuple[KVSender, torch.Tensor],
                                     layout_kind: str) -> None:
    """Two interleaved requests, each in two chunks (every layer sent twice, as chunked prefill does).
    `runs`: consecutive blocks on both sides, so regions merge (one descriptor / buffer per run)."""
    sender, prefill_pool = prefill
    plans = dict(zip(["a", "b"], placements(0, num_requests=2, num_blocks=6), strict=True))
    if layout_kind == "runs":
        plans = {"a": ([2, 3, 4, 5, 9, 10], [11, 12, 13, 14, 0, 1]),
                 "b": ([12, 13, 14, 15, 16, 17], [20, 21, 22, 3, 4, 5])}
    for rid, (_, dst) in plans.items():
        decode.receiver.expect(rid, list(reversed(dst)))  # reservation order is irrelevant
    for chunk in (slice(0, 4), slice(4, 6)):
        for layer in range(SPEC.num_layers):
            for rid, (src, dst) in plans.items():
                sender.send_layer(rid, layer, src[chunk], dst[chunk])
    state = bytes(range(256)) * 3  # binary, with NUL bytes
    for token, rid in enumerate(plans, start=100):
        sender.send_done(rid, record(token, state, prefill_phases=PrefillPhases(0.25, token / 1000)))

    async def finish() -> dict[str, list]:
        await asyncio.gather(*(sender.flush(rid, TIMEOUT_S) for rid in plans))
        return {rid: await drain(decode.receiver, rid) for rid in plans}

    events = run(finish())
    for token, (rid, (_, dst)) in enumerate(plans.items(), start=100):
        *progress, last = events[rid]
        assert last == KVDone(rid, record(token, state, prefill_phases=PrefillPhases(0.25, token / 1000)))
        # NOTE: over nixl, writes of different layers may complete out of order.
        assert sorted((e.layer, e.block_ids) for e in progress) == sorted(
            (layer, tuple(dst[chunk])) for layer in range(SPEC.num_layers) for chunk in (slice(0, 4), slice(4, 6)))
    all_src = [b for src, _ in plans.values() for b in src]
    all_dst = [b for _, dst in plans.values() for b in dst]
    assert_landed(decode.pool, decode.before, prefill_pool, all_src, all_dst)
    assert_nothing_left(decode.receiver, sender)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_pools(transport: str, dtype: str) -> None:
    spec = SPEC.with_(dtype=dtype)
    decode = Decode(transport, spec)
    pool = spec.pool(PREFILL_SEED)
    sender = make_sender(transport, spec.layout(pool), pool)
    try:
        sender.connect(decode.receiver.address)
        [(src, dst)] = placements(3, num_requests=1, num_blocks=5)
        decode.receiver.expect("h", dst)
        for layer in range(spec.num_layers):
            sender.send_layer("h", layer, src, dst)
        sender.send_done("h", record(1))
        run(sender.flush("h", TIMEOUT_S))
        assert isinstance(run(drain(decode.receiver, "h"))[-1], KVDone)
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(decode.pool[:, :, d].view(torch.int16), pool[:, :, s].view(torch.int16))
        assert_nothing_left(decode.receiver, sender)
    finally:
        sender.close()
        decode.receiver.close()


@pytest.mark.slow
def test_transfer_crosses_processes(remote: tuple[str, RemotePrefill]) -> None:
    transport, prefill = remote
    decode = Decode(transport)
    try:
        prefill.new_sender("ok", SPEC, PREFILL_SEED)
        prefill.call("ok", "connect", decode.receiver.address)
        [(src, dst)] = placements(7, num_requests=1, num_blocks=10)
        decode.receiver.expect("x", dst)
        for layer in range(SPEC.num_layers):
            prefill.call("ok", "send_layer", "x", layer, src, dst)
        prefill.call("ok", "send_done", "x", record(42, b"\x00generator-state\xff"))
        prefill.call("ok", "flush", "x", TIMEOUT_S)
        events = run(drain(decode.receiver, "x"))
        assert events[-1] == KVDone("x", record(42, b"\x00generator-state\xff"))
        assert sorted(e.layer for e in events[:-1]) == list(range(SPEC.num_layers))
        assert_landed(decode.pool, decode.before, SPEC.pool(PREFILL_SEED), src, dst)
        assert prefill.call("ok", "pending_request_ids") == frozenset()
        assert decode.receiver.reserved_request_ids() == frozenset()
    finally:
        decode.receiver.close()


@pytest.mark.parametrize("field", ["block_size", "dtype", "num_layers", "head_dim", "model_id"])
def test_layout_mismatch_refused_at_connect_on_both_sides(transport: str, decode: Decode, field: str) -> None:
    # NOTE: a float16 or float8 pool would be converted (test_kv_dtype.py); a uint8 one cannot be
    changed = {"block_size": 8, "dtype": "uint8", "num_layers": 2, "head_dim": 16, "model_id": "other-model"}
    spec = SPEC.with_(**{field: changed[field]})
    pool = spec.pool(PREFILL_SEED)
    sender = make_sender(transport, spec.layout(pool), pool)
    try:
        with pytest.raises(KVLayoutMismatch, match=f"KV layout mismatch on {field}: prefill has") as e:
            sender.connect(decode.receiver.address)
        assert e.value.field == field
        refusal = decode.receiver.refusals[-1]
        assert refusal.field == field and f"mismatch on {field}: prefill has {changed[field]}" in str(refusal)
        with pytest.raises((ConnectionError, RuntimeError)):  # never connected: nothing can be sent
            sender.send_layer("r", 0, [0], [0])
    finally:
        sender.close()
    assert decode.untouched()


def test_wire_version_mismatch_refused_at_connect(transport: str, decode: Decode) -> None:
    """A worker speaking another version of the KV frames is refused at the handshake, by name,
    before any request could fail on a frame it cannot decode."""
    pool = SPEC.pool(PREFILL_SEED)
    newer = dataclasses.replace(SPEC.layout(pool), wire_version=WIRE_VERSION + 1)
    sender = make_sender(transport, newer, pool)
    try:
        with pytest.raises(KVLayoutMismatch, match="KV layout mismatch on wire_version: prefill has") as e:
            sender.connect(decode.receiver.address)
        assert e.value.field == "wire_version" and decode.receiver.refusals[-1].field == "wire_version"
    finally:
        sender.close()
    assert decode.untouched()


@pytest.mark.slow
@pytest.mark.parametrize("field", ["block_size", "dtype"])
def test_layout_mismatch_refused_across_processes(remote: tuple[str, RemotePrefill], field: str) -> None:
    transport, prefill = remote
    decode = Decode(transport)
    try:
        bad = {"block_size": 16, "dtype": "uint8"}[field]  # NOTE: a float8 pool would be converted (test_kv_dtype.py)
        prefill.new_sender(f"bad-{field}", SPEC.with_(**{field: bad}), 3)
        with pytest.raises(KVLayoutMismatch, match=f"KV layout mismatch on {field}") as e:
            prefill.call(f"bad-{field}", "connect", decode.receiver.address)
        assert e.value.field == field and decode.receiver.refusals[-1].field == field
        assert decode.untouched()
    finally:
        decode.receiver.close()


@pytest.mark.parametrize("case", ["unknown request", "unreserved block", "wrong byte count"])
def test_bad_payload_rejected_and_pool_untouched(transport: str, decode: Decode,
                                                 prefill: tuple[KVSender, torch.Tensor], case: str) -> None:
    sender, _ = prefill
    decode.receiver.expect("r", [2, 4, 6])
    rid, src, dst, reason = {
        "unknown request": ("ghost", [1, 2, 3], [2, 4, 6], "unknown request"),
        "unreserved block": ("r", [1, 2, 3], [2, 4, 7], r"destination blocks \[7\] are not reserved"),
        # NOTE: the sender never second-guesses the destination: 2 source blocks make a payload of
        # 2 blocks' bytes, which cannot fill 3 destination blocks; decode must catch it.
        "wrong byte count": ("r", [1, 2], [2, 4, 6], "byte count"),
    }[case]
    sender.send_layer(rid, 0, src, dst)
    with pytest.raises(KVTransferError, match=reason):
        run(sender.flush(rid, TIMEOUT_S))
    assert decode.untouched()
    if rid == "r":  # a known request learns why it failed, and accepts nothing more
        event = run(decode.receiver.wait("r", TIMEOUT_S))
        assert isinstance(event, KVRejected) and re.search(reason, event.reason)
    else:
        decode.receiver.cancel("r")
    assert_nothing_left(decode.receiver, sender)


def test_cancel_then_late_payload_rejected(transport: str, decode: Decode,
                                           prefill: tuple[KVSender, torch.Tensor]) -> None:
    sender, prefill_pool = prefill
    decode.receiver.expect("r", [2, 4])
    sender.send_layer("r", 0, [7, 8], [2, 4])
    run(sender.flush("r", TIMEOUT_S))
    assert run(decode.receiver.wait("r", TIMEOUT_S)) == KVProgress("r", 0, (2, 4))
    decode.receiver.cancel("r")
    with pytest.raises(KVTransferError, match="cancelled|no transfer expected"):
        run(decode.receiver.wait("r", TIMEOUT_S))
    after_layer0 = decode.pool.clone()
    sender.send_layer("r", 1, [7, 8], [2, 4])
    with pytest.raises(KVTransferError, match="unknown request"):
        run(sender.flush("r", TIMEOUT_S))
    assert torch.equal(decode.pool, after_layer0)
    assert torch.equal(decode.pool[0, :, [2, 4]], prefill_pool[0, :, [7, 8]])
    assert_nothing_left(decode.receiver, sender)


def test_released_request_is_never_sent_and_never_completes(transport: str, decode: Decode,
                                                            prefill: tuple[KVSender, torch.Tensor]) -> None:
    """After `release` (the prefill worker gave up and frees the blocks), nothing of the request is
    sent any more: above all not its final message, so decode never completes it on partial KV."""
    sender, _ = prefill
    decode.receiver.expect("r", [2, 4])
    before = decode.pool.clone()
    run(sender.release("r"))
    for layer in range(SPEC.num_layers):
        sender.send_layer("r", layer, [7, 8], [2, 4])
    sender.send_done("r", record(5))
    with pytest.raises(KVTransferTimeout):
        run(sender.flush("r", 0.3))
    with pytest.raises(KVTransferTimeout):
        run(decode.receiver.wait("r", 0.3))
    assert torch.equal(decode.pool, before)
    decode.receiver.cancel("r")
    # the sender still works for other requests
    decode.receiver.expect("s", [5])
    sender.send_layer("s", 0, [9], [5])
    sender.send_done("s", record(1))
    run(sender.flush("s", TIMEOUT_S))
    assert run(decode.receiver.wait("s", TIMEOUT_S)) == KVProgress("s", 0, (5,))
    assert isinstance(run(decode.receiver.wait("s", TIMEOUT_S)), KVDone)
    # nixl: decode granted r's claims, which the released sender never wrote: r's registration is held
    assert_nothing_left(decode.receiver, sender, registrations=False)


def test_flush_and_wait_time_out_on_a_stall() -> None:
    decode = Decode("fake")
    pool = SPEC.pool(PREFILL_SEED)
    sender = make_sender("fake", SPEC.layout(pool), pool, stall_after_layers=1)
    sender.connect(decode.receiver.address)
    decode.receiver.expect("r", [1, 2])
    for layer in range(SPEC.num_layers):
        sender.send_layer("r", layer, [3, 4], [1, 2])
    sender.send_done("r", record(5))
    timeout_s, margin_s = 0.2, 0.15
    start = time.monotonic()
    with pytest.raises(KVTransferTimeout, match="^KV cache transfer timed out"):
        run(sender.flush("r", timeout_s))
    assert timeout_s <= time.monotonic() - start < timeout_s + margin_s
    assert run(decode.receiver.wait("r", timeout_s)) == KVProgress("r", 0, (1, 2))
    start = time.monotonic()
    with pytest.raises(KVTransferTimeout, match="^KV cache transfer timed out"):
        run(decode.receiver.wait("r", timeout_s))
    assert timeout_s <= time.monotonic() - start < timeout_s + margin_s
    decode.receiver.cancel("r")
    assert_nothing_left(decode.receiver, sender)


def test_keepalives_push_the_wait_timeout_back() -> None:
    """A `touch` (the prefill worker still computing) restarts the no-progress clock; without one
    the wait times out as usual."""
    decode = Decode("fake")
    decode.receiver.expect("r", [1, 2])
    timeout_s = 0.2
    touched: list[float] = []

    async def touch_for(duration_s: float) -> None:
        end = time.monotonic() + duration_s
        while time.monotonic() < end:
            decode.receiver.touch("r")
            touched.append(time.monotonic())
            await asyncio.sleep(timeout_s / 4)

    async def scenario() -> tuple[float, float, float]:
        start = time.monotonic()
        keepalive = asyncio.create_task(touch_for(0.6))
        with pytest.raises(KVTransferTimeout) as raised:
            await decode.receiver.wait("r", timeout_s)
        ended = time.monotonic()
        await keepalive
        return start, ended, raised.value.limit_s

    start, ended, limit_s = run(scenario())
    assert ended - start >= 0.6 + timeout_s - 0.1, ended - start  # touched for 0.6 s, then the timeout
    # NOTE: timed from the last touch, by the limit the wait had then (the touches' gaps teach it: a
    # loaded machine's late wake-ups lengthen it), not by a fixed total
    assert timeout_s <= limit_s and touched[-1] + limit_s - 0.05 <= ended < touched[-1] + limit_s + 0.3, \
        (touched[-1] - start, limit_s, ended - start)
    decode.receiver.touch("unknown")  # no-op
    decode.receiver.cancel("r")
    assert_nothing_left(decode.receiver)


# -- the tcp wire itself ---------------------------------------------------------------------------
def test_tcp_frame_whose_payload_disagrees_with_its_header_is_rejected() -> None:
    """A hand-made frame: the header announces one block's bytes, the frame carries 8 bytes more."""
    decode = Decode("tcp")
    decode.receiver.expect("r", [3])
    host, port = frames.parse_address(decode.receiver.address, "tcp")

    async def talk() -> object:
        sock = await frames.connect(host, port)
        with sock:
            welcome = await say_hello(sock, Hello(decode.receiver.layout, b""), None)
            assert not welcome.refusal
            payload = torch.zeros(SPEC.pool(0)[0, :, :1].numel() * 4 + 8, dtype=torch.uint8)
            await frames.send_frame(sock, header(dst=(3,)), [memoryview(payload.numpy())])
            return (await frames.recv_frame(sock, max_payload_bytes=0)).header

    try:
        reply = run(talk())
        assert isinstance(reply, Reject) and "announces" in reply.reason
        assert decode.untouched()
        assert isinstance(run(decode.receiver.wait("r", TIMEOUT_S)), KVRejected)
        assert_nothing_left(decode.receiver)
    finally:
        decode.receiver.close()


def test_tcp_receiver_survives_garbage() -> None:
    decode = Decode("tcp")
    host, port = frames.parse_address(decode.receiver.address, "tcp")

    async def garbage() -> None:
        sock = await frames.connect(host, port)
        with sock:
            await asyncio.get_running_loop().sock_sendall(sock, b"GET / HTTP/1.1\r\n\r\n" + b"x" * 64)
            with contextlib.suppress(ConnectionResetError):  # decode hangs up (a reset: our junk is unread)
                while await asyncio.get_running_loop().sock_recv(sock, 4096):  # its challenge, then EOF
                    pass

    try:
        run(garbage())
        pool = SPEC.pool(PREFILL_SEED)
        sender = make_sender("tcp", SPEC.layout(pool), pool)
        sender.connect(decode.receiver.address)
        decode.receiver.expect("r", [0])
        sender.send_layer("r", 0, [1], [0])
        sender.send_done("r", record(1))
        run(sender.flush("r", TIMEOUT_S))
        assert isinstance(run(drain(decode.receiver, "r"))[-1], KVDone)
        sender.close()
        assert_nothing_left(decode.receiver)
    finally:
        decode.receiver.close()


def test_expect_twice_keeps_the_live_request(transport: str, decode: Decode,
                                             prefill: tuple[KVSender, torch.Tensor]) -> None:
    sender, _ = prefill
    decode.receiver.expect("r", [1, 2])
    with pytest.raises(ValueError, match="already"):
        decode.receiver.expect("r", [3])
    sender.send_layer("r", 0, [5, 6], [1, 2])
    sender.send_done("r", record(9))
    run(sender.flush("r", TIMEOUT_S))
    assert run(drain(decode.receiver, "r"))[-1] == KVDone("r", record(9))
    assert_nothing_left(decode.receiver, sender)


@pytest.mark.slow
def test_transport_benchmark_runs_every_method_in_rounds_and_checks_the_bytes() -> None:
    """`python -m pdserve.bench.kv_transport` on a tiny workload: every method timed once per round,
    baselines also alone, and each transport's final transfer verified byte for byte (it raises
    otherwise)."""
    from pdserve.bench import kv_transport as bench

    work = bench.KVWorkload("tiny", num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16", block_size=16,
                            num_tokens=256)
    transports = ["tcp", "nixl"] if nixl_available() else ["tcp"]
    seconds = bench.run_workload(work, transports, reps=2)
    expected = {"memcpy, alone", "raw socket, alone", "memcpy", "raw socket"} | {
        f"{name}, {placement}" for name in transports for placement in bench.PLACEMENTS} | {
        f"{name}, served, from float32" for name in transports}  # converted on arrival, checked too
    assert set(seconds) == expected
    assert all(len(times) == 2 and min(times) > 0 for times in seconds.values())
    assert bench.ratio(seconds, "memcpy", "memcpy") == 1.0
    assert len(bench._verdicts(seconds)) == len(transports) * (len(bench.PLACEMENTS) + 1)


@pytest.mark.skipif(not nixl_available(), reason="nixl_cu12 is not installed")
def test_nixl_never_writes_on_a_stale_grant(monkeypatch: pytest.MonkeyPatch) -> None:
    """Late writes (nixl module docstring): a grant that arrives more than GRANT_MAX_AGE_S after
    its claim fails the request and writes nothing, so decode's quarantine of cancelled blocks
    (`late_write_window_s`, longer than that) bounds when granted bytes can land."""
    from pdserve.disagg.transport.nixl import receiver as nixl
    from pdserve.disagg.transport.nixl import sender as nixl_sender

    decode = Decode("nixl")
    pool = SPEC.pool(PREFILL_SEED)
    sender = make_sender("nixl", SPEC.layout(pool), pool)
    try:
        sender.connect(decode.receiver.address)
        assert decode.receiver.late_write_window_s == nixl.LATE_WRITE_WINDOW_S > nixl.GRANT_MAX_AGE_S
        monkeypatch.setattr(nixl_sender, "GRANT_MAX_AGE_S", -1.0)  # every grant is too late
        decode.receiver.expect("r", [2, 4])
        sender.send_layer("r", 0, [7, 8], [2, 4])
        with pytest.raises(KVTransferError, match="grant for layer 0 came .* after the claim"):
            run(sender.flush("r", TIMEOUT_S))
        assert decode.untouched()
        decode.receiver.cancel("r")
        assert_nothing_left(decode.receiver, sender, registrations=False)  # the grant is open: held
    finally:
        sender.close()
        decode.receiver.close()


@pytest.mark.parametrize("transport", ["fake", "tcp"])
def test_a_synchronous_cancel_leaves_no_late_write_window(decode: Decode) -> None:
    """tcp and fake stop every write before `cancel` returns: decode may reuse the blocks at once."""
    assert decode.receiver.late_write_window_s == 0.0
