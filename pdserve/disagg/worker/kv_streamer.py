"""Prefill role: turns "layer l of this step's chunks is computed" into per-layer block sends,
so layer l's KV is on the wire while layer l+1 computes, chunk after chunk.

For each request it streams blocks from the first block the decode worker does not already hold
(its prefix cache) up to the last token computed so far. A block that a chunk leaves half full is
sent again, completed, with the next chunk:

    tokens            0 ............ 47 | 48 ......... 95 | 96 ... 120
    decode cached     [block 0, 1, 2 ]                                    (never sent)
    step 1 (chunk)                       [block 3, 4, 5 ]                 all layers, layer by layer
    step 2 (chunk)                                        [block 6, 7]    ...

A job sent before its decode reservation was made (the router reserves and dispatches at once)
has no destination yet: its layers are not sent as they are computed, and `place` (on the engine
thread, between steps) sends every layer computed so far once the reservation is known; later
steps stream as usual.

Every send carries the layer's `ready` event (transport/ready.py), recorded on the compute stream
right after the layer: the layer callback runs once its kernels are launched, not done, so a
sender that reads the device pool from its own thread (a NIXL WRITE from VRAM) waits on it first.

A small step holds its layers instead (`small_blocks`): a request whose step sends at most that
many blocks a layer sends every layer at the end of the last one, in one burst while the
vocabulary projection runs. Layer by layer, each send woke the transport's thread mid-forward,
which took the GIL from the engine thread: a tiny model's 4-token prefill step took 10-11 ms
instead of 7 here, for KV that moves in well under a millisecond anyway.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.disagg.transport.ready import NO_WAIT, LayerReady
from pdserve.disagg.transport.sender_base import KVSender
from pdserve.engine.request import Request
from pdserve.engine.scheduler_output import ScheduledChunk

# (request id, layer, source block ids in this pool, destination block ids in the decode pool, the
# layer's end on the compute stream: what a sender waits for before it reads those blocks there)
SendLayer = Callable[[str, int, list[int], list[int], LayerReady], None]
_Send = tuple[SendLayer, str, int, list[int], list[int], LayerReady]  # a `send_layer` call and its arguments
# A step's KV below this (all layers) goes in one burst after its last layer (module docstring)
SMALL_STEP_KV_BYTES = 1 << 21


def small_step_blocks(block_bytes_per_layer: int, num_layers: int) -> int:
    """Blocks a layer that a step may send and still be held for one burst (`KVStreamer.small_blocks`)."""
    return SMALL_STEP_KV_BYTES // max(1, block_bytes_per_layer * num_layers)


@dataclass(frozen=True, slots=True)
class KVDestination:
    """A `SendLayer` into one decode reservation: the sender to its decode worker (at `address`)
    and the reservation's token. The ranks of a tensor-parallel prefill worker each send their own
    heads to the same address with the same token (rank_streaming.py)."""

    sender: KVSender
    address: str
    token: str

    def __call__(self, request_id: str, layer: int, src_block_ids: list[int], dst_block_ids: list[int],
                 ready: LayerReady = NO_WAIT) -> None:
        self.sender.send_layer(request_id, layer, src_block_ids, dst_block_ids, ready, token=self.token)


@dataclass(slots=True)
class _Target:
    dst_block_ids: tuple[int, ...]
    sent_tokens: int  # tokens whose KV (all layers) has been handed to the transport
    send_layer: SendLayer | None  # to the request's decode worker (None: not placed yet)


class KVStreamer:
    """An `LLMEngine.layer_observer` for the prefill role. Engine thread only: `expect` and `forget`
    are called there too (between steps), so a request's target never changes mid-step."""

    def __init__(self, block_size: int, num_layers: int, send_layer: SendLayer | None = None,
                 small_blocks: int = 0, ready: Callable[[], LayerReady] | None = None) -> None:
        """`send_layer`: where requests go unless `expect` names their own (one decode peer);
        `small_blocks`: a request's step that sends at most this many blocks a layer sends them all
        after its last layer (0: every step layer by layer); `ready`: records the end of the work
        launched so far on the compute stream (`transport.ready.layer_ready(device)`; default:
        nothing to wait for, CPU)."""
        self.ready = ready or (lambda: NO_WAIT)
        self.block_size = block_size
        self.last_layer = num_layers - 1
        self.send_layer = send_layer
        self.small_blocks = small_blocks
        self._targets: dict[str, _Target] = {}
        self._held: list[_Send] = []  # this step's, in order

    def expect(self, request_id: str, dst_block_ids: Sequence[int] | None, num_cached_on_decode: int = 0,
               send_layer: SendLayer | None = None) -> None:
        """Stream `request_id` into `dst_block_ids` through `send_layer` (default: the streamer's),
        skipping the first `num_cached_on_decode` tokens (a multiple of the block size) that the
        decode worker already holds. `dst_block_ids` None: not placed yet (`place` says where)."""
        # NOTE: checked before the target exists: a refused destination leaves nothing behind
        send = None if dst_block_ids is None else self._destination(request_id, num_cached_on_decode, send_layer)
        self._targets[request_id] = _Target((), 0, None)
        if dst_block_ids is not None:
            self.place(request_id, dst_block_ids, num_cached_on_decode, send)

    def place(self, request_id: str, dst_block_ids: Sequence[int], num_cached_on_decode: int,
              send_layer: SendLayer | None = None, request: Request | None = None) -> bool:
        """Where an expected request's KV goes, from now on; `request` (the engine's, when it
        already computed some of the prompt): every layer of what it computed is sent now.
        Engine thread, between steps. False: the request is not expected (any more)."""
        send = self._destination(request_id, num_cached_on_decode, send_layer)
        target = self._targets.get(request_id)
        if target is None:
            return False
        target.dst_block_ids, target.sent_tokens, target.send_layer = tuple(dst_block_ids), num_cached_on_decode, send
        if request is not None and request.num_computed_tokens > target.sent_tokens:
            computed = request.num_computed_tokens
            first, last = target.sent_tokens // self.block_size, (computed - 1) // self.block_size
            ready = self.ready()  # NOTE: a step that sampled nothing may still be running
            for layer in range(self.last_layer + 1):
                send(request_id, layer, request.block_ids[first:last + 1], list(target.dst_block_ids[first:last + 1]),
                     ready)
            target.sent_tokens = computed
        return True

    def _destination(self, request_id: str, num_cached_on_decode: int, send_layer: SendLayer | None) -> SendLayer:
        """The send of a request's KV (ValueError: a cached prefix that is no whole blocks, or nowhere to send)."""
        if num_cached_on_decode % self.block_size:
            raise ValueError("the decode worker's cached prefix must be whole blocks")
        send = send_layer or self.send_layer
        if send is None:
            raise ValueError(f"request {request_id}: no KV destination (pass send_layer)")
        return send

    def forget(self, request_id: str) -> None:
        self._targets.pop(request_id, None)

    def has_target(self, request_id: str) -> bool:
        """The request is expected here (placed or not)."""
        return request_id in self._targets

    def __call__(self, layer: int, chunks: list[ScheduledChunk]) -> None:
        ready: LayerReady | None = None  # recorded at the first send of this layer
        for chunk in chunks:
            request = chunk.request
            target = self._targets.get(request.request_id)
            if target is None or target.send_layer is None:
                continue
            computed_end = request.num_computed_tokens + chunk.num_new_tokens
            first = target.sent_tokens // self.block_size
            last = (computed_end - 1) // self.block_size
            if last >= first:
                ready = ready or self.ready()
                send: _Send = (target.send_layer, request.request_id, layer, request.block_ids[first:last + 1],
                               list(target.dst_block_ids[first:last + 1]), ready)
                if last - first < self.small_blocks and layer < self.last_layer:
                    self._held.append(send)
                else:
                    if layer == self.last_layer:
                        self._release_held(request.request_id)
                    send[0](*send[1:])
            if layer == self.last_layer:
                target.sent_tokens = computed_end
        if layer == self.last_layer and self._held:  # NOTE: a request forgotten mid-step: nothing to send
            self._held.clear()

    def _release_held(self, request_id: str) -> None:
        """Send the layers held for `request_id` this step, in order (before its last layer)."""
        mine = [send for send in self._held if send[1] == request_id]
        if mine:
            self._held = [send for send in self._held if send[1] != request_id]
            for send in mine:
                send[0](*send[1:])
