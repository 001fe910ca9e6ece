"""The prefill side of the KV transport interface (base.py has the picture and the receiver)."""

from __future__ import annotations

import abc
import asyncio
import threading
import time
from collections import OrderedDict

import torch

from pdserve.disagg.kv_layout import KVLayout, KVLayoutMismatch
from pdserve.disagg.transport.base import check_pool
from pdserve.disagg.transport.errors import KVTransferError
from pdserve.disagg.transport.messages import Ack, LayerHeader, Reject, Welcome
from pdserve.disagg.transport.progress import AckTracker
from pdserve.disagg.transport.ready import NO_WAIT, LayerReady

_MAX_ABANDONED_KEPT = 4096
_RELEASE_TIMEOUT_S = 30.0
_RELEASE_POLL_S = 0.001


class KVSender(abc.ABC):
    """Prefill side: pushes layers of KV from the local pool into a decode worker's reservation.

    Contract
    - One sender talks to one receiver: `connect(address)` (blocking, any thread except the
      sender's own I/O thread) performs the handshake; both sides compare KVLayout and a mismatch
      raises KVLayoutMismatch naming the field, here and on the receiver (`receiver.refusals`).
    - `send_layer(request_id, layer, src_block_ids, dst_block_ids, ready)` is called by the prefill
      engine's thread right after `layer` was launched; it returns at once and the bytes move on
      the transport's I/O thread while later layers compute. `ready` (ready.py) marks the end of
      the layer on the compute stream: a sender that reads the device pool from another thread or
      stream waits on it before it posts the read (never on the engine's thread). Calls for one request come in layer
      order, then one `send_done(request_id, record)`: `record` is the encoded hand-off record
      (disagg/handoff.py: first token, generator state, ...), which the transport carries as
      opaque bytes, never reading it, and the receiver delivers as `KVDone.record`. Both calls
      carry the reservation's `token` (ReserveReply.token), without which decode refuses them.
    - Memory: the sender reads `src_block_ids` of its pool after `send_layer` returns, until
      `flush(request_id)` returns or raises; the caller keeps those blocks unchanged until then.
    - `send_layer` checks only that it can read its own source blocks (ValueError otherwise).
      Everything about the destination (reservation, byte count, dtype, shape) is judged by the
      receiver, the only side that knows the reservation; a rejection surfaces from `flush`.
    - `flush(request_id, timeout_s)` is a coroutine, usable from any loop and thread: it returns
      once everything sent for the request was acknowledged by the receiver (if `send_done` was
      called the request is then forgotten); raises KVTransferError on a rejection or a broken
      connection, KVTransferTimeout when no acknowledgement arrived for `timeout_s`.
    - `release(request_id)` is a coroutine the caller awaits before it frees (and may reuse) the
      request's source blocks, after `flush` raised or when it gives up on a request: sends of
      the request that have not started never will (nor will its final message, so decode never
      completes a request whose KV may be partial), and it returns once no send is reading those
      blocks. After a successful `flush` it returns at once.
    - `close()` stops the I/O thread; outstanding requests fail.
    - `copies`: how many senders send each layer payload this one sends, each with KV heads of its
      own (the ranks of a tensor-parallel prefill worker with a pool per rank, all into the same
      reservation; 1 otherwise). This one sends the final message, which announces them all.
      The other ranks' senders send no final message; `release_blocking` ends their requests.
    - `broken` says why the connection to the receiver is gone for good ("" while usable): a
      broken sender fails every later send at once and never reconnects; its owner replaces it
      with a new one (`SenderPool`), e.g. when the decode worker restarted on the same address.
      `worn`: it still works, but its owner should send new requests through a new one and close
      it once nothing of it is pending.
    - Underscore methods are the implementations' shared steps (checks, headers, acks), not API.
    """

    def __init__(self, layout: KVLayout, kv_cache: torch.Tensor, *, strided: bool = False) -> None:
        """`strided`: `kv_cache` may be a view of some heads of a larger pool (see RankedKVSender)."""
        check_pool(layout, kv_cache, strided=strided)
        self.layout = layout
        self.kv_cache = kv_cache
        self.copies = 1
        self._acks = AckTracker()
        self._abandoned: OrderedDict[str, None] = OrderedDict()  # released request ids, most recent last
        self._abandoned_lock = threading.Lock()

    @abc.abstractmethod
    def connect(self, address: str) -> None: ...

    @abc.abstractmethod
    def send_layer(self, request_id: str, layer: int, src_block_ids: list[int], dst_block_ids: list[int],
                   ready: LayerReady = NO_WAIT, *, token: str = "") -> None: ...

    @abc.abstractmethod
    def send_done(self, request_id: str, record: bytes, *, token: str = "") -> None: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    @property
    def broken(self) -> str:
        """Why this sender can no longer reach its receiver; "" while it can (or cannot tell)."""
        return ""

    @property
    def worn(self) -> bool:
        """It still works, but its owner should replace it once its requests are through (nixl:
        the grants' metadata it holds grew past a bound, see nixl.py, Trust)."""
        return False

    async def flush(self, request_id: str, timeout_s: float) -> None:
        await self._acks.flush(request_id, timeout_s)

    async def release(self, request_id: str) -> None:
        deadline = self._abandon(request_id)
        while self._still_reading(request_id, deadline):
            await asyncio.sleep(_RELEASE_POLL_S)

    def release_blocking(self, request_id: str) -> None:
        """`release` for a thread without an event loop, which then forgets the request (no
        `flush` follows: another sender's final message ended it; see `copies`)."""
        deadline = self._abandon(request_id)
        try:
            while self._still_reading(request_id, deadline):
                time.sleep(_RELEASE_POLL_S)
        finally:
            self.forget(request_id)

    def _abandon(self, request_id: str) -> float:
        """Nothing more of the request is sent; the deadline for sends still reading its blocks."""
        with self._abandoned_lock:
            self._abandoned[request_id] = None
            while len(self._abandoned) > _MAX_ABANDONED_KEPT:
                self._abandoned.popitem(last=False)
        self._acks.failed(request_id, "released by the caller")
        return time.monotonic() + _RELEASE_TIMEOUT_S

    def _still_reading(self, request_id: str, deadline: float) -> bool:
        if not self._reading(request_id):
            return False
        if time.monotonic() > deadline:
            raise KVTransferError(f"request {request_id}: a send still reads its blocks after {_RELEASE_TIMEOUT_S:g} s")
        return True

    def _announced_layers(self, request_id: str) -> int:
        """Record the final message; the layer payloads it announces (see `copies`)."""
        return self._acks.sent_done(request_id) * self.copies

    def forget(self, request_id: str) -> None:
        """Stop tracking the request's acknowledgements: another sender's final message covered
        them (RankedKVSender); nothing of it is sent any more."""
        self._acks.forget(request_id)

    def pending_request_ids(self) -> frozenset[str]:
        """Requests sent but not yet flushed to completion (tests: nothing left behind)."""
        return self._acks.request_ids()

    def _abandoned_request(self, request_id: str) -> bool:
        """Released: nothing more of it may be sent. NOTE: implementations mark a send as started
        (what `_reading` reports) before asking this, and `release` asks `_reading` after marking:
        either the send sees the release, or the release waits for the send."""
        with self._abandoned_lock:
            return request_id in self._abandoned

    def _reading(self, request_id: str) -> bool:
        """Whether a send of the request is reading its source blocks right now."""
        return False

    def _check_sources(self, layer: int, src_block_ids: list[int]) -> None:
        num_blocks = self.kv_cache.shape[2]
        if not 0 <= layer < self.layout.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.layout.num_layers})")
        if any(not 0 <= b < num_blocks for b in src_block_ids):
            raise ValueError(f"source block ids must be in [0, {num_blocks}), got {src_block_ids}")

    def _layer_header(self, request_id: str, layer: int, num_src_blocks: int,
                      dst_block_ids: list[int], token: str) -> LayerHeader:
        """Describes what the sender actually sends: `num_src_blocks` blocks' worth of bytes."""
        return LayerHeader(request_id, layer, tuple(dst_block_ids), num_src_blocks * self.layout.block_bytes_per_layer,
                           self.layout.dtype, self.layout.payload_shape(num_src_blocks), token,
                           self.layout.kv_head_start, *self.layout.layer_scales(layer))

    def _check_welcome(self, welcome: Welcome) -> None:
        """Prefill's half of the layout check, independent of decode's verdict."""
        self.layout.check_handoff(welcome.layout)
        if welcome.refusal:  # decode refused although our check passed: trust decode's message
            raise KVLayoutMismatch("layout", "", "", welcome.refusal)

    def _on_reply(self, reply: Ack | Reject) -> None:
        if isinstance(reply, Ack):
            self._acks.acked(reply.request_id)
        else:
            self._acks.failed(reply.request_id, f"rejected by decode: {reply.reason}")

