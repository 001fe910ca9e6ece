"""The KV transport interface: a decode worker's `KVReceiver` (here) and a prefill worker's
`KVSender` (sender_base.py).

    prefill worker                                      decode worker
    --------------                                      -------------
                                                        receiver = make_receiver(name, layout, pool)
    sender = make_sender(name, layout, pool)            (router learns receiver.address)
    sender.connect(address)  ---- handshake ---->      both sides compare KVLayout, refuse a mismatch
                                                        receiver.expect(rid, reserved_block_ids)
    for layer in layers:
        compute layer
        sender.send_layer(rid, layer, src, dst) ---->  validate, write into dst -> KVProgress
    sender.send_done(rid, record)              ---->  -> KVDone(rid, record) (last event)
    await sender.flush(rid, timeout_s)          <----  acks          await receiver.wait(rid, timeout_s)

`record` is the prefill side's hand-off record, encoded (disagg/handoff.py); the transports carry it
as opaque bytes and never read it.

A payload is one layer's K and V for some blocks: `layout.block_bytes_per_layer` bytes per block,
shaped [k|v, block, slot, head, dim]. Block order is the order of `dst_block_ids`.
"""

from __future__ import annotations

import abc
import dataclasses
import itertools
import threading
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from pdserve.disagg.kv_layout import KVLayout, KVLayoutMismatch
from pdserve.disagg.transport.messages import (
    Ack,
    DoneHeader,
    KVEvent,
    KVProgress,
    KVRejected,
    LayerHeader,
    Reject,
    Welcome,
)
from pdserve.disagg.transport.progress import EventBox
from pdserve.disagg.transport.reservations import PayloadRejected, ReservationTable
from pdserve.model.kv_scales import KVScales, is_fp8, requantize

_MAX_REFUSALS_KEPT = 16
_MAX_ABANDONED_KEPT = 4096
_RELEASE_TIMEOUT_S = 30.0
_RELEASE_POLL_S = 0.001


def check_pool(layout: KVLayout, kv_cache: torch.Tensor, *, strided: bool = False) -> None:
    """The pool a transport is given must be the one `layout` describes (`strided`: KVLayout.from_pool)."""
    # NOTE: the wire version is the peer protocol's, not the pool's, and which of the model's heads
    # a pool holds is the layout's to say: only the pool's own fields are checked
    scales = KVScales(layout.k_scales, layout.v_scales) if layout.k_scales else None  # the pool does not know them
    actual = dataclasses.replace(KVLayout.from_pool(layout.model_id, kv_cache, layout.kv_cache_dtype, strided=strided,
                                                    scales=scales),
                                 wire_version=layout.wire_version, kv_head_start=layout.kv_head_start)
    actual.check_compatible(layout, self_role="pool", peer_role="layout")


def cast_into_blocks(layer_cache: torch.Tensor, values: torch.Tensor, block_ids: tuple[int, ...]) -> None:
    """values[:, i] -> layer_cache[:, block_ids[i]], cast by the copy itself: one pass, nothing
    allocated (a cast then an `index_copy_` took ~3x as long on CPU: two passes, and the fresh
    tensor's pages fault in); one copy per run of consecutive block ids."""
    ids = np.asarray(block_ids, dtype=np.int64)
    bounds = [0, *(np.flatnonzero(np.diff(ids) != 1) + 1).tolist(), len(ids)]
    for lo, hi in itertools.pairwise(bounds):
        first = int(ids[lo])
        layer_cache[:, first:first + hi - lo].copy_(values[:, lo:hi])


class RankReceivers(Protocol):
    """The other ranks' receivers, as rank 0's receiver drives them (disagg/worker/rank_receiving.py)."""

    addresses: list[str]

    def expect(self, request_id: str, block_ids: list[int] | tuple[int, ...], token: str) -> None: ...

    def cancel(self, request_id: str) -> None: ...

    def end(self, request_id: str) -> None: ...


class KVReceiver(abc.ABC):
    """Decode side: receives KV payloads into reserved blocks of the local pool.

    Contract
    - Construction binds the transport to `kv_cache` (the engine's pool, shape
      [layers, 2, blocks, block_size, kv_heads, head_dim], contiguous) and starts listening;
      `address` is what a prefill worker passes to `KVSender.connect`.
    - Memory: the pool stays owned by the engine. The receiver writes only into blocks of a live
      reservation, and only after the payload was validated (`ReservationTable`).
    - `expect(request_id, block_ids, token)` is called by the decode engine's thread before the
      router lets prefill start; those blocks are the only ones a payload of that request may
      write, and only a payload that presents `token` (compared in constant time).
    - `cancel(request_id)` (any thread) drops the reservation and pending events; later payloads
      of the request are rejected. tcp/fake: once it returns, no write into those blocks is in
      progress or will happen. nixl: see that module (a WRITE granted earlier may still land).
    - `wait(request_id, timeout_s)` is a coroutine, usable from any event loop and thread: it
      returns the request's next event: one KVProgress per accepted layer payload (in arrival
      order, which over nixl may differ from layer order), then exactly one KVDone or KVRejected,
      which ends the request. It raises KVTransferTimeout when no event (and no `touch`) arrives
      within `timeout_s`, KVTransferError when the request is unknown or gets cancelled. One waiter per
      request; a request's state is freed after its last event was taken, or on `cancel`.
    - Every implementation runs its network I/O on its own thread (`IoThread`) except the fake,
      which runs in the sender's calling thread. `close()` stops it; the pool is not touched after.
    - Underscore methods are the implementations' shared steps (handshake, admission), not API.
    - Tensor parallelism with a pool per rank (disagg/worker/rank_receiving.py): rank 0's receiver has
      `ranks` (the other ranks' receivers: `kv_address` lists them; expect and cancel reach them;
      `remote_admitted` / `remote_rejected` count their payloads here, any thread); a rank's
      receiver reports through `on_admitted` / `on_rejected` (its I/O thread).
    """

    def __init__(self, layout: KVLayout, kv_cache: torch.Tensor) -> None:
        check_pool(layout, kv_cache)
        self.layout = layout
        self.kv_cache = kv_cache
        self._table = ReservationTable(layout, num_blocks=kv_cache.shape[2])
        self._events = EventBox()
        self._refusals: list[KVLayoutMismatch] = []
        self._refusals_lock = threading.Lock()
        self.ranks: RankReceivers | None = None
        self.on_admitted: Callable[[str, int, tuple[int, ...]], None] | None = None
        self.on_rejected: Callable[[str, str], None] | None = None

    @property
    def kv_address(self) -> str:
        """What prefill workers are told to send to: `address`, then each other rank's."""
        return ",".join([self.address, *(self.ranks.addresses if self.ranks is not None else ())])

    @property
    @abc.abstractmethod
    def address(self) -> str:
        """Where prefill connects, e.g. 'tcp://127.0.0.1:5555'."""

    @property
    def late_write_window_s(self) -> float:
        """How long after `cancel` bytes of the cancelled transfer may still land in its blocks:
        decode keeps those blocks out of reuse that long. 0 when `cancel` stops every write before
        it returns (tcp, fake); see nixl."""
        return 0.0

    @abc.abstractmethod
    def close(self) -> None:
        """Stop receiving; idempotent."""

    def expect(self, request_id: str, block_ids: list[int] | tuple[int, ...], token: str = "") -> None:
        # NOTE: the event box opens first, so a payload admitted right after the reservation
        # exists always finds it; it raises, touching nothing, if the request is still live.
        self._events.open(request_id)
        try:
            self._table.expect(request_id, block_ids, token)
            if self.ranks is not None:
                self.ranks.expect(request_id, block_ids, token)
        except BaseException:
            self._table.remove(request_id)
            self._events.close(request_id, "reservation refused")
            raise

    def cancel(self, request_id: str) -> None:
        self._table.remove(request_id)
        self._events.close(request_id, "cancelled")
        if self.ranks is not None:
            self.ranks.cancel(request_id)

    def remote_admitted(self, request_id: str, layer: int, dst_block_ids: tuple[int, ...]) -> None:
        """Another rank admitted a layer payload of the request (rank 0; any thread)."""
        self._on_io(self._count_remote, request_id, layer, tuple(dst_block_ids))

    def remote_rejected(self, request_id: str, reason: str) -> None:
        """Another rank rejected a payload of the request, which ends it (rank 0; any thread)."""
        self._on_io(lambda: self._reject(PayloadRejected(request_id, f"a decode rank: {reason}",
                                                         self._table.is_reserved(request_id))))

    def _on_io(self, fn: Callable[..., object], *args: object) -> None:
        """Run `fn` on the transport's I/O thread (the transports that link ranks implement it)."""
        raise NotImplementedError

    def _count_remote(self, request_id: str, layer: int, dst_block_ids: tuple[int, ...]) -> None:
        if self._table.count_remote(request_id):
            self._events.put(KVProgress(request_id, layer, dst_block_ids))
            ready = self._ready_done(request_id)
            if ready is not None:  # the final message waited for this payload
                ack, origin = ready
                self._answer_deferred(origin, ack)

    async def wait(self, request_id: str, timeout_s: float) -> KVEvent:
        return await self._events.get(request_id, timeout_s)

    def touch(self, request_id: str, step_s: float | None = None) -> None:
        """A keepalive for the request (its prefill worker is still computing it, outside this
        transport): a `wait` on it counts its timeout from now, scaled to the sender's announced
        step time `step_s` when there is one (transport/cadence.py)."""
        self._events.touch(request_id, step_s)

    async def settled(self) -> None:
        """Once every `expect` and `cancel` made so far is in effect: at once here (they are
        synchronous); a stand-in across a process boundary waits for them (disagg/worker/kv_link.py)."""
        return

    def reserved_request_ids(self) -> frozenset[str]:
        """Requests that still have a reservation or undelivered events (tests: nothing left behind)."""
        return self._table.request_ids() | self._events.request_ids()

    @property
    def refusals(self) -> tuple[KVLayoutMismatch, ...]:
        """The most recent handshakes this receiver refused, oldest first."""
        with self._refusals_lock:
            return tuple(self._refusals)

    def _handshake(self, peer_layout: KVLayout) -> Welcome:
        """Decode's half of the layout check; the answer goes back to prefill either way."""
        try:
            peer_layout.check_handoff(self.layout)
        except KVLayoutMismatch as e:
            with self._refusals_lock:
                self._refusals = [*self._refusals[-_MAX_REFUSALS_KEPT + 1:], e]
            return Welcome(self.layout, str(e), b"")
        return Welcome(self.layout, "", b"")

    def _write_layer(self, header: LayerHeader, payload: torch.Tensor) -> Ack | Reject:
        """Validate `header` against the reservation and `payload` against `header`, then copy the
        payload (uint8, on any device) into the pool. Delivers KVProgress or KVRejected."""
        if payload.numel() != header.num_bytes:
            return self._reject(PayloadRejected(header.request_id, f"header announces {header.num_bytes} bytes, "
                                                f"payload has {payload.numel()}",
                                                self._table.is_reserved(header.request_id)))
        return self._admit_layer(header, lambda: self._copy_into_pool(header, payload))

    def _admit_layer(self, header: LayerHeader, write: Callable[[], None]) -> Ack | Reject:
        """Validate `header`, run `write` (the copy into the pool, or nothing when the bytes already
        landed by RDMA) under the reservation lock, deliver KVProgress."""
        try:
            with self._table.admit_layer(header):
                write()
        except PayloadRejected as e:
            return self._reject(e)
        self._events.put(KVProgress(header.request_id, header.layer, header.dst_block_ids))
        if self.on_admitted is not None:
            self.on_admitted(header.request_id, header.layer, header.dst_block_ids)
        return Ack(header.request_id)

    @property
    def num_dtype_conversions(self) -> int:
        """Hand-offs whose KV arrived in another element type and was converted into the pool's."""
        return self._table.num_converted

    def _copy_into_pool(self, header: LayerHeader, payload: torch.Tensor) -> None:
        """Payload bytes (uint8) -> the pool's blocks (the payload's heads of them), converted when
        the sender's dtype or FP8 scales differ (the payload is then the staging buffer the cast
        reads): FP8 on either side through float32 values and this pool's scales of the layer."""
        values = payload.view(getattr(torch, header.dtype)).view(header.shape).to(self.kv_cache.device,
                                                                                 non_blocking=True)
        layer_cache = self.kv_cache[header.layer]
        if not self._whole_pool(header):
            layer_cache = layer_cache.narrow(3, header.kv_head_start - self.layout.kv_head_start, header.shape[3])
        same = self.layout.stores_as(header.dtype, header.scales, header.layer)
        if not same and (is_fp8(values.dtype) or is_fp8(self.kv_cache.dtype)):
            values = requantize(values, header.scales, self.kv_cache.dtype, self.layout.layer_scales(header.layer))
        if not same or not self._whole_pool(header):
            cast_into_blocks(layer_cache, values, header.dst_block_ids)
            return
        dst = torch.tensor(header.dst_block_ids, dtype=torch.long, device=self.kv_cache.device)
        if is_fp8(values.dtype):  # NOTE: torch's CPU index_copy_ has no float8 kernel; bytes are bytes
            layer_cache, values = layer_cache.view(torch.uint8), values.view(torch.uint8)
        layer_cache.index_copy_(1, dst, values)

    def _whole_pool(self, header: LayerHeader) -> bool:
        """The payload holds every head of the pool (not one tensor-parallel rank's share): its
        regions are the pool's own, so it may land in place."""
        return header.kv_head_start == self.layout.kv_head_start and header.shape[3:4] == (self.layout.num_kv_heads,)

    def _admit_done(self, header: DoneHeader, *, in_order: bool, origin: object = None) -> Ack | Reject | None:
        """The final message: KVDone now (Ack), later once layers arrive (None: `_ready_done`
        hands it back with `origin`, to answer), or rejected."""
        try:
            if not self._table.admit_done(header, in_order=in_order, origin=origin):
                return None
        except PayloadRejected as e:
            return self._reject(e)
        return self._deliver_done(header)

    def _deliver_done(self, header: DoneHeader) -> Ack:
        self._events.put(header.event())
        if self.ranks is not None:
            self.ranks.end(header.request_id)
        return Ack(header.request_id)

    def _ready_done(self, request_id: str) -> tuple[Ack, object] | None:
        """After a layer payload was admitted: the request's deferred final message, delivered now
        that its last layer arrived (the answer and the origin to send it to), else None."""
        ready = self._table.take_ready_done(request_id)
        if ready is None:
            return None
        done, origin = ready
        return self._deliver_done(done), origin

    def _reject(self, error: PayloadRejected) -> Reject:
        """A rejected payload ends its request: decode hears KVRejected, prefill a Reject."""
        reply = Reject(error.request_id, error.reason)
        if error.request_known:
            removed = self._table.remove(error.request_id)
            self._events.put(KVRejected(error.request_id, error.reason))
            if removed is not None and removed.pending_origin is not None:
                self._answer_deferred(removed.pending_origin, reply)  # its final message waited
            if self.ranks is not None:
                self.ranks.end(error.request_id)
            if self.on_rejected is not None:
                self.on_rejected(error.request_id, error.reason)
        return reply

    def _answer_deferred(self, origin: object, reply: Ack | Reject) -> None:
        """Send `reply` to the sender of a final message that waited for layers (`origin`, see
        `_admit_done`), on the I/O thread. Transports that defer final messages implement it."""
        raise NotImplementedError
