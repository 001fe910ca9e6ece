"""NIXL's sending side (prefill): claims, WRITEs into granted regions, the liveness link.
The protocol, the trust model, late writes and restarts: nixl.py's docstring."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from pdserve.disagg.auth import ClusterSecret
from pdserve.disagg.kv_layout import KVLayout
from pdserve.disagg.transport import frames, regions
from pdserve.disagg.transport.handshake import say_hello
from pdserve.disagg.transport.io_thread import IoThread
from pdserve.disagg.transport.messages import (
    Ack,
    Claim,
    DoneHeader,
    Grant,
    Hello,
    LayerHeader,
    Message,
    Reject,
    Written,
)
from pdserve.disagg.transport.nixl.agent import (
    Poller,
    accept_notif,
    agent_name,
    conn_info_metadata,
    encode_notif,
    memory_kind,
    new_agent,
    poll_notifs,
    region_addrs,
)
from pdserve.disagg.transport.ready import NO_WAIT, LayerReady
from pdserve.disagg.transport.sender_base import KVSender

logger = logging.getLogger(__name__)

_CONNECT_TIMEOUT_S = 10.0
# Late writes (nixl.py's docstring): claims are granted within milliseconds; 2 s is far beyond that.
GRANT_MAX_AGE_S = 2.0
# NIXL keeps every grant's metadata this agent loaded until the agent goes (nixl.py, Trust): past
# this much, the sender is `worn` and SenderPool replaces it (a new agent, a new handshake, ~30 ms).
# ~47 bytes of metadata per descriptor: a 4,096-token request of a 16-layer model, served
# placement, loads ~100 KB.
MAX_LOADED_METADATA_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class _PendingClaim:
    header: LayerHeader
    src_block_ids: tuple[int, ...]
    claimed_at_s: float = 0.0  # time.monotonic() when the claim went out
    ready: LayerReady = NO_WAIT  # the layer's end on the compute stream (ready.py)


@dataclass(frozen=True, slots=True)
class _InFlight:
    request_id: str
    handle: Any


class NixlKVSender(KVSender):
    """Contract: see KVSender. `send_layer` queues a claim on the I/O thread; the WRITE starts when
    decode's grant arrives, so claims of later layers overlap earlier layers' writes."""

    def __init__(self, layout: KVLayout, kv_cache: torch.Tensor, *, secret: ClusterSecret | None = None) -> None:
        """`kv_cache` may be a view of some heads of a larger pool (RankedKVSender: a prefill pool
        that holds more heads than a decode rank): each WRITE then names every token's row of
        those heads (`regions.row_pairs`), straight from the pool, no copy."""
        super().__init__(layout, kv_cache, strided=True)
        self._secret = secret
        self._mem_type, self._device_id = memory_kind(kv_cache)
        self._io = IoThread("pdserve-kv-nixl-send")
        self._agent = self._io.call(new_agent, "prefill")
        self._rows = not kv_cache.is_contiguous()
        if self._rows:  # NOTE: the span its rows lie in (a tensor view registers only numel's bytes)
            start, length = regions.view_span(kv_cache)
            span = np.array([[start, length, self._device_id]], dtype=np.uint64)
            self._registration = self._io.call(self._agent.register_memory, span, self._mem_type)
        else:
            self._registration = self._io.call(self._agent.register_memory, kv_cache)
        self._peer = ""
        self._claim_ids = itertools.count()
        self._claims: dict[int, _PendingClaim] = {}   # I/O thread only
        self._poller = Poller()  # I/O thread only (made again when connected)
        self._in_flight: list[_InFlight] = []          # I/O thread writes; `_reading` reads a copy
        self._writing = ""  # the request whose WRITE is being posted now
        self._link: socket.socket | None = None  # the handshake's socket, held open (module docstring)
        self._watch: asyncio.Task[None] | None = None  # held: the loop keeps only a weak reference
        self._closing = False
        self._broken = ""  # why decode is gone; set once, on the I/O thread
        self._loaded_metadata_bytes = 0  # grants' metadata loaded into our view of decode's agent

    @property
    def broken(self) -> str:
        return self._broken

    @property
    def worn(self) -> bool:
        return self._loaded_metadata_bytes > MAX_LOADED_METADATA_BYTES

    def connect(self, address: str) -> None:
        if self._peer:
            raise RuntimeError("this sender is already connected; use one sender per decode worker")
        host, port = frames.parse_address(address, "nixl")
        self._io.run(self._connect(host, port), timeout_s=_CONNECT_TIMEOUT_S)

    def send_layer(self, request_id: str, layer: int, src_block_ids: list[int], dst_block_ids: list[int],
                   ready: LayerReady = NO_WAIT, *, token: str = "") -> None:
        self._check_sources(layer, src_block_ids)
        if not self._peer:
            raise RuntimeError("connect() first")
        header = self._layer_header(request_id, layer, len(src_block_ids), dst_block_ids, token)
        self._acks.sent_layer(request_id)
        if self._broken:
            self._acks.failed(request_id, self._broken)
            return
        self._io.call_soon(self._claim, _PendingClaim(header, tuple(src_block_ids), ready=ready))

    def send_done(self, request_id: str, record: bytes, *, token: str = "") -> None:
        if not self._peer:
            raise RuntimeError("connect() first")
        num_layers = self._announced_layers(request_id)
        if self._broken:
            self._acks.failed(request_id, self._broken)
            return
        self._io.call_soon(self._notify, DoneHeader(request_id, num_layers, record, token))

    def close(self) -> None:
        if not self._io.running:
            return
        self._io.call(self._shutdown)
        self._io.stop()
        self._acks.fail_all("sender closed")

    def _shutdown(self) -> None:
        if self._link is not None:  # NOTE: the watch sees EOF and closes it (closing it here would pull
            self._closing = True     # the descriptor from under the watch's pending read)
            with contextlib.suppress(OSError):
                self._link.shutdown(socket.SHUT_RDWR)
        for flight in self._in_flight:
            with contextlib.suppress(Exception):
                flight.handle.release()
        self._in_flight.clear()
        if self._peer:
            with contextlib.suppress(Exception):
                self._agent.remove_remote_agent(self._peer)
        self._agent.deregister_memory(self._registration)

    async def _connect(self, host: str, port: int) -> None:
        sock = await frames.connect(host, port)
        try:
            welcome = await say_hello(sock, Hello(self.layout, conn_info_metadata(self._agent)), self._secret)
            self._check_welcome(welcome)
            self._peer = agent_name(self._agent.add_remote_agent(welcome.nixl_metadata))
        except BaseException:
            sock.close()
            raise
        self._link = sock
        # Start UCX wire-up now rather than inside the first request's first WRITE (~30 ms here);
        # the poll loop progresses it.
        self._agent.make_connection(self._peer)
        self._poller = Poller()
        loop = asyncio.get_running_loop()
        loop.create_task(self._poll_loop())
        self._watch = loop.create_task(self._watch_link(sock))

    async def _watch_link(self, sock: socket.socket) -> None:
        """Decode sends nothing on the link: a read ends only when its process is gone."""
        with sock:
            try:
                await frames.recv_frame(sock, max_payload_bytes=0)
                reason = "an unexpected frame on the liveness link"
            except (ConnectionError, OSError) as e:  # EOF, a reset, or bytes that are no frame
                reason = str(e)
        if not self._closing:
            self._lose_decode(f"link to decode lost ({reason})")

    def _lose_decode(self, reason: str) -> None:
        """This sender can reach decode no more: fail everything, turn `broken` (its owner
        connects a new one, with a new agent), and close the link so decode forgets our agent."""
        logger.warning("NIXL sender gives up on decode: %s", reason)
        self._broken = reason
        self._claims.clear()
        self._acks.fail_all(reason)
        if self._link is not None and not self._closing:
            self._closing = True  # NOTE: the watch sees EOF and closes the socket
            with contextlib.suppress(OSError):
                self._link.shutdown(socket.SHUT_RDWR)

    def _claim(self, pending: _PendingClaim) -> None:
        claim_id = next(self._claim_ids)
        self._claims[claim_id] = replace(pending, claimed_at_s=time.monotonic())
        self._notify(Claim(claim_id, pending.header))

    async def _poll_loop(self) -> None:
        while True:
            notifs = poll_notifs(self._agent, self._on_notif)
            self._check_in_flight()
            await self._poller.pause(notifs, bool(self._claims or self._in_flight),
                                     (len(self._claims), len(self._in_flight)),
                                     expecting=bool(self._acks.request_ids()))

    def _on_notif(self, peer: str, raw: bytes) -> None:
        message = accept_notif(peer, peer == self._peer, raw)
        if message is None:
            return
        if isinstance(message, Grant):
            self._write(message)
        elif isinstance(message, Ack | Reject):
            if isinstance(message, Reject):
                self._drop_claims(message.request_id)
            self._on_reply(message)
        else:
            logger.warning("dropped an unexpected %s notification from decode", type(message).__name__)

    def _write(self, grant: Grant) -> None:
        pending = self._claims.pop(grant.claim_id, None)
        if pending is None:
            logger.warning("grant for unknown claim %d of request %s", grant.claim_id, grant.request_id)
            return
        header = pending.header
        age_s = time.monotonic() - pending.claimed_at_s
        if age_s > GRANT_MAX_AGE_S:
            self._acks.failed(header.request_id, f"decode's grant for layer {header.layer} came {age_s:.1f} s after "
                              f"the claim (limit {GRANT_MAX_AGE_S:g} s): not writing, decode may have moved on")
            return
        self._writing = header.request_id  # NOTE: before the check; see _abandoned_request
        try:
            if not self._abandoned_request(header.request_id):
                self._post_write(grant, pending)
        finally:
            self._writing = ""

    def _reading(self, request_id: str) -> bool:
        return self._writing == request_id or any(f.request_id == request_id for f in list(self._in_flight))

    def _post_write(self, grant: Grant, pending: _PendingClaim) -> None:
        header = pending.header
        if len(grant.dst_addrs) != 2 * len(pending.src_block_ids) or grant.region_bytes != self.layout.region_bytes:
            self._acks.failed(header.request_id, "decode granted regions that do not match the claim")
            return
        remote = np.asarray(grant.dst_addrs, dtype=np.int64)
        if self._rows:
            src, dst = regions.row_pairs(self.kv_cache, header.layer, pending.src_block_ids, remote)
        else:
            local = region_addrs(self.kv_cache, self.layout, header.layer, pending.src_block_ids)
            src, dst = regions.coalesce_pairs(local, remote, self.layout.region_bytes)
        if not self._load_grant(grant):
            return
        pending.ready.synchronize()  # NOTE: the WRITE reads VRAM: only once the layer's kernels wrote it
        try:
            handle = self._agent.initialize_xfer("WRITE", self._descs(src, self._device_id),
                                                 self._descs(dst, grant.dst_device_id), self._peer,
                                                 encode_notif(Written(grant.claim_id, header)))
            state = self._agent.transfer(handle)
        except Exception as e:  # NOTE: the bindings raise their own exception classes (nixl*Error)
            self._acks.failed(header.request_id, f"NIXL WRITE failed to start: {e!r}")
            return
        if state == "ERR":
            handle.release()
            self._acks.failed(header.request_id, "NIXL WRITE failed")
        else:
            self._in_flight.append(_InFlight(header.request_id, handle))

    def _load_grant(self, grant: Grant) -> bool:
        """Load the metadata of the registration decode made for this grant (nixl.py, Trust): NIXL
        merges it into what we hold of decode's agent; without it the WRITE has nowhere to go.
        False: it failed, and with it this sender (NOTE: NIXL drops everything it held of an agent
        whose metadata it could not load, so no later WRITE to decode could start)."""
        if not grant.nixl_metadata:
            return True
        try:
            name = agent_name(self._agent.add_remote_agent(grant.nixl_metadata))
        except Exception as e:  # the bindings' own classes (nixl*Error)
            name = f"none ({e!r})"
        if name != self._peer:
            self._lose_decode(f"could not load the NIXL metadata of decode's grant: agent {name}")
            return False
        self._loaded_metadata_bytes += len(grant.nixl_metadata)
        return True

    def _descs(self, spans: regions.Spans, device_id: int) -> Any:
        """NIXL descriptors: rows of (address, length, device id)."""
        rows = np.empty((len(spans.starts), 3), dtype=np.uint64)
        rows[:, 0] = spans.starts
        rows[:, 1] = spans.lengths
        rows[:, 2] = device_id
        return self._agent.get_xfer_descs(rows, self._mem_type)

    def _check_in_flight(self) -> None:
        still: list[_InFlight] = []
        for flight in self._in_flight:
            state = self._agent.check_xfer_state(flight.handle)
            if state == "PROC":
                still.append(flight)
                continue
            flight.handle.release()
            if state == "ERR":
                self._acks.failed(flight.request_id, "NIXL WRITE failed")
        self._in_flight = still

    def _drop_claims(self, request_id: str) -> None:
        for claim_id in [c for c, p in self._claims.items() if p.header.request_id == request_id]:
            del self._claims[claim_id]

    def _notify(self, message: Message) -> None:
        self._agent.send_notif(self._peer, encode_notif(message))
        self._poller.wake()  # NOTE: its answer is due: no quiet pause now

