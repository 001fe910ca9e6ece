"""KV transport over NIXL with the UCX backend: prefill WRITEs straight into decode's pool.

Decode registers its whole pool with its NIXL agent; prefill registers its own. A TCP handshake
exchanges layouts and agent metadata; after it, everything travels as NIXL notifications:

    prefill I/O thread                            decode I/O thread
    TCP       <------ CHALLENGE {nonce}           (handshake.py: proofs of the cluster secret)
         HELLO {layout, conn info, proof} ------> check proof, layout; load prefill's conn info
         <------ WELCOME {layout, agent metadata incl. the pool registration} | {refusal}
    CLAIM {claim id, layer header}     ------>    validate against the reservation, then
         <------ GRANT {addresses of exactly the claimed K/V regions} | REJECT
    WRITE src regions -> granted addrs, notification WRITTEN {claim id, header}
                                       ------>    must match an open grant -> KVProgress
         <------ ACK | REJECT
    DONE {first token, state, n}       ------>    KVDone once n layers arrived (notifications
         <------ ACK | REJECT                     may overtake each other)

Layout: a layer payload is 2 * len(blocks) regions of `layout.region_bytes` (see `regions`); a
WRITE has one descriptor per region, merged where both sides are adjacent. A payload in another
element type than decode's pool (`--kv-cache-dtype`) is granted a staging range instead, and cast
into its blocks on WRITTEN (nixl_staging.py). Each descriptor costs
~3 us on loopback (UCX CMA), so small regions in scattered blocks bound the throughput.

Trust. Validation happens before any byte moves: decode hands out the addresses of a payload's
destination regions only after checking its claim (request reserved, blocks reserved, byte count,
dtype, shape), and prefill learns no other destination address. But RDMA is one-sided: the
registration in the agent metadata authorizes writes anywhere in decode's pool (UCX keys cover
a whole registration; NIXL refuses only addresses outside it). A prefill that ignores the protocol
could therefore write outside its grants, and a WRITE granted before `cancel` may still land in
the cancelled blocks (see Late writes). What bounds that: decode's agent metadata (which carries
the registration's remote keys) goes only to a peer that proved the cluster secret in the
handshake, notifications count only from agents that did, and a claim is granted only for a
payload that presents its reservation's token. NOT done: limiting the registration itself to one
reservation's regions (a registration, and its remote keys, per reservation or per grant, revoked
when it ends); until then a peer holding the cluster secret can write anywhere in the pool.

Late writes. A WRITE posted before prefill hears of a cancel lands after decode let go of the
blocks. Two rules bound when that can happen, with no clock shared between hosts: prefill posts a
WRITE only within `GRANT_MAX_AGE_S` of sending its claim (a grant that arrives later fails the
request instead), and decode's grant exists only after that claim was sent, so no granted byte
lands later than `GRANT_MAX_AGE_S` + the WRITE's own duration after a cancel. Decode keeps the
blocks of a reservation cancelled before its KV arrived out of reuse for `late_write_window_s`
(`LATE_WRITE_WINDOW_S`, which leaves seconds of margin for the WRITE), so they never hold another
request's KV when such a write lands. Not covered: a prefill process frozen (SIGSTOP, a hung host)
between that check and the WRITE itself, for longer than the margin.

Restarts. NOT handled: after the handshake no connection stays open, so a sender cannot tell that
its decode worker died. A decode worker restarted on the same address has a new agent (a new name
and new registrations), while the sender keeps notifying the old one: every later claim gets no
grant and its flush times out. `broken` stays "" here, so `SenderPool` keeps the stale sender;
restart the prefill workers too (or fix: keep the handshake socket open as a liveness link, mark
the sender broken on its EOF, and let the pool reconnect and re-fetch the metadata, as over tcp).

NIXL calls are confined to the I/O thread (the agent runs with NIXL_THREAD_SYNC_NONE). The agent's
own progress thread is disabled: on a 2-core machine it busy-spins a core and cut loopback
throughput from ~4 to ~1 GB/s; the I/O thread polls instead (notifications, transfer states).
On one host UCX moves the bytes with CMA (process_vm_writev) inside `transfer()`, on the prefill
I/O thread; the bindings release the GIL meanwhile, so the engine thread keeps computing. The
agent, the polling and the region addresses both sides share are in nixl_agent.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from pdserve.disagg.auth import ClusterSecret
from pdserve.disagg.kv_layout import KVLayout
from pdserve.disagg.transport import frames, regions
from pdserve.disagg.transport.base import KVReceiver, KVSender
from pdserve.disagg.transport.handshake import KVPeerGate, KVPeerPolicy, say_hello
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
    Welcome,
    Written,
)
from pdserve.disagg.transport.nixl_agent import (
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
from pdserve.disagg.transport.nixl_staging import Staging
from pdserve.disagg.transport.reservations import PayloadRejected

logger = logging.getLogger(__name__)

_CONNECT_TIMEOUT_S = 10.0
# Late writes (module docstring): claims are granted within milliseconds; 2 s is far beyond that.
GRANT_MAX_AGE_S = 2.0
LATE_WRITE_WINDOW_S = GRANT_MAX_AGE_S + 3.0


class NixlKVReceiver(KVReceiver):
    """Contract: see KVReceiver and this module's Trust note. `address` is 'nixl://host:port', the
    TCP port of the handshake; after it, prefill talks to the NIXL agent directly."""

    def __init__(self, layout: KVLayout, kv_cache: torch.Tensor, host: str = "127.0.0.1", port: int = 0, *,
                 peers: KVPeerPolicy | None = None) -> None:
        super().__init__(layout, kv_cache)
        self.gate = KVPeerGate(peers or KVPeerPolicy())
        self._listener = frames.listen(host, port)
        self._address = f"nixl://{host}:{self._listener.getsockname()[1]}"
        self._io = IoThread("pdserve-kv-nixl-recv")
        self._agent = self._io.call(new_agent, "decode")
        self._registration = self._io.call(self._agent.register_memory, kv_cache)
        self._metadata: bytes = self._io.call(self._agent.get_agent_metadata)
        self._peers: set[str] = set()                       # I/O thread only
        self._grants: dict[tuple[str, int], LayerHeader] = {}  # (peer, claim id) -> granted; I/O thread only
        self._staging = Staging(kv_cache, layout)  # I/O thread only
        self._io.submit(self._accept_loop())
        self._io.submit(self._poll_loop())

    @property
    def address(self) -> str:
        return self._address

    @property
    def late_write_window_s(self) -> float:
        return LATE_WRITE_WINDOW_S

    def cancel(self, request_id: str) -> None:
        super().cancel(request_id)
        self._io.call_soon(self._drop_grants, request_id)

    @property
    def num_staging_bytes_in_use(self) -> int:
        """Staging taken by grants of converted payloads (tests: nothing left behind)."""
        return int(self._io.call(lambda: self._staging.num_bytes_in_use))

    def close(self) -> None:
        if not self._io.running:
            return
        self._io.call(self._shutdown)
        self._io.stop()
        self._listener.close()

    def _shutdown(self) -> None:
        for peer in self._peers:
            with contextlib.suppress(Exception):
                self._agent.remove_remote_agent(peer)
        self._agent.deregister_memory(self._registration)
        self._staging.close(self._agent)

    async def _accept_loop(self) -> None:
        await frames.accept_forever(self._listener, self._handshake_on)

    async def _handshake_on(self, sock: socket.socket) -> None:
        with sock, self.gate.slot(sock) as admitted:
            try:
                hello = await self.gate.handshake(sock, self._welcome) if admitted else None
            except (ConnectionError, OSError) as e:
                logger.info("NIXL handshake with prefill failed: %s", e)
                return
        if hello is not None:
            logger.info("prefill agent connected over NIXL")

    def _welcome(self, hello: Hello) -> Welcome:
        welcome = self._handshake(hello.layout)
        if welcome.refusal:
            return welcome
        # NOTE: load prefill's connection info before answering, so our first reply can reach it.
        try:
            self._peers.add(agent_name(self._agent.add_remote_agent(hello.nixl_metadata)))
            if self.layout.converts_from(hello.layout) and self._staging.register(self._agent):
                self._metadata = self._agent.get_agent_metadata()  # now with the staging registration
        except Exception as e:  # NOTE: the bindings raise their own exception classes (nixl*Error)
            return replace(welcome, refusal=f"unusable NIXL agent metadata: {e!r}")
        return replace(welcome, nixl_metadata=self._metadata)

    async def _poll_loop(self) -> None:
        poller = Poller()
        while True:
            notifs = poll_notifs(self._agent, self._on_notif)
            if self._staging.expire():
                self._grant_waiting()
            await poller.pause(active=bool(notifs or self._grants or self._staging.waiting))

    def _on_notif(self, peer: str, raw: bytes) -> None:
        message = accept_notif(peer, peer in self._peers, raw)
        if message is None:
            return
        if isinstance(message, Claim):
            self._notify(peer, self._on_claim(peer, message))
        elif isinstance(message, Written):
            self._on_written(peer, message)
        elif isinstance(message, DoneHeader):
            self._notify(peer, self._admit_done(message, in_order=False))
        else:
            logger.warning("dropped an unexpected %s notification from %s", type(message).__name__, peer)

    def _on_claim(self, peer: str, claim: Claim) -> Grant | Reject | None:
        """Grants the pool's regions, or a staging range to a payload to convert (None: it waits)."""
        header = claim.header
        try:
            self._table.check_layer(header)
            if header.dtype != self.layout.dtype and self._staging.buffer is None:
                raise PayloadRejected(header.request_id, f"dtype {header.dtype}: no handshake declared it, no staging",
                                      request_known=True)
        except PayloadRejected as e:
            return self._reject(e)
        key = (peer, claim.claim_id)
        staged = None if header.dtype == self.layout.dtype else self._staging.grant(key, header)
        if staged is None and header.dtype != self.layout.dtype:
            self._staging.waiting.append((peer, claim))
            return None
        addrs, region_bytes = staged or (region_addrs(self.kv_cache, self.layout, header.layer, header.dst_block_ids),
                                         self.layout.region_bytes)
        self._grants[key] = header
        return Grant(header.request_id, claim.claim_id, tuple(addrs.tolist()), region_bytes)

    def _grant_waiting(self) -> None:
        waiting, self._staging.waiting = self._staging.waiting, deque()
        for peer, claim in waiting:
            self._notify(peer, self._on_claim(peer, claim))

    def _on_written(self, peer: str, written: Written) -> None:
        header = written.header
        granted = self._grants.pop((peer, written.claim_id), None)
        if granted != header:
            self._staging.hold((peer, written.claim_id), LATE_WRITE_WINDOW_S)
            known = self._table.is_reserved(header.request_id)
            self._notify(peer, self._reject(PayloadRejected(
                header.request_id, f"write notification for claim {written.claim_id} matches no grant", known)))
            return
        # The bytes already landed (RDMA); admitting re-checks that the request is still reserved.
        # NOTE: a payload to convert landed in staging: cast into the blocks, then its range frees
        key = (peer, written.claim_id)
        cast: Callable[[], None] = lambda: self._copy_into_pool(header, self._staging.payload(key))  # noqa: E731
        self._notify(peer, self._admit_layer(header, cast if header.dtype != self.layout.dtype else lambda: None))
        if self._staging.release(key):
            self._grant_waiting()
        done = self._table.take_ready_done(header.request_id)
        if done is not None:
            self._notify(peer, self._deliver_done(done))

    def _reject(self, error: PayloadRejected) -> Reject:
        self._drop_grants(error.request_id)
        return super()._reject(error)

    def _drop_grants(self, request_id: str) -> None:
        for key in [k for k, granted in self._grants.items() if granted.request_id == request_id]:
            del self._grants[key]
            self._staging.hold(key, LATE_WRITE_WINDOW_S)  # a granted WRITE may still land there
        self._staging.waiting = deque((p, c) for p, c in self._staging.waiting if c.header.request_id != request_id)

    def _notify(self, peer: str, message: Message | None) -> None:
        if message is not None:  # None: no reply (yet)
            self._agent.send_notif(peer, encode_notif(message))


@dataclass(frozen=True, slots=True)
class _PendingClaim:
    header: LayerHeader
    src_block_ids: tuple[int, ...]
    claimed_at_s: float = 0.0  # time.monotonic() when the claim went out


@dataclass(frozen=True, slots=True)
class _InFlight:
    request_id: str
    handle: Any


class NixlKVSender(KVSender):
    """Contract: see KVSender. `send_layer` queues a claim on the I/O thread; the WRITE starts when
    decode's grant arrives, so claims of later layers overlap earlier layers' writes."""

    def __init__(self, layout: KVLayout, kv_cache: torch.Tensor, *, secret: ClusterSecret | None = None) -> None:
        super().__init__(layout, kv_cache)
        self._secret = secret
        self._io = IoThread("pdserve-kv-nixl-send")
        self._agent = self._io.call(new_agent, "prefill")
        self._registration = self._io.call(self._agent.register_memory, kv_cache)
        self._mem_type, self._device_id = memory_kind(kv_cache)
        self._peer = ""
        self._claim_ids = itertools.count()
        self._claims: dict[int, _PendingClaim] = {}   # I/O thread only
        self._in_flight: list[_InFlight] = []          # I/O thread writes; `_reading` reads a copy
        self._writing = ""  # the request whose WRITE is being posted now

    def connect(self, address: str) -> None:
        if self._peer:
            raise RuntimeError("this sender is already connected; use one sender per decode worker")
        host, port = frames.parse_address(address, "nixl")
        self._io.run(self._connect(host, port), timeout_s=_CONNECT_TIMEOUT_S)

    def send_layer(self, request_id: str, layer: int, src_block_ids: list[int], dst_block_ids: list[int], *,
                   token: str = "") -> None:
        self._check_sources(layer, src_block_ids)
        if not self._peer:
            raise RuntimeError("connect() first")
        header = self._layer_header(request_id, layer, len(src_block_ids), dst_block_ids, token)
        self._acks.sent_layer(request_id)
        self._io.call_soon(self._claim, _PendingClaim(header, tuple(src_block_ids)))

    def send_done(self, request_id: str, first_token_id: int, generator_state: bytes | None = None, *,
                  prefill_queue_s: float | None = None, prefill_compute_s: float | None = None,
                  token: str = "", prefill_cached_tokens: int = 0) -> None:
        if not self._peer:
            raise RuntimeError("connect() first")
        num_layers = self._acks.sent_done(request_id)
        self._io.call_soon(self._notify, DoneHeader(request_id, first_token_id, num_layers, generator_state,
                                                    prefill_queue_s, prefill_compute_s, token,
                                                    prefill_cached_tokens))

    def close(self) -> None:
        if not self._io.running:
            return
        self._io.call(self._shutdown)
        self._io.stop()
        self._acks.fail_all("sender closed")

    def _shutdown(self) -> None:
        for flight in self._in_flight:
            with contextlib.suppress(Exception):
                flight.handle.release()
        self._in_flight.clear()
        if self._peer:
            with contextlib.suppress(Exception):
                self._agent.remove_remote_agent(self._peer)
        self._agent.deregister_memory(self._registration)

    async def _connect(self, host: str, port: int) -> None:
        with await frames.connect(host, port) as sock:
            welcome = await say_hello(sock, Hello(self.layout, conn_info_metadata(self._agent)), self._secret)
        self._check_welcome(welcome)
        self._peer = agent_name(self._agent.add_remote_agent(welcome.nixl_metadata))
        # Start UCX wire-up now rather than inside the first request's first WRITE (~30 ms here);
        # the poll loop progresses it.
        self._agent.make_connection(self._peer)
        asyncio.get_running_loop().create_task(self._poll_loop())

    def _claim(self, pending: _PendingClaim) -> None:
        claim_id = next(self._claim_ids)
        self._claims[claim_id] = replace(pending, claimed_at_s=time.monotonic())
        self._notify(Claim(claim_id, pending.header))

    async def _poll_loop(self) -> None:
        poller = Poller()
        while True:
            notifs = poll_notifs(self._agent, self._on_notif)
            self._check_in_flight()
            await poller.pause(active=bool(notifs or self._claims or self._in_flight))

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
        local = region_addrs(self.kv_cache, self.layout, header.layer, pending.src_block_ids)
        if len(grant.dst_addrs) != len(local) or grant.region_bytes != self.layout.region_bytes:
            self._acks.failed(header.request_id, "decode granted regions that do not match the claim")
            return
        src, dst = regions.coalesce_pairs(local, np.asarray(grant.dst_addrs, dtype=np.int64), self.layout.region_bytes)
        try:
            handle = self._agent.initialize_xfer("WRITE", self._descs(src), self._descs(dst), self._peer,
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

    def _descs(self, spans: regions.Spans) -> Any:
        """NIXL descriptors: rows of (address, length, device id)."""
        rows = np.empty((len(spans.starts), 3), dtype=np.uint64)
        rows[:, 0] = spans.starts
        rows[:, 1] = spans.lengths
        rows[:, 2] = self._device_id  # NOTE: decode's device id is assumed equal (one GPU per worker)
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

