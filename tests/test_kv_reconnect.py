"""A prefill worker's `SenderPool` reaches a decode worker that restarted on the same KV address:
the broken sender's attempts fail, the next `get` handshakes again and the KV lands bit for bit,
over tcp (its connection) and over nixl (the handshake socket held open as a liveness link; the
restarted worker is a new NIXL agent). (The same through real worker processes: test_worker_loss.py.)"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from kv_transport_helpers import PoolSpec, record

from pdserve.disagg.transport import (
    KVDone,
    KVProgress,
    KVReceiver,
    KVSender,
    KVTransferError,
    make_receiver,
    make_sender,
    nixl_available,
)
from pdserve.disagg.worker.sender_pool import SenderPool

SPEC = PoolSpec()
TIMEOUT_S = 10.0


def hand_off(receiver: KVReceiver, sender: KVSender, rid: str, src: list[int], dst: list[int]) -> None:
    """One whole request: every layer, then the final message; both sides see it complete."""
    receiver.expect(rid, dst)
    for layer in range(SPEC.num_layers):
        sender.send_layer(rid, layer, src, dst)
    sender.send_done(rid, record(7))

    async def finish() -> list[object]:
        await sender.flush(rid, TIMEOUT_S)
        events = [await receiver.wait(rid, TIMEOUT_S)]
        while isinstance(events[-1], KVProgress):
            events.append(await receiver.wait(rid, TIMEOUT_S))
        return events

    assert asyncio.run(finish())[-1] == KVDone(rid, record(7))


def wait_broken(sender: KVSender) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not sender.broken:
        assert time.monotonic() < deadline, "the sender never noticed its receiver was gone"
        time.sleep(0.01)


TRANSPORTS = ["tcp", pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(), reason="no nixl_cu12"))]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_receiver_restarted_on_the_same_port_is_reached_again(transport: str) -> None:
    decode_pool, prefill_pool = SPEC.pool(1), SPEC.pool(2)
    receiver = make_receiver(transport, SPEC.layout(decode_pool), decode_pool)
    address = receiver.address
    senders = SenderPool(transport, SPEC.layout(prefill_pool), prefill_pool)
    try:
        assert senders.connected(address) is None  # never connected: only `get` connects
        first = senders.get(address)
        assert senders.connected(address) is first  # live: handed out without blocking
        hand_off(receiver, first, "a", [0, 1], [2, 3])
        receiver.close()  # the decode worker dies: its connections close with it
        wait_broken(first)
        assert senders.connected(address) is None  # broken: `get` must replace it
        first.send_layer("lost", 0, [4], [5])  # an attempt on the dead connection fails as before
        with pytest.raises(KVTransferError, match="lost"):
            asyncio.run(first.flush("lost", TIMEOUT_S))

        port = int(address.rsplit(":", 1)[1])
        decode_pool = SPEC.pool(3)
        receiver = make_receiver(transport, SPEC.layout(decode_pool), decode_pool, port=port)
        assert receiver.address == address
        second = senders.get(address)
        assert second is not first and not second.broken
        hand_off(receiver, second, "b", [6, 7], [8, 9])
        for src, dst in ((6, 8), (7, 9)):
            assert torch.equal(decode_pool[:, :, dst], prefill_pool[:, :, src])
        assert senders.get(address) is second  # a live sender is kept
        assert senders.connected(address) is second
        assert receiver.reserved_request_ids() == frozenset()
        assert second.pending_request_ids() == frozenset()
    finally:
        senders.close()
        receiver.close()


@pytest.mark.skipif(not nixl_available(), reason="no nixl_cu12")
def test_nixl_decode_forgets_a_prefill_agent_whose_link_closed() -> None:
    """A prefill worker that goes away (here: its sender closes its end of the link) leaves no
    NIXL agent, grant or connection slot behind on decode; a new one is served as before."""
    decode_pool = SPEC.pool(1)
    receiver = make_receiver("nixl", SPEC.layout(decode_pool), decode_pool)
    try:
        for attempt in range(2):
            prefill_pool = SPEC.pool(2 + attempt)
            sender = make_sender("nixl", SPEC.layout(prefill_pool), prefill_pool)
            sender.connect(receiver.address)
            hand_off(receiver, sender, f"r{attempt}", [0, 1], [2 + attempt, 4 + attempt])
            assert len(receiver._peers) == 1 and receiver.gate.num_connections == 1  # type: ignore[attr-defined]
            sender.close()
            deadline = time.monotonic() + TIMEOUT_S
            while receiver._peers or receiver.gate.num_connections:  # type: ignore[attr-defined]
                assert time.monotonic() < deadline, "decode kept the closed prefill agent"
                time.sleep(0.01)
    finally:
        receiver.close()
