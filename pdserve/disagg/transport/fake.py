"""In-process KV transport for tests: the sender hands payloads straight to a receiver object in the
same process. Same handshake, same validation (`ReservationTable`), same events and acks as the
real transports; no thread, so the sender's calling thread does the copy.

`FakeKVSender(..., stall_after_layers=k)` stops making progress on every request after its first
`k` layer payloads: later payloads and the final message are swallowed, so `flush` and
`receiver.wait` time out, which is what failure-policy tests need.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import Counter

import torch

from pdserve.disagg.kv_layout import KVLayout
from pdserve.disagg.transport.base import KVReceiver
from pdserve.disagg.transport.messages import Ack, DoneHeader, Hello, LayerHeader, Reject, Welcome
from pdserve.disagg.transport.ready import NO_WAIT, LayerReady
from pdserve.disagg.transport.sender_base import KVSender

_receivers: weakref.WeakValueDictionary[str, FakeKVReceiver] = weakref.WeakValueDictionary()
_next_id = itertools.count()


class FakeKVReceiver(KVReceiver):
    """Contract: see KVReceiver. `address` is 'fake://N', valid inside this process only; `host`
    and `port` are accepted like the real receivers' (so a worker makes any receiver the same
    way) and ignored."""

    def __init__(self, layout: KVLayout, kv_cache: torch.Tensor, host: str = "", port: int = 0, *,
                 peers: object = None) -> None:
        """`peers` (the KV port's policy) is accepted like the real receivers' and unused: no port."""
        super().__init__(layout, kv_cache)
        self._address = f"fake://{next(_next_id)}"
        self._closed = False
        _receivers[self._address] = self

    @property
    def address(self) -> str:
        return self._address

    def close(self) -> None:
        self._closed = True
        _receivers.pop(self._address, None)

    def accept_hello(self, hello: Hello) -> Welcome:
        return self._handshake(hello.layout)

    def accept_layer(self, header: LayerHeader, payload: torch.Tensor) -> Ack | Reject:
        return self._write_layer(header, payload)

    def accept_done(self, header: DoneHeader) -> Ack | Reject:
        reply = self._admit_done(header, in_order=True)
        assert reply is not None, "the fake delivers in order: a final message is never deferred"
        return reply



class FakeKVSender(KVSender):
    """Contract: see KVSender; `send_layer` copies synchronously, `flush` only reads the acks."""

    def __init__(self, layout: KVLayout, kv_cache: torch.Tensor, stall_after_layers: int | None = None, *,
                 secret: object = None) -> None:
        """`secret` is accepted like the real senders' and unused: the fake has no wire to guard."""
        super().__init__(layout, kv_cache)
        self._stall_after_layers = stall_after_layers
        self._num_layers_sent: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._peer: FakeKVReceiver | None = None

    def connect(self, address: str) -> None:
        peer = _receivers.get(address)
        if peer is None:
            raise ConnectionError(f"no fake KV receiver at {address!r} in this process")
        self._check_welcome(peer.accept_hello(Hello(self.layout, b"")))
        self._peer = peer

    def send_layer(self, request_id: str, layer: int, src_block_ids: list[int], dst_block_ids: list[int],
                   ready: LayerReady = NO_WAIT, *, token: str = "") -> None:
        """`ready` unused: the copy is queued on the engine's thread, so on its stream after the layer."""
        peer = self._connected()
        self._check_sources(layer, src_block_ids)
        self._acks.sent_layer(request_id)
        if self._abandoned_request(request_id) or self._stalled(request_id, count=True):
            return
        header = self._layer_header(request_id, layer, len(src_block_ids), dst_block_ids, token)
        src = torch.tensor(src_block_ids, dtype=torch.long, device=self.kv_cache.device)
        payload = self.kv_cache[layer].index_select(1, src).reshape(-1).view(torch.uint8)
        self._on_reply(peer.accept_layer(header, payload))

    def send_done(self, request_id: str, record: bytes, *, token: str = "") -> None:
        peer = self._connected()
        num_layers = self._announced_layers(request_id)
        if self._abandoned_request(request_id) or self._stalled(request_id, count=False):
            return
        with self._lock:
            self._num_layers_sent.pop(request_id, None)
        self._on_reply(peer.accept_done(DoneHeader(request_id, num_layers, record, token)))

    def close(self) -> None:
        self._peer = None
        self._acks.fail_all("sender closed")

    def _connected(self) -> FakeKVReceiver:
        if self._peer is None or self._peer._closed:
            raise ConnectionError("fake KV sender is not connected to an open receiver")
        return self._peer

    def _stalled(self, request_id: str, *, count: bool) -> bool:
        """True once the request used up its `stall_after_layers` payloads."""
        if self._stall_after_layers is None:
            return False
        with self._lock:
            stalled = self._num_layers_sent[request_id] >= self._stall_after_layers
            if count and not stalled:
                self._num_layers_sent[request_id] += 1
            return stalled
