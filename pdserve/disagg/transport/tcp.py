"""KV transport over plain TCP: asyncio on a private I/O thread, length-prefixed frames, no pickle.

Bytes go straight between the pools and the kernel, with no copy in Python:
- sender: a layer payload is the list of the source blocks' K and V regions in the prefill pool,
  written with one `sendmsg` per kernel-sized chunk (the kernel gathers the regions);
- receiver: the frame header is validated against the reservation first, then the payload is
  read with `recvmsg_into` straight into the reserved destination regions of the decode pool.
  Each of those syscalls holds the reservation lock and first checks the reservation is still
  live, so once `cancel` returns no byte lands in the cancelled blocks (the rest is discarded).
  If the connection drops mid-payload, the request's own reserved blocks hold part of a layer;
  the layer was not acknowledged and the request fails, so no one reads them.
A pool on an accelerator goes through host memory instead: the sender gathers the blocks
(`index_select`) and copies them to the host, the receiver reads into a host staging tensor and
`index_copy_`s it into the pool after the same validation. So does a payload in another element
type (or FP8 scales) than the decode pool's (`--kv-cache-dtype` differs between the roles), or of one
tensor-parallel rank's KV heads (strided within each block): the receiver reads it into staging
(one buffer per connection, kept) and casts or copies it into the blocks, one layer at a time.
A tensor-parallel prefill worker whose ranks have pools of their own opens one connection per
rank; its final message (rank 0's) waits for the layers the other ranks send on theirs.

    prefill I/O thread                         decode I/O thread
                                 <------       CHALLENGE {nonce}   (handshake.py: the cluster secret)
    HELLO {layout, proof}        ------>       check proof, layout (refuse: WELCOME{refusal}, close)
                                 <------       WELCOME {layout, proof}
    LAYER {header} + payload     ------>       validate header; payload -> reserved blocks
                                 <------       ACK | REJECT
    DONE {hand-off record}       ------>       KVDone
                                 <------       ACK | REJECT

Why not gather into a contiguous buffer + receive into staging + `index_copy_` on CPU too: on
2 CPUs over loopback each extra pass over the payload costs about half a raw socket's time; that
design measured 0.36-0.40x a raw socket, the direct one 0.68x (scattered blocks) to 0.87x
(contiguous runs) for 256 MiB (`python -m pdserve.bench.kv_transport`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.disagg.auth import ClusterSecret
from pdserve.disagg.handoff import max_record_bytes
from pdserve.disagg.kv_layout import KVLayout
from pdserve.disagg.transport import frames, regions
from pdserve.disagg.transport.base import KVReceiver
from pdserve.disagg.transport.frames import Frame, ProtocolError
from pdserve.disagg.transport.handshake import KVPeerGate, KVPeerPolicy, say_hello
from pdserve.disagg.transport.io_thread import IoThread
from pdserve.disagg.transport.messages import Ack, DoneHeader, Hello, LayerHeader, Reject
from pdserve.disagg.transport.ready import NO_WAIT, LayerReady
from pdserve.disagg.transport.reservations import PayloadRejected
from pdserve.disagg.transport.sender_base import KVSender

logger = logging.getLogger(__name__)

_CONNECT_TIMEOUT_S = 10.0


class TcpKVReceiver(KVReceiver):
    """Listens on `host:port` (port 0 picks a free one); `peers` says who may connect (default: no
    secret). Contract: see KVReceiver."""

    def __init__(self, layout: KVLayout, kv_cache: torch.Tensor, host: str = "127.0.0.1", port: int = 0, *,
                 peers: KVPeerPolicy | None = None) -> None:
        super().__init__(layout, kv_cache)
        self.gate = KVPeerGate(peers or KVPeerPolicy())
        self._listener = frames.listen(host, port)
        self._address = f"tcp://{host}:{self._listener.getsockname()[1]}"
        # NOTE: a payload can never exceed one layer of the whole pool; anything larger is garbage.
        self._max_payload_bytes = kv_cache.shape[2] * layout.block_bytes_per_layer
        # NOTE: nor can a final message's hand-off record outgrow a prompt that fills the pool (base64: 4/3)
        self._max_header_bytes = frames.MAX_HEADER_BYTES + 4 * -(-max_record_bytes(
            kv_cache.shape[2] * layout.block_size) // 3)
        self._flat = regions.pool_bytes(kv_cache) if kv_cache.device.type == "cpu" else None
        self._io = IoThread("pdserve-kv-tcp-recv")
        self._io.submit(self._accept_loop())

    @property
    def address(self) -> str:
        return self._address

    def close(self) -> None:
        self._io.stop()
        self._listener.close()

    async def _accept_loop(self) -> None:
        await frames.accept_forever(self._listener, self._serve)

    async def _serve(self, sock: socket.socket) -> None:
        with sock, self.gate.slot(sock) as admitted:
            try:
                decide = lambda hello: self._handshake(hello.layout)  # noqa: E731
                hello = await self.gate.handshake(sock, decide) if admitted else None
                if hello is not None:
                    await self._receive_loop(_Connection(sock), hello.layout.num_kv_heads == self.layout.num_kv_heads)
            except (ConnectionError, OSError) as e:
                logger.info("KV connection from prefill closed: %s", e)
            except Exception:  # a bug: drop this connection, keep serving the others
                logger.exception("KV receiver connection handler crashed")

    async def _receive_loop(self, connection: _Connection, whole_pool: bool) -> None:
        """`whole_pool`: the peer sends every head of the pool and no other decode rank takes a
        share of the request, so its frames all come this way, in order; else (one rank of a
        tensor-parallel prefill worker, or decode ranks with a pool each) its final message may
        come before other connections' layers and waits for them."""
        sock, staging = connection.sock, _Staging()  # this connection's: its frames arrive one after the other
        while True:
            frame = await frames.recv_frame(sock, self._max_payload_bytes, self._max_header_bytes)
            if isinstance(frame.header, LayerHeader):
                reply: Ack | Reject | None = await self._receive_layer(sock, frame, frame.header, staging)
                ready = self._ready_done(frame.header.request_id)
                if ready is not None:  # a deferred final message, answered on its own connection
                    ack, origin = ready
                    assert isinstance(origin, _Connection)
                    await origin.send(ack)
            elif isinstance(frame.header, DoneHeader) and not frame.payload_len:
                in_order = whole_pool and self.ranks is None
                reply = self._admit_done(frame.header, in_order=in_order, origin=connection)
                assert reply is not None or not in_order, "frames in order: the final message is never deferred"
            else:
                raise ProtocolError(f"unexpected {frame.kind.name} frame from prefill")
            if reply is not None:
                await connection.send(reply)

    def _answer_deferred(self, origin: object, reply: Ack | Reject) -> None:
        assert isinstance(origin, _Connection)
        asyncio.get_running_loop().create_task(origin.send(reply))

    def _on_io(self, fn: Callable[..., object], *args: object) -> None:
        self._io.call_soon(fn, *args)

    async def _receive_layer(self, sock: socket.socket, frame: Frame, header: LayerHeader,
                             staging: _Staging) -> Ack | Reject:
        try:
            if header.num_bytes != frame.payload_len:
                raise PayloadRejected(header.request_id, f"header announces {header.num_bytes} bytes, frame "
                                      f"carries {frame.payload_len}", self._table.is_reserved(header.request_id))
            reservation = self._table.check_layer(header)
        except PayloadRejected as e:
            await frames.discard(sock, frame.payload_len)
            return self._reject(e)
        if (self._flat is None or not self.layout.stores_as(header.dtype, header.scales, header.layer)
                or not self._whole_pool(header)):
            return await self._receive_staged(sock, header, staging.take(header.num_bytes))
        views = regions.payload_views(self.layout, self.kv_cache, self._flat, header.layer, header.dst_block_ids)
        unread = await frames.recv_into_views(sock, views, lambda: self._table.writing(header.request_id, reservation))
        if unread:
            await frames.discard(sock, unread)
            return Reject(header.request_id, "cancelled while its payload was arriving")
        return self._admit_layer(header, lambda: None)  # counts it, delivers KVProgress

    async def _receive_staged(self, sock: socket.socket, header: LayerHeader, staging: torch.Tensor) -> Ack | Reject:
        await frames.recv_into(sock, staging.numpy().data)
        return self._write_layer(header, staging)


class _Connection:
    """A prefill connection; replies to it go one frame at a time (a deferred final message's
    answer is sent from the connection whose layer completed it)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._sending = asyncio.Lock()

    async def send(self, reply: Ack | Reject) -> None:
        async with self._sending:
            await frames.send_frame(self.sock, reply)


class _Staging:
    """A connection's host staging buffer, kept and grown to its largest payload (at most one layer
    of the pool): a fresh tensor per payload faulted its pages in each time, ~3x the cast's own
    cost for 32 MiB on CPU."""

    def __init__(self) -> None:
        self._buffer = torch.empty(0, dtype=torch.uint8)

    def take(self, num_bytes: int) -> torch.Tensor:
        if self._buffer.numel() < num_bytes:
            self._buffer = torch.empty(num_bytes, dtype=torch.uint8)
        return self._buffer[:num_bytes]


@dataclass(frozen=True, slots=True)
class _LayerJob:
    header: LayerHeader
    src_block_ids: tuple[int, ...]
    ready: LayerReady = NO_WAIT  # the layer's end on the compute stream (ready.py)


class TcpKVSender(KVSender):
    """Contract: see KVSender. All socket work happens on the sender's own I/O thread; jobs are sent
    in call order over one connection, so a request's frames arrive in layer order."""

    def __init__(self, layout: KVLayout, kv_cache: torch.Tensor, *, secret: ClusterSecret | None = None) -> None:
        super().__init__(layout, kv_cache, strided=True)
        self._secret = secret
        # NOTE: some heads of a larger pool (RankedKVSender) are gathered like an accelerator's blocks
        contiguous = kv_cache.device.type == "cpu" and kv_cache.is_contiguous()
        self._flat = regions.pool_bytes(kv_cache) if contiguous else None
        self._io = IoThread("pdserve-kv-tcp-send")
        self._sock: socket.socket | None = None
        self._jobs: asyncio.Queue[_LayerJob | DoneHeader] | None = None
        self._broken = ""  # why the connection is gone; set once, on the I/O thread
        self._sending = ""  # the request whose frame the write loop is writing now

    def connect(self, address: str) -> None:
        if self._sock is not None:
            raise RuntimeError("this sender is already connected; use one sender per decode worker")
        host, port = frames.parse_address(address, "tcp")
        self._io.run(self._connect(host, port), timeout_s=_CONNECT_TIMEOUT_S)

    @property
    def broken(self) -> str:
        return self._broken

    def send_layer(self, request_id: str, layer: int, src_block_ids: list[int], dst_block_ids: list[int],
                   ready: LayerReady = NO_WAIT, *, token: str = "") -> None:
        self._check_sources(layer, src_block_ids)
        header = self._layer_header(request_id, layer, len(src_block_ids), dst_block_ids, token)
        self._acks.sent_layer(request_id)
        self._enqueue(request_id, _LayerJob(header, tuple(src_block_ids), ready))

    def send_done(self, request_id: str, record: bytes, *, token: str = "") -> None:
        num_layers = self._announced_layers(request_id)
        self._enqueue(request_id, DoneHeader(request_id, num_layers, record, token))

    def close(self) -> None:
        self._io.stop()
        if self._sock is not None:
            self._sock.close()
        self._acks.fail_all("sender closed")

    def _enqueue(self, request_id: str, job: _LayerJob | DoneHeader) -> None:
        if self._jobs is None:
            raise RuntimeError("connect() first")
        if self._broken:
            self._acks.failed(request_id, self._broken)
            return
        self._io.call_soon(self._jobs.put_nowait, job)

    async def _connect(self, host: str, port: int) -> None:
        sock = await frames.connect(host, port)
        try:
            self._check_welcome(await say_hello(sock, Hello(self.layout, b""), self._secret))
        except BaseException:
            sock.close()
            raise
        self._sock, self._jobs = sock, asyncio.Queue()
        loop = asyncio.get_running_loop()
        loop.create_task(self._write_loop(sock, self._jobs))
        loop.create_task(self._read_loop(sock))

    async def _write_loop(self, sock: socket.socket, jobs: asyncio.Queue[_LayerJob | DoneHeader]) -> None:
        try:
            while True:
                job = await jobs.get()
                rid = job.request_id if isinstance(job, DoneHeader) else job.header.request_id
                self._sending = rid  # NOTE: before the check; see _abandoned_request
                try:
                    if self._abandoned_request(rid):
                        continue  # released: its blocks may hold another request's KV by now
                    if isinstance(job, DoneHeader):
                        await frames.send_frame(sock, job)
                    else:
                        await frames.send_frame(sock, job.header, self._payload(job))
                finally:
                    self._sending = ""
        except (ConnectionError, OSError) as e:
            self._lost(e)
        except Exception as e:  # a bug: fail loudly rather than let every flush time out
            logger.exception("KV sender write loop crashed")
            self._lost(e)

    def _reading(self, request_id: str) -> bool:
        return self._sending == request_id

    def _payload(self, job: _LayerJob) -> list[memoryview]:
        """The source blocks' regions of the pool itself, or a host copy (an accelerator pool, or
        some heads of a pool), once the layer's kernels wrote them (transport/ready.py)."""
        job.ready.synchronize()  # NOTE: this thread's stream need not be the one that wrote the layer
        if self._flat is not None:
            return regions.payload_views(self.layout, self.kv_cache, self._flat, job.header.layer, job.src_block_ids)
        src = torch.tensor(job.src_block_ids, dtype=torch.long, device=self.kv_cache.device)
        host = self.kv_cache[job.header.layer].index_select(1, src).cpu().contiguous()
        return [host.view(-1).view(torch.uint8).numpy().data]

    async def _read_loop(self, sock: socket.socket) -> None:
        try:
            while True:
                frame = await frames.recv_frame(sock, max_payload_bytes=0)
                if not isinstance(frame.header, Ack | Reject):
                    raise ProtocolError(f"unexpected {frame.kind.name} frame from decode")
                self._on_reply(frame.header)
        except (ConnectionError, OSError) as e:
            self._lost(e)

    def _lost(self, error: Exception) -> None:
        # NOTE: with nothing in flight on it, a lost connection costs nothing (a decode worker that
        # stopped, a restart: the next hand-off connects again); what it fails says so itself
        in_flight = self._acks.request_ids()
        (logger.warning if in_flight else logger.info)("KV connection to decode lost: %s%s", error,
                                                        f" ({len(in_flight)} hand-offs in flight)" if in_flight else "")
        self._broken = f"connection to decode lost ({error})"
        self._acks.fail_all(self._broken)
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
