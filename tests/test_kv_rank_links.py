"""The KV hand-off between workers whose tensor-parallel ranks each have a pool of their own, at
the transport level (one process; the served paths are in test_tensor_parallel.py): a decode pool
takes each rank's heads from that rank's sender, rank 0's final message waits for the other
ranks' layers, a rank's rejected payload ends the request at once, a prefill pool sends each decode
rank the heads both hold, and pools whose heads cannot be mapped are refused naming the field."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from kv_transport_helpers import PoolSpec, record

from pdserve.disagg.handoff import HandOffDone
from pdserve.disagg.kv_layout import KVLayout, KVLayoutMismatch
from pdserve.disagg.transport import (
    KVDone,
    KVProgress,
    KVReceiver,
    KVRejected,
    KVSender,
    KVTransferError,
    make_receiver,
    make_sender,
    nixl_available,
)
from pdserve.disagg.transport.ranked import RankedKVSender, count_links

NIXL = pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(), reason="nixl_cu12 is not installed"))
TRANSPORTS = ["tcp", NIXL]
SPEC = PoolSpec(num_kv_heads=4)
RANK_SPEC = SPEC.with_(num_kv_heads=2)
SRC, DST = [3, 7, 1], [5, 2, 9]
TIMEOUT_S = 10.0


def rank_layout(pool: torch.Tensor, first_head: int, tp_size: int = 2) -> KVLayout:
    return dataclasses.replace(KVLayout.from_pool(SPEC.model_id, pool, tp_size=tp_size), kv_head_start=first_head)


async def events_until_last(receiver: KVReceiver, request_id: str) -> list[object]:
    events: list[object] = []
    while not events or isinstance(events[-1], KVProgress):
        events.append(await receiver.wait(request_id, TIMEOUT_S))
    return events


def send_all_layers(sender: KVSender, request_id: str = "r", dst: list[int] = DST) -> None:
    for layer in range(SPEC.num_layers):
        sender.send_layer(request_id, layer, SRC, dst, token="t")


def assert_heads_landed(decode: torch.Tensor, prefill: torch.Tensor, first_head: int) -> None:
    heads = decode[:, :, DST].narrow(4, first_head, prefill.shape[4])
    assert torch.equal(heads, prefill[:, :, SRC])


@contextmanager
def two_prefill_ranks(transport: str) -> Iterator[tuple[KVReceiver, torch.Tensor, list[torch.Tensor], list[KVSender]]]:
    """Prefill TP=2 with a pool per rank, each rank's sender connected to one decode pool of every
    head; rank 0 announces both ranks' payloads; request "r" is expected on DST with token "t"."""
    decode, ranks = SPEC.pool(1), [RANK_SPEC.pool(2), RANK_SPEC.pool(3)]
    receiver = make_receiver(transport, SPEC.layout(decode), decode)
    senders = [make_sender(transport, rank_layout(pool, 2 * rank), pool) for rank, pool in enumerate(ranks)]
    try:
        for sender in senders:
            sender.connect(receiver.address)
        senders[0].copies = 2
        receiver.expect("r", DST, "t")
        yield receiver, decode, ranks, senders
    finally:
        for sender in senders:
            sender.close()
        receiver.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_each_prefill_rank_sends_its_heads_and_the_final_message_waits_for_the_other_rank(transport: str) -> None:
    """Prefill TP=2, a pool per rank -> decode with one pool: rank 0's final message (announcing
    both ranks' payloads) arrives before rank 1's layers and is answered only once they landed."""
    before = SPEC.pool(1)
    with two_prefill_ranks(transport) as (receiver, decode, (rank0, rank1), senders):
        send_all_layers(senders[0])
        senders[0].send_done("r", record(42), token="t")
        with pytest.raises(KVTransferError, match="no progress"):  # nothing answers it before rank 1's layers
            asyncio.run(senders[0].flush("r", 0.5))
        send_all_layers(senders[1])
        events = asyncio.run(events_until_last(receiver, "r"))
        assert isinstance(events[-1], KVDone) and HandOffDone.decode(events[-1].record).first_token_id == 42
        assert sum(isinstance(e, KVProgress) for e in events) == 2 * SPEC.num_layers
        assert_heads_landed(decode, rank0, 0)
        assert_heads_landed(decode, rank1, 2)
        untouched = torch.ones(SPEC.num_blocks, dtype=torch.bool)
        untouched[DST] = False
        assert torch.equal(decode[:, :, untouched], before[:, :, untouched])
        senders[1].release_blocking("r")
        assert receiver.reserved_request_ids() == frozenset()
        assert all(s.pending_request_ids() == frozenset() for s in senders)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_payload_another_rank_gets_rejected_ends_the_waiting_final_message_at_once(transport: str) -> None:
    with two_prefill_ranks(transport) as (receiver, _, _, senders):
        send_all_layers(senders[0])
        senders[0].send_done("r", record(42), token="t")
        for _ in range(SPEC.num_layers):  # rank 0's layers landed; its final message waits right behind them
            assert isinstance(asyncio.run(receiver.wait("r", TIMEOUT_S)), KVProgress)
        time.sleep(0.2)
        senders[1].send_layer("r", 0, SRC, [5, 2, 10], token="t")  # block 10 is not reserved
        with pytest.raises(KVTransferError, match="not reserved"):
            asyncio.run(senders[0].flush("r", TIMEOUT_S))
        assert isinstance(asyncio.run(events_until_last(receiver, "r"))[-1], KVRejected)
        senders[1].release_blocking("r")
        assert receiver.reserved_request_ids() == frozenset()


def test_a_pool_holding_heads_the_decode_pool_lacks_is_refused_by_name_on_both_sides() -> None:
    decode_rank1, prefill = RANK_SPEC.pool(1), SPEC.pool(2)
    receiver = make_receiver("tcp", rank_layout(decode_rank1, 2), decode_rank1)
    sender = make_sender("tcp", SPEC.layout(prefill), prefill)
    try:
        with pytest.raises(KVLayoutMismatch, match=r"prefill holds KV heads \[0, 4\), not within decode's \[2, 4\)"
                           ) as refused:
            sender.connect(receiver.address)
        assert refused.value.field == "kv_head_start"
        assert [r.field for r in receiver.refusals] == ["kv_head_start"]
    finally:
        sender.close()
        receiver.close()


class _OtherRanks:
    """Rank 0's view of decode rank 1, in one process: what rank_receiving.py does over links."""

    def __init__(self, rank0: KVReceiver, rank1: KVReceiver) -> None:
        self.rank1 = rank1
        self.addresses = [rank1.address]
        rank1.on_admitted = rank0.remote_admitted
        rank1.on_rejected = rank0.remote_rejected

    def expect(self, request_id: str, block_ids: list[int] | tuple[int, ...], token: str) -> None:
        self.rank1.expect(request_id, block_ids, token)

    def cancel(self, request_id: str) -> None:
        self.rank1.cancel(request_id)

    def end(self, request_id: str) -> None:
        self.rank1.cancel(request_id)


@pytest.mark.parametrize("prefill_ranks", [1, 2])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_prefill_pool_sends_each_decode_rank_the_heads_both_hold(transport: str, prefill_ranks: int) -> None:
    """Decode TP=2 with a pool per rank: rank 0 counts rank 1's payloads before it completes.
    A single 4-head pool sends part of itself to each decode rank (tcp gathers those heads, nixl
    writes each token's row of them); prefill ranks of TP=2 send rank to rank."""
    decode = [RANK_SPEC.pool(1), RANK_SPEC.pool(4)]
    receivers = [make_receiver(transport, rank_layout(pool, 2 * rank), pool) for rank, pool in enumerate(decode)]
    receivers[0].ranks = _OtherRanks(receivers[0], receivers[1])
    whole = SPEC.pool(2)
    senders: list[RankedKVSender] = []
    try:
        address = receivers[0].kv_address
        assert address.split(",") == [receivers[0].address, receivers[1].address]
        if prefill_ranks == 1:
            senders = [RankedKVSender(transport, SPEC.layout(whole), whole, SPEC.num_kv_heads)]
            sources = [whole.narrow(4, 0, 2), whole.narrow(4, 2, 2)]
        else:
            sources = [RANK_SPEC.pool(2), RANK_SPEC.pool(3)]
            senders = [RankedKVSender(transport, rank_layout(pool, 2 * rank), pool, SPEC.num_kv_heads)
                       for rank, pool in enumerate(sources)]
        for sender in senders:
            sender.connect(address)
            assert [rank for rank, _ in sender.links] == ([0, 1] if len(senders) == 1 else [senders.index(sender)])
        senders[0].copies = count_links([(s.layout.kv_head_start, s.layout.kv_head_end) for s in senders], 2, 4)
        assert senders[0].copies == 2
        receivers[0].expect("r", DST, "t")
        for sender in reversed(senders):
            send_all_layers(sender)
        senders[0].send_done("r", record(7), token="t")
        asyncio.run(senders[0].flush("r", TIMEOUT_S))
        events = asyncio.run(events_until_last(receivers[0], "r"))
        assert isinstance(events[-1], KVDone) and HandOffDone.decode(events[-1].record).first_token_id == 7
        for pool, source in zip(decode, sources, strict=True):
            assert torch.equal(pool[:, :, DST], source[:, :, SRC])
        for sender in senders[1:]:
            sender.release_blocking("r")
        assert all(r.reserved_request_ids() == frozenset() for r in receivers)
        assert all(s.pending_request_ids() == frozenset() for s in senders)
    finally:
        for sender in senders:
            sender.close()
        for receiver in receivers:
            receiver.close()


@pytest.mark.parametrize(("sending", "decode_ranks", "heads", "links"), [
    ([(0, 8)], 1, 8, 1),                                  # no tensor parallelism
    ([(0, 2), (2, 4), (4, 6), (6, 8)], 1, 8, 4),          # the seed's prefill TP=4 -> decode TP=1
    ([(0, 4)], 2, 4, 2),                                  # TP=1 -> TP=2: one pool, two receivers
    ([(0, 2), (2, 4)], 2, 4, 2),                          # TP=2 -> TP=2: rank to rank
    ([(0, 1), (1, 2)], 4, 2, 4),                          # TP=4 with 2 KV heads on each side (replicas)
    ([(0, 4), (4, 8)], 4, 8, 4),                          # TP=2 -> TP=4
])
def test_links_per_layer(sending: list[tuple[int, int]], decode_ranks: int, heads: int, links: int) -> None:
    assert count_links(sending, decode_ranks, heads) == links


def test_the_head_view_benchmark_runs_and_checks_what_landed(capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """`python -m pdserve.bench.kv_head_views`, tiny: a row per transport, each send verified."""
    from pdserve.bench import kv_head_views

    transports = "tcp,nixl" if nixl_available() else "tcp"
    monkeypatch.setattr("sys.argv", ["kv_head_views", "--tokens", "32", "--reps", "1", "--transports", transports])
    kv_head_views.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| tcp", "| nixl"))]
    assert [row.split("|")[1].strip() for row in rows] == transports.split(",")
    assert all(row.rstrip(" |").endswith("x") for row in rows), rows
