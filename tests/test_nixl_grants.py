"""NIXL grants (transport/nixl/grants.py): decode's pool is never exposed whole. A peer that passed
the handshake with the cluster secret holds decode's connection info only; a grant hands it the
registration of its reservation's regions, and that registration is revoked when the reservation
ends. A WRITE to any other pool address is refused by NIXL itself and leaves the pool unchanged."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from kv_transport_helpers import PoolSpec, record

from pdserve.disagg.auth import ClusterSecret
from pdserve.disagg.transport import (
    KVDone,
    KVProgress,
    KVReceiver,
    KVTransferError,
    make_receiver,
    make_sender,
    nixl_available,
)
from pdserve.disagg.transport.handshake import KVPeerPolicy
from pdserve.disagg.transport.messages import Claim

pytestmark = pytest.mark.skipif(not nixl_available(), reason="nixl_cu12 is not installed")

SPEC = PoolSpec()
SECRET = ClusterSecret(b"grants-test-cluster-secret-0123456789")
TIMEOUT_S = 10.0


class Pair:
    """A decode receiver with the cluster secret and a prefill sender that proved it."""

    def __init__(self) -> None:
        self.pool = SPEC.pool(1)
        self.before = self.pool.clone()
        self.receiver = make_receiver("nixl", SPEC.layout(self.pool), self.pool, peers=KVPeerPolicy(SECRET))
        self.src = SPEC.pool(2)
        self.sender = make_sender("nixl", SPEC.layout(self.src), self.src, secret=SECRET)
        self.sender.connect(self.receiver.address)

    def region(self, layer: int, block: int) -> tuple[int, int]:
        """Address and size of kv_cache[layer, 0, block] in decode's pool."""
        region = self.pool[layer, 0, block]
        return region.data_ptr(), region.numel() * region.element_size()

    def write_directly(self, dst_addr: int, num_bytes: int) -> str:
        """What a hostile prefill does with its NIXL agent, ignoring the protocol: a WRITE of its
        own bytes to `dst_addr` in decode's process, naming any of the first device ids (decode
        gives each host-memory registration its own, nixl_agent.register). NIXL's answer:
        "refused: ..." when every one was refused, else the first transfer state."""
        answers = [self._write_as(dst_addr, num_bytes, device_id) for device_id in range(8)]
        return next((a for a in answers if not a.startswith("refused")), answers[0])

    def _write_as(self, dst_addr: int, num_bytes: int, device_id: int) -> str:
        sender = self.sender

        def post() -> str:
            agent = sender._agent  # type: ignore[attr-defined]
            rows = np.array([[sender.kv_cache.data_ptr(), num_bytes, 0]], dtype=np.uint64)
            src = agent.get_xfer_descs(rows, "DRAM")
            dst = agent.get_xfer_descs(np.array([[dst_addr, num_bytes, device_id]], dtype=np.uint64), "DRAM")
            try:
                handle = agent.initialize_xfer("WRITE", src, dst, sender._peer)  # type: ignore[attr-defined]
                state = agent.transfer(handle)
            except Exception as e:  # the bindings' own classes (nixlNotFoundError, ...)
                return f"refused: {e!r}"
            deadline = time.monotonic() + TIMEOUT_S
            while state == "PROC" and time.monotonic() < deadline:
                state = agent.check_xfer_state(handle)
            handle.release()
            return str(state)

        return str(sender._io.call(post))  # type: ignore[attr-defined]

    def untouched(self, blocks: list[int]) -> bool:
        return torch.equal(self.pool[:, :, blocks], self.before[:, :, blocks])

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair()
    yield p
    p.close()


def registrations(receiver: KVReceiver) -> int:
    return int(receiver.num_registrations)  # type: ignore[attr-defined]


async def drain(receiver: KVReceiver, request_id: str) -> list:
    events = []
    while not events or isinstance(events[-1], KVProgress):
        events.append(await receiver.wait(request_id, TIMEOUT_S))
    return events


def test_a_peer_with_the_secret_writes_nowhere_it_was_not_granted(pair: Pair) -> None:
    """Before any claim the peer holds no registration of decode's at all; once its own request
    was granted, another reservation's blocks are still out of its reach. (Before grants were
    per reservation, the handshake handed out the whole pool's registration and both WRITEs landed.)"""
    assert pair.write_directly(*pair.region(0, 5)).startswith("refused")
    assert pair.untouched([5]) and registrations(pair.receiver) == 0

    pair.receiver.expect("mine", [2, 3], "token-mine")
    pair.receiver.expect("theirs", [7, 8], "token-theirs")
    pair.sender.send_layer("mine", 0, [10, 11], [2, 3], token="token-mine")
    asyncio.run(pair.sender.flush("mine", TIMEOUT_S))  # granted and written: its registration is loaded
    assert registrations(pair.receiver) == 1
    for layer in range(SPEC.num_layers):
        assert pair.write_directly(*pair.region(layer, 7)).startswith("refused")
    addr, size = pair.region(0, 8)
    assert pair.write_directly(addr - 8, size).startswith("refused")  # straddling into another reservation
    assert pair.untouched([7, 8])

    for layer in range(1, SPEC.num_layers):
        pair.sender.send_layer("mine", layer, [10, 11], [2, 3], token="token-mine")
    pair.sender.send_done("mine", record(9), token="token-mine")
    asyncio.run(pair.sender.flush("mine", TIMEOUT_S))
    assert isinstance(asyncio.run(drain(pair.receiver, "mine"))[-1], KVDone)
    assert torch.equal(pair.pool[:, :, [2, 3]], pair.src[:, :, [10, 11]])
    pair.receiver.cancel("theirs")
    assert registrations(pair.receiver) == 0  # completed: revoked at once; cancelled: never registered
    assert pair.untouched([b for b in range(SPEC.num_blocks) if b not in (2, 3)])


def test_a_registration_with_an_open_grant_is_held_through_the_late_write_window(
        pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reservation cancelled while a grant of it is open keeps its registration until the late
    write window passes (a granted WRITE may still be in flight), then it is revoked."""
    from pdserve.disagg.transport.nixl import receiver as nixl

    monkeypatch.setattr(nixl, "LATE_WRITE_WINDOW_S", 0.3)
    pair.receiver.expect("r", [4, 5], "t")
    sender = pair.sender
    header = sender._layer_header("r", 0, 2, [4, 5], "t")  # type: ignore[attr-defined]
    # a claim of ours that is granted but never written (the sender knows no such claim id)
    sender._io.call(sender._notify, Claim(10_000, header))  # type: ignore[attr-defined]
    deadline = time.monotonic() + TIMEOUT_S
    while registrations(pair.receiver) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert registrations(pair.receiver) == 1
    pair.receiver.cancel("r")
    time.sleep(0.1)
    assert registrations(pair.receiver) == 1  # held: the grant is open
    while registrations(pair.receiver) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert registrations(pair.receiver) == 0
    assert pair.untouched(list(range(SPEC.num_blocks)))


def test_a_request_is_registered_once_for_all_its_layers_and_chunks(pair: Pair,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Six claims (two chunks of three layers): one registration, its metadata in the first grant
    only, revoked once the request is done."""
    from pdserve.disagg.transport.nixl.sender import NixlKVSender

    loaded: list[int] = []
    load = NixlKVSender._load_grant
    monkeypatch.setattr(NixlKVSender, "_load_grant",
                        lambda self, grant: (loaded.append(len(grant.nixl_metadata)), load(self, grant))[1])
    pair.receiver.expect("r", [12, 13, 14, 20], "t")
    for chunk_src, chunk_dst in (([1, 2], [12, 13]), ([3, 4], [14, 20])):
        for layer in range(SPEC.num_layers):
            pair.sender.send_layer("r", layer, chunk_src, chunk_dst, token="t")
    pair.sender.send_done("r", record(1), token="t")
    asyncio.run(pair.sender.flush("r", TIMEOUT_S))
    assert isinstance(asyncio.run(drain(pair.receiver, "r"))[-1], KVDone)
    assert torch.equal(pair.pool[:, :, [12, 13, 14, 20]], pair.src[:, :, [1, 2, 3, 4]])
    assert len(loaded) == 2 * SPEC.num_layers and loaded[0] > 0 and loaded[1:] == [0] * (len(loaded) - 1)
    assert registrations(pair.receiver) == 0
    assert pair.receiver.reserved_request_ids() == frozenset() and pair.sender.pending_request_ids() == frozenset()


def test_a_grant_whose_metadata_does_not_load_breaks_the_sender(pair: Pair) -> None:
    """NIXL drops what it held of an agent whose metadata it failed to load (e.g. changed keys for
    a span it already holds: NIXL_ERR_NOT_ALLOWED), so no later WRITE could start: the sender
    fails its requests, turns broken (its owner connects a new one) and closes its link, so decode
    forgets its agent."""
    sender = pair.sender

    def refuse(metadata: bytes) -> str:
        raise RuntimeError("NIXL_ERR_NOT_ALLOWED")

    sender._agent.add_remote_agent = refuse  # type: ignore[attr-defined]
    pair.receiver.expect("r", [2, 3], "t")
    sender.send_layer("r", 0, [1, 2], [2, 3], token="t")
    with pytest.raises(KVTransferError, match="could not load the NIXL metadata"):
        asyncio.run(sender.flush("r", TIMEOUT_S))
    assert "could not load the NIXL metadata" in sender.broken
    deadline = time.monotonic() + TIMEOUT_S
    while pair.receiver._io.call(lambda: bool(pair.receiver._peers)) and time.monotonic() < deadline:  # type: ignore[attr-defined]
        time.sleep(0.02)
    assert not pair.receiver._io.call(lambda: bool(pair.receiver._peers))  # type: ignore[attr-defined]
    assert pair.untouched(list(range(SPEC.num_blocks)))


def test_a_sender_holding_too_much_grant_metadata_is_replaced_once_its_requests_are_through(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """NIXL keeps every grant's metadata a prefill agent loaded: past a bound the sender is worn,
    and SenderPool sends new requests through a new one (new agent) and closes the old one once
    nothing of it is pending."""
    from pdserve.disagg.transport.nixl import sender as nixl_sender
    from pdserve.disagg.worker.sender_pool import SenderPool

    monkeypatch.setattr(nixl_sender, "MAX_LOADED_METADATA_BYTES", 0)
    pool = SPEC.pool(1)
    receiver = make_receiver("nixl", SPEC.layout(pool), pool, peers=KVPeerPolicy(SECRET))
    src = SPEC.pool(2)
    senders = SenderPool("nixl", SPEC.layout(src), src, secret=SECRET)
    try:
        first = senders.get(receiver.address)
        for rid, dst in (("a", [3, 4]), ("b", [5, 6])):
            sender = senders.get(receiver.address)
            receiver.expect(rid, dst, rid)
            for layer in range(SPEC.num_layers):
                sender.send_layer(rid, layer, [1, 2], dst, token=rid)
            sender.send_done(rid, record(1), token=rid)
            asyncio.run(sender.flush(rid, TIMEOUT_S))
            assert isinstance(asyncio.run(drain(receiver, rid))[-1], KVDone)
            assert (sender is first) == (rid == "a") and not sender.broken
        assert first.worn and first.broken == "" and senders.connected(receiver.address) is None
        senders.get(receiver.address)  # closes the retired one: nothing of it is pending
        assert not first._io.running  # type: ignore[attr-defined]
        assert torch.equal(pool[:, :, [3, 4]], src[:, :, [1, 2]]) and torch.equal(pool[:, :, [5, 6]], src[:, :, [1, 2]])
        assert registrations(receiver) == 0
    finally:
        senders.close()
        receiver.close()
