"""The KV hand-off of part of a pool's heads (prefill TP below decode TP with a pool per rank)
against whole pools, at the transport level.

    python -m pdserve.bench.kv_head_views [--transports tcp,nixl] [--tokens 1024] [--reps 8]

One request's KV (`--tokens` tokens, a Qwen3-8B-like layer shape: 28 layers, head_dim 128,
bfloat16, block 16) sent layer by layer, then the final message, timed until `flush` returns
(decode acknowledged everything), in one process over loopback, to a receiver that holds exactly
the heads sent. Three rows per transport: a whole 4-head pool, a whole 2-head pool (the same bytes
as the last row), and 2 of a 4-head pool's heads (a pool view, not contiguous in its blocks: tcp
gathers it into the frame, nixl writes each token's row of those heads). Median over `--reps`
after 2 warm-up sends; every receiver's blocks must then equal the sender's.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import time

import torch

from pdserve.disagg.handoff import HandOffDone
from pdserve.disagg.kv_layout import KVLayout
from pdserve.disagg.transport import KVDone, make_receiver, make_sender, nixl_available

NUM_LAYERS, BLOCK_SIZE, HEAD_DIM = 28, 16, 128
_WARMUP = 2


def _pool(num_heads: int, num_blocks: int) -> torch.Tensor:
    return torch.randn(NUM_LAYERS, 2, num_blocks, BLOCK_SIZE, num_heads, HEAD_DIM, dtype=torch.bfloat16)


def _layout(pool: torch.Tensor) -> KVLayout:
    return KVLayout.from_pool("bench", pool, strided=True)


def _send(transport: str, src: torch.Tensor, dst: torch.Tensor, num_blocks: int, reps: int) -> float:
    """Median ms of one request's hand-off from `src` into `dst` (same heads, same blocks)."""
    receiver = make_receiver(transport, dataclasses.replace(_layout(dst), tp_size=2), dst)
    sender = make_sender(transport, _layout(src), src)
    block_ids = list(range(num_blocks))
    times = []
    try:
        sender.connect(receiver.address)
        for rep in range(_WARMUP + reps):
            request_id = f"r{rep}"
            receiver.expect(request_id, block_ids, "t")
            start = time.perf_counter()
            for layer in range(NUM_LAYERS):
                sender.send_layer(request_id, layer, block_ids, block_ids, token="t")
            sender.send_done(request_id, HandOffDone(0).encode(), token="t")
            asyncio.run(sender.flush(request_id, 60.0))
            times.append(time.perf_counter() - start)
            asyncio.run(_until_done(receiver, request_id))
        if not torch.equal(dst[:, :, :num_blocks], src[:, :, :num_blocks]):
            raise AssertionError(f"{transport}: the receiver's blocks differ from the sender's")
    finally:
        sender.close()
        receiver.close()
    return 1000 * statistics.median(times[_WARMUP:])


async def _until_done(receiver: object, request_id: str) -> None:
    while not isinstance(await receiver.wait(request_id, 60.0), KVDone):  # type: ignore[attr-defined]
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transports", default="tcp,nixl")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=8)
    args = parser.parse_args()
    num_blocks = -(-args.tokens // BLOCK_SIZE)
    print(f"{args.tokens} tokens, {NUM_LAYERS} layers, head_dim {HEAD_DIM}, bfloat16, block {BLOCK_SIZE}, "
          f"torch {torch.__version__}; median of {args.reps} sends after {_WARMUP}")
    print("| transport | whole pool, 4 heads | whole pool, 2 heads | 2 of 4 heads, a pool view "
          "| view / whole 2 heads |")
    print("|---|---|---|---|---|")
    for transport in args.transports.split(","):
        if transport == "nixl" and not nixl_available():
            print("| nixl | not installed | | | |")
            continue
        whole4 = _send(transport, _pool(4, num_blocks), _pool(4, num_blocks), num_blocks, args.reps)
        whole2 = _send(transport, _pool(2, num_blocks), _pool(2, num_blocks), num_blocks, args.reps)
        view = _send(transport, _pool(4, num_blocks).narrow(4, 0, 2), _pool(2, num_blocks), num_blocks, args.reps)
        print(f"| {transport} | {whole4:.1f} ms | {whole2:.1f} ms | {view:.1f} ms | {view / whole2:.2f}x |")


if __name__ == "__main__":
    main()
