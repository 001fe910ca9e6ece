"""A decode worker whose tensor-parallel ranks each have a KV pool of their own (CUDA; CPU with
PDSERVE_TP_RANK_POOLS=1) receives on every rank: its KV address lists one receiver per rank,
rank 0's first ("tcp://h:5000,tcp://h:5001"). A prefill pool (a worker's, or one of its ranks')
sends each decode rank exactly the heads both hold, over a connection of its own:

    prefill TP=1 (heads 0-3)  --heads 0-1-->  decode rank 0 (heads 0-1)
                              --heads 2-3-->  decode rank 1 (heads 2-3)
    prefill TP=2, rank 1 (heads 2-3) --heads 2-3--> decode TP=1 (heads 0-3)   (kv_streamer: rank_streaming.py)

Every link carries one payload per `send_layer`, so the final message (one, to decode rank 0,
from prefill rank 0) announces `links x` its own count (`count_links`, `KVSender.copies`); decode
rank 0 counts what every one of its ranks admitted (disagg/worker/rank_receiving.py) before it completes
the request.
"""

from __future__ import annotations

from typing import Any

import torch

from pdserve.disagg.kv_layout import KVLayout
from pdserve.disagg.transport.ready import NO_WAIT, LayerReady
from pdserve.disagg.transport.sender_base import KVSender
from pdserve.model.parallel import kv_head_range

HeadRange = tuple[int, int]  # [first, end) of a model's KV heads


def split_address(address: str) -> list[str]:
    """A KV address's receivers, one per decode rank (one for a worker with one pool)."""
    return address.split(",")


def overlap(a: HeadRange, b: HeadRange) -> HeadRange | None:
    first, end = max(a[0], b[0]), min(a[1], b[1])
    return (first, end) if first < end else None


def decode_heads(num_decode_ranks: int, num_kv_heads: int) -> list[HeadRange]:
    """Each decode rank's heads; one receiver (a single pool) holds them all."""
    return [kv_head_range(rank, num_decode_ranks, num_kv_heads) for rank in range(num_decode_ranks)]


def count_links(sending: list[HeadRange], num_decode_ranks: int, num_kv_heads: int) -> int:
    """How many connections carry each layer of a request from the prefill pools that hold
    `sending` (one range per sending rank) into a decode worker with `num_decode_ranks` receivers."""
    return sum(overlap(mine, theirs) is not None for mine in sending
               for theirs in decode_heads(num_decode_ranks, num_kv_heads))


class RankedKVSender(KVSender):
    """Sends one prefill pool's KV to a decode worker with a receiver per rank: a sender per decode
    rank that holds some of this pool's heads (`make_sender` over a view of those heads; a view
    that is not contiguous, some heads of each token's row, tcp gathers and nixl writes row by
    row). Contract: KVSender's; the final message goes to decode rank 0, and `flush` waits for its
    acknowledgement, which decode gives only once every rank received everything."""

    def __init__(self, transport: str, layout: KVLayout, kv_cache: torch.Tensor, num_kv_heads: int,
                 **options: Any) -> None:
        super().__init__(layout, kv_cache)
        self.transport, self.num_kv_heads, self.options = transport, num_kv_heads, options
        self.links: list[tuple[int, KVSender]] = []  # (decode rank, its sender)

    def connect(self, address: str) -> None:
        from pdserve.disagg.transport import make_sender

        addresses = split_address(address)
        mine = (self.layout.kv_head_start, self.layout.kv_head_end)
        try:
            for rank, (heads, rank_address) in enumerate(zip(decode_heads(len(addresses), self.num_kv_heads),
                                                             addresses, strict=True)):
                shared = overlap(mine, heads)
                if shared is None:
                    continue
                view = self.kv_cache.narrow(4, shared[0] - mine[0], shared[1] - shared[0])
                sender = make_sender(self.transport, self.layout.with_heads(shared[0], shared[1] - shared[0]), view,
                                     **self.options)
                self.links.append((rank, sender))
                sender.connect(rank_address)
        except BaseException:
            self.close()
            raise

    def send_layer(self, request_id: str, layer: int, src_block_ids: list[int], dst_block_ids: list[int],
                   ready: LayerReady = NO_WAIT, *, token: str = "") -> None:
        for _, sender in self.links:
            sender.send_layer(request_id, layer, src_block_ids, dst_block_ids, ready, token=token)

    def send_done(self, request_id: str, record: bytes, *, token: str = "") -> None:
        rank0 = self._rank0()
        rank0.copies = self.copies
        rank0.send_done(request_id, record, token=token)

    async def flush(self, request_id: str, timeout_s: float) -> None:
        try:
            await self._rank0().flush(request_id, timeout_s)
        finally:
            for rank, sender in self.links:
                if rank != 0:
                    sender.forget(request_id)  # NOTE: decode rank 0's answer covered them

    async def release(self, request_id: str) -> None:
        for _, sender in self.links:
            await sender.release(request_id)

    def release_blocking(self, request_id: str) -> None:
        for _, sender in self.links:
            sender.release_blocking(request_id)

    def forget(self, request_id: str) -> None:
        for _, sender in self.links:
            sender.forget(request_id)

    def close(self) -> None:
        for _, sender in self.links:
            sender.close()

    @property
    def broken(self) -> str:
        return next((f"to decode rank {rank}: {s.broken}" for rank, s in self.links if s.broken), "")

    @property
    def worn(self) -> bool:
        return any(sender.worn for _, sender in self.links)

    def pending_request_ids(self) -> frozenset[str]:
        return frozenset().union(*(sender.pending_request_ids() for _, sender in self.links))

    def _rank0(self) -> KVSender:
        if not self.links or self.links[0][0] != 0:
            raise ValueError("only a pool holding some of decode rank 0's heads sends the final message")
        return self.links[0][1]
