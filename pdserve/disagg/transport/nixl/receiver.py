"""KV transport over NIXL with the UCX backend: prefill WRITEs straight into decode's pool.

Prefill registers its own pool with its NIXL agent. Decode registers nothing up front: each
reservation's regions are registered when its first claim is granted (grants.py). A TCP
handshake exchanges layouts and connection info; after it, everything travels as NIXL
notifications:

    prefill I/O thread                            decode I/O thread
    TCP       <------ CHALLENGE {nonce}           (handshake.py: proofs of the cluster secret)
         HELLO {layout, conn info, proof} ------> check proof, layout; load prefill's conn info
         <------ WELCOME {layout, decode's conn info (no registration)} | {refusal}
    CLAIM {claim id, layer header}     ------>    validate against the reservation (token too),
                                                  register the reservation's regions if not yet
         <------ GRANT {addresses of exactly the claimed K/V regions, the registration's
                        metadata the first time this agent writes into it} | REJECT
    load the metadata; WRITE src regions -> granted addrs, notification WRITTEN {claim id, header}
                                       ------>    must match an open grant -> KVProgress
         <------ ACK | REJECT
    DONE {hand-off record, n}          ------>    KVDone once n layers arrived (notifications
         <------ ACK | REJECT                     may overtake each other); the reservation's
                                                  registration is revoked

Layout: a layer payload is 2 * len(blocks) regions of `layout.region_bytes` (see `regions`); a
WRITE has one descriptor per region, merged where both sides are adjacent. A payload in another
element type than decode's pool (`--kv-cache-dtype`), or holding one tensor-parallel rank's KV heads
(strided within each block), is granted a staging range instead (registered for that grant alone),
and cast or copied into its blocks on WRITTEN (staging.py). Each descriptor costs
~3 us on loopback (UCX CMA), so small regions in scattered blocks bound the throughput.

Trust. Validation happens before any byte moves: decode hands out the addresses of a payload's
destination regions only after checking its claim (request reserved, reservation token, blocks,
byte count, dtype, shape). RDMA is one-sided, so what a peer can WRITE is what NIXL lets it: its
agent refuses (when the transfer is prepared) any remote address outside the registrations it
loaded the metadata (remote keys) of. Decode's handshake gives a peer that proved the cluster
secret its connection info only, no registration; a GRANT gives it the registration of that one
reservation's regions (every layer's K and V of its blocks) or of one staging range, and the
registration is deregistered when the reservation ends: at once when no grant of it is open (its
KV arrived, or it was cancelled, rejected or expired between grants), else after
`LATE_WRITE_WINDOW_S`, since a WRITE granted before the end may still be in flight (see Late
writes; over InfiniBand a WRITE that meets a deregistered key fails the writer's connection).
Notifications count only from agents that passed the handshake. So a peer that writes through
NIXL reaches neither a block before its claim was granted nor another reservation's blocks
(tests/test_nixl_grants.py). What a peer can still do:
- write any layer of its own reservation's blocks while the reservation lives (its token lets it
  send those bytes through the protocol anyway);
- keep writing where it once was granted after the revocation, wherever the fabric does not check
  remote keys. NIXL has no call to unload part of a remote agent's metadata, so the peer's agent
  keeps every registration it loaded (until decode's agent is forgotten); after deregistration,
  what refuses such a WRITE is the remote key, checked by the NIC on InfiniBand/RoCE. On one host
  UCX moves the bytes with CMA (process_vm_writev), which checks no remote key at all: there a
  revoked region stays writable to a peer that loaded it (into blocks decode may have reused), and
  a peer that forges metadata for any address can write anywhere in decode's process. On one host
  the boundary against a hostile local process is the OS user (CMA needs ptrace permission over
  decode), not NIXL; run untrusted code under another uid.
Prefill loads each grant's metadata into its view of decode's agent, where it stays until that
agent goes (NIXL merges partial metadata and cannot drop part of it): ~47 bytes per descriptor,
~100 KB for a 4,096-token request of a 16-layer model. Two consequences. A revoked registration
could hide a live one over the same memory from the WRITE's lookup (NIXL finds a remote range's
registration by its start): each host-memory registration gets a device id of its own, which the
GRANT names (`agent.register`); GPU pools need their real device id, so there a WRITE can
fail on such a shadow (the request then fails and is retried) — untested, no GPU build of NIXL
here. And the metadata accumulates: past `MAX_LOADED_METADATA_BYTES` (4 MiB) the sender is
`worn`, and `SenderPool` sends new requests through a new one (new agent, new handshake) and
closes the old one once its requests are through. Over InfiniBand a re-registration has new
remote keys; NIXL 1.5.1 may refuse metadata that changed for a range it holds (its source returns
NIXL_ERR_NOT_ALLOWED and drops the agent): the sender then breaks and reconnects (untested: no
InfiniBand here; the per-registration device ids make such a range new to NIXL on host memory).

Late writes. A WRITE posted before prefill hears of a cancel lands after decode let go of the
blocks. Two rules bound when that can happen, with no clock shared between hosts: prefill posts a
WRITE only within `GRANT_MAX_AGE_S` of sending its claim (a grant that arrives later fails the
request instead), and decode's grant exists only after that claim was sent, so no granted byte
lands later than `GRANT_MAX_AGE_S` + the WRITE's own duration after a cancel. Decode keeps the
blocks of a reservation cancelled before its KV arrived out of reuse for `late_write_window_s`
(`LATE_WRITE_WINDOW_S`, which leaves seconds of margin for the WRITE), so they never hold another
request's KV when such a write lands. Not covered: a prefill process frozen (SIGSTOP, a hung host)
between that check and the WRITE itself, for longer than the margin.

Restarts. The handshake's TCP socket stays open afterwards as a liveness link; nothing more is
sent on it. When decode's process ends its kernel closes the link: the sender sees EOF, fails what
is in flight at once and turns `broken`, so `SenderPool` handshakes again with the restarted
worker and learns its new agent (new name), as over tcp. When prefill's process ends, decode sees
EOF and forgets that agent and its grants (their registrations are held through the late-write
window when the reservations end; a new agent of that worker gets the metadata again).

NIXL calls are confined to the I/O thread (the agent runs with NIXL_THREAD_SYNC_NONE). The agent's
own progress thread is disabled: on a 2-core machine it busy-spins a core and cut loopback
throughput from ~4 to ~1 GB/s; the I/O thread polls instead (notifications, transfer states).
On one host UCX moves the bytes with CMA (process_vm_writev) inside `transfer()`, on the prefill
I/O thread; the bindings release the GIL meanwhile, so the engine thread keeps computing. The
agent, the polling and the region addresses both sides share are in agent.py.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace

import torch

from pdserve.disagg.kv_layout import KVLayout
from pdserve.disagg.transport import frames
from pdserve.disagg.transport.base import KVReceiver
from pdserve.disagg.transport.handshake import KVPeerGate, KVPeerPolicy
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
from pdserve.disagg.transport.nixl.agent import (
    Poller,
    accept_notif,
    agent_name,
    conn_info_metadata,
    encode_notif,
    new_agent,
    poll_notifs,
    region_addrs,
)
from pdserve.disagg.transport.nixl.grants import ReservationGrants
from pdserve.disagg.transport.nixl.sender import GRANT_MAX_AGE_S, NixlKVSender
from pdserve.disagg.transport.nixl.staging import Staging
from pdserve.disagg.transport.reservations import PayloadRejected

__all__ = ["GRANT_MAX_AGE_S", "LATE_WRITE_WINDOW_S", "NixlKVReceiver", "NixlKVSender"]

logger = logging.getLogger(__name__)

LATE_WRITE_WINDOW_S = GRANT_MAX_AGE_S + 3.0
_REVOKE_SWEEP_S = 0.1  # how often the poll loop looks for ended reservations it was not told of


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
        # NOTE: the handshake hands out our connection info only; no memory is registered until a
        # claim is granted (grants.py, staging.py; this module's Trust note).
        self._metadata: bytes = self._io.call(conn_info_metadata, self._agent)
        self._peers: set[str] = set()                       # I/O thread only
        self._links: set[socket.socket] = set()             # handshake sockets held open; I/O thread only
        self._grants: dict[tuple[str, int], LayerHeader] = {}  # (peer, claim id) -> granted; I/O thread only
        self._exposed = ReservationGrants(self._agent, kv_cache, layout)  # I/O thread only
        self._staging = Staging(kv_cache, layout, self._agent)  # I/O thread only
        self._poller = Poller()  # I/O thread only
        self._io.submit(self._accept_loop())
        self._io.submit(self._poll_loop())

    @property
    def address(self) -> str:
        return self._address

    @property
    def late_write_window_s(self) -> float:
        return LATE_WRITE_WINDOW_S

    def expect(self, request_id: str, block_ids: list[int] | tuple[int, ...], token: str = "") -> None:
        super().expect(request_id, block_ids, token)
        self._io.call_soon(self._poller.wake)  # NOTE: its claims may come any moment: no quiet pause now

    def cancel(self, request_id: str) -> None:
        super().cancel(request_id)
        self._io.call_soon(self._drop_grants, request_id)

    @property
    def num_staging_bytes_in_use(self) -> int:
        """Staging taken by grants of converted payloads (tests: nothing left behind)."""
        return int(self._io.call(lambda: self._staging.num_bytes_in_use))

    @property
    def num_registrations(self) -> int:
        """NIXL registrations not yet revoked: reservations' regions and staging ranges, granted or
        held after a cancel (tests: nothing left behind)."""
        return int(self._io.call(lambda: self._exposed.num_registrations + self._staging.num_registrations))

    def close(self) -> None:
        if not self._io.running:
            return
        self._io.call(self._shutdown)
        self._io.stop()
        self._listener.close()

    def _shutdown(self) -> None:
        for link in self._links:  # NOTE: their senders see EOF, as when this process dies
            with contextlib.suppress(OSError):
                link.shutdown(socket.SHUT_RDWR)
        for peer in self._peers:
            with contextlib.suppress(Exception):
                self._agent.remove_remote_agent(peer)
        self._exposed.close()
        self._staging.close()

    async def _accept_loop(self) -> None:
        await frames.accept_forever(self._listener, self._handshake_on)

    async def _handshake_on(self, sock: socket.socket) -> None:
        added: list[str] = []  # the agent this connection's Hello loaded
        with sock, self.gate.slot(sock) as admitted:
            try:
                hello = await self.gate.handshake(sock, lambda h: self._welcome(h, added)) if admitted else None
            except (ConnectionError, OSError) as e:
                logger.info("NIXL handshake with prefill failed: %s", e)
                hello = None
            if hello is None:
                self._forget_peers(added)
                return
            logger.info("prefill agent %s connected over NIXL", added[0])
            await self._hold_link(sock, added)

    async def _hold_link(self, sock: socket.socket, peers: list[str]) -> None:
        """Until prefill's end of the handshake socket closes (it sends nothing more), then forget
        its agent and grants: a restarted prefill worker comes back as a new agent."""
        self._links.add(sock)
        try:
            await frames.recv_frame(sock, max_payload_bytes=0)
            logger.warning("prefill sent a frame on the NIXL liveness link; closing it")
        except (ConnectionError, OSError) as e:  # EOF, a reset, or bytes that are no frame
            logger.info("NIXL link to prefill agent %s closed: %s", peers[0], e)
        finally:
            self._links.discard(sock)
            self._forget_peers(peers)

    def _forget_peers(self, peers: list[str]) -> None:
        for peer in peers:
            self._peers.discard(peer)
            for key in [k for k in self._grants if k[0] == peer]:
                del self._grants[key]
                self._staging.hold(key, LATE_WRITE_WINDOW_S)  # a WRITE it posted may still land there
            self._staging.waiting = deque((p, c) for p, c in self._staging.waiting if p != peer)
            self._exposed.forget_peer(peer)
            with contextlib.suppress(Exception):
                self._agent.remove_remote_agent(peer)

    def _welcome(self, hello: Hello, added: list[str]) -> Welcome:
        welcome = self._handshake(hello.layout)
        if welcome.refusal:
            return welcome
        # NOTE: load prefill's connection info before answering, so our first reply can reach it.
        try:
            added.append(agent_name(self._agent.add_remote_agent(hello.nixl_metadata)))
            if self.layout.converts_from(hello.layout) or hello.layout.num_kv_heads != self.layout.num_kv_heads:
                self._staging.allocate()  # a payload to convert, or one rank's heads, lands there
        except Exception as e:  # NOTE: the bindings raise their own exception classes (nixl*Error)
            return replace(welcome, refusal=f"unusable NIXL agent metadata: {e!r}")
        self._peers.add(added[-1])
        return replace(welcome, nixl_metadata=self._metadata)

    async def _poll_loop(self) -> None:
        poller = self._poller
        swept_at = 0.0
        while True:
            notifs = poll_notifs(self._agent, self._on_notif)
            if self._staging.expire():
                self._grant_waiting()
            if time.monotonic() - swept_at > _REVOKE_SWEEP_S:  # e.g. a lease that ran out between notifications
                swept_at = time.monotonic()
                self._revoke_ended()
                self._exposed.expire()
            await poller.pause(notifs, bool(self._grants or self._staging.waiting),
                               (len(self._grants), len(self._staging.waiting)),
                               expecting=bool(self._events.request_ids()))

    def _on_notif(self, peer: str, raw: bytes) -> None:
        message = accept_notif(peer, peer in self._peers, raw)
        if message is None:
            return
        if isinstance(message, Claim):
            self._notify(peer, self._on_claim(peer, message))
        elif isinstance(message, Written):
            self._on_written(peer, message)
        elif isinstance(message, DoneHeader):
            self._notify(peer, self._admit_done(message, in_order=False, origin=peer))
            self._revoke_ended()
        else:
            logger.warning("dropped an unexpected %s notification from %s", type(message).__name__, peer)

    def _on_claim(self, peer: str, claim: Claim) -> Grant | Reject | None:
        """Grants the pool's regions, or a staging range to a payload to convert (None: it waits)."""
        header = claim.header
        key = (peer, claim.claim_id)
        try:
            reservation = self._table.check_layer(header)
            if self._in_place(header):
                metadata, device_id = self._exposed.grant(peer, header.request_id, reservation, LATE_WRITE_WINDOW_S)
                grant = Grant(header.request_id, claim.claim_id, self._pool_addrs(header), self.layout.region_bytes,
                              metadata, device_id)
            elif self._staging.buffer is None:
                raise PayloadRejected(header.request_id, f"dtype {header.dtype}, KV heads from "
                                      f"{header.kv_head_start}: no handshake declared them, no staging",
                                      request_known=True)
            else:
                staged = self._staging.grant(key, header)
                if staged is None:
                    self._staging.waiting.append((peer, claim))
                    return None
                grant = Grant(header.request_id, claim.claim_id, tuple(staged.addrs.tolist()), staged.region_bytes,
                              staged.metadata, staged.device_id)
        except PayloadRejected as e:
            return self._reject(e)
        except Exception as e:  # NOTE: a registration the bindings refused (nixl*Error): this request fails
            logger.warning("could not register the regions of a grant for request %s: %r", header.request_id, e)
            return self._reject(PayloadRejected(header.request_id, f"decode could not register its regions: {e!r}",
                                                request_known=True))
        self._grants[key] = header
        return grant

    def _in_place(self, header: LayerHeader) -> bool:
        """The payload may be written straight into the pool's regions: same element type (and FP8
        scales), every head of the pool. Otherwise it is staged, then converted or copied into its
        heads of the blocks."""
        return self.layout.stores_as(header.dtype, header.scales, header.layer) and self._whole_pool(header)

    def _pool_addrs(self, header: LayerHeader) -> tuple[int, ...]:
        return tuple(region_addrs(self.kv_cache, self.layout, header.layer, header.dst_block_ids).tolist())

    def _grant_waiting(self) -> None:
        waiting, self._staging.waiting = self._staging.waiting, deque()
        for peer, claim in waiting:
            self._notify(peer, self._on_claim(peer, claim))

    def _on_written(self, peer: str, written: Written) -> None:
        header = written.header
        granted = self._grants.pop((peer, written.claim_id), None)
        if granted is not None and self._in_place(granted):
            self._exposed.written(granted.request_id)  # its WRITE landed
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
        self._notify(peer, self._admit_layer(header, lambda: None if self._in_place(header) else cast()))
        if self._staging.release(key):
            self._grant_waiting()
        ready = self._ready_done(header.request_id)
        if ready is not None:  # NOTE: answered to the final message's sender (a TP worker's rank 0)
            ack, origin = ready
            self._notify(str(origin), ack)
            self._revoke_ended()

    def _reject(self, error: PayloadRejected) -> Reject:
        self._drop_grants(error.request_id)
        return super()._reject(error)

    def _answer_deferred(self, origin: object, reply: Ack | Reject) -> None:
        self._notify(str(origin), reply)
        self._revoke_ended()

    def _on_io(self, fn: Callable[..., object], *args: object) -> None:
        self._io.call_soon(fn, *args)

    def _drop_grants(self, request_id: str) -> None:
        for key in [k for k, granted in self._grants.items() if granted.request_id == request_id]:
            del self._grants[key]
            self._staging.hold(key, LATE_WRITE_WINDOW_S)  # a granted WRITE may still land there
        self._staging.waiting = deque((p, c) for p, c in self._staging.waiting if c.header.request_id != request_id)
        self._revoke_ended()

    def _revoke_ended(self) -> None:
        """Revoke the registrations of reservations that ended (grants.py)."""
        self._exposed.revoke_ended(self._table.is_live, LATE_WRITE_WINDOW_S)

    def _notify(self, peer: str, message: Message | None) -> None:
        if message is not None:  # None: no reply (yet)
            self._agent.send_notif(peer, encode_notif(message))
