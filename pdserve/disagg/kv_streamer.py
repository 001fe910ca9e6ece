"""Prefill role: turns "layer l of this step's chunks is computed" into per-layer block sends,
so layer l's KV is on the wire while layer l+1 computes, chunk after chunk.

For each request it streams blocks from the first block the decode worker does not already hold
(its prefix cache) up to the last token computed so far. A block that a chunk leaves half full is
sent again, completed, with the next chunk:

    tokens            0 ............ 47 | 48 ......... 95 | 96 ... 120
    decode cached     [block 0, 1, 2 ]                                    (never sent)
    step 1 (chunk)                       [block 3, 4, 5 ]                 all layers, layer by layer
    step 2 (chunk)                                        [block 6, 7]    ...
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.engine.scheduler import ScheduledChunk

# (request id, layer, source block ids in this pool, destination block ids in the decode pool)
SendLayer = Callable[[str, int, list[int], list[int]], None]


@dataclass(slots=True)
class _Target:
    dst_block_ids: tuple[int, ...]
    sent_tokens: int  # tokens whose KV (all layers) has been handed to the transport
    send_layer: SendLayer  # to the request's decode worker


class KVStreamer:
    """An `LLMEngine.layer_observer` for the prefill role. Engine thread only: `expect` and `forget`
    are called there too (between steps), so a request's target never changes mid-step."""

    def __init__(self, block_size: int, num_layers: int, send_layer: SendLayer | None = None) -> None:
        """`send_layer`: where requests go unless `expect` names their own (one decode peer)."""
        self.block_size = block_size
        self.last_layer = num_layers - 1
        self.send_layer = send_layer
        self._targets: dict[str, _Target] = {}

    def expect(self, request_id: str, dst_block_ids: Sequence[int], num_cached_on_decode: int,
               send_layer: SendLayer | None = None) -> None:
        """Stream `request_id` into `dst_block_ids` through `send_layer` (default: the streamer's),
        skipping the first `num_cached_on_decode` tokens (a multiple of the block size) that the
        decode worker already holds."""
        if num_cached_on_decode % self.block_size:
            raise ValueError("the decode worker's cached prefix must be whole blocks")
        send = send_layer or self.send_layer
        if send is None:
            raise ValueError(f"request {request_id}: no KV destination (pass send_layer)")
        self._targets[request_id] = _Target(tuple(dst_block_ids), num_cached_on_decode, send)

    def forget(self, request_id: str) -> None:
        self._targets.pop(request_id, None)

    def __call__(self, layer: int, chunks: list[ScheduledChunk]) -> None:
        for chunk in chunks:
            request = chunk.request
            target = self._targets.get(request.request_id)
            if target is None:
                continue
            computed_end = request.num_computed_tokens + chunk.num_new_tokens
            first = target.sent_tokens // self.block_size
            last = (computed_end - 1) // self.block_size
            if last >= first:
                target.send_layer(request.request_id, layer, request.block_ids[first:last + 1],
                                  list(target.dst_block_ids[first:last + 1]))
            if layer == self.last_layer:
                target.sent_tokens = computed_end
