"""A worker's KV side across the engine-core link: the calls its API process makes of it, the events
it reports, and the API process's stand-ins for what lives in the engine process.

    API process                                      engine process (disagg/worker/core.py)
    DecodeService -> RemoteReceiver   --kv calls-->   the KV receiver: expect, cancel
                     (a mirror of its events) <--kv events--  progress / done / rejected per transfer
    PrefillService -> RemoteSenders   --kv calls-->   PrefillKV: connect, send_done, flush, release
                                      <--replies--    (errors by name: `KV_ERRORS`)

A call is `[method, *args]`, an event `[kind, transfer id, *fields]`; both sides run the same code
and check every field's type (a wrong one is a `CoreWireError`: the link is broken). Keepalives
(`touch`) and the transfer clocks stay in the API process: its mirror of the receiver's event box
counts them, fed the engine side's events as they happen.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from pdserve.disagg.kv_layout import KVLayout, KVLayoutMismatch
from pdserve.disagg.transport.errors import KVTransferError, KVTransferTimeout
from pdserve.disagg.transport.messages import KVDone, KVEvent, KVProgress, KVRejected
from pdserve.disagg.transport.progress import EventBox
from pdserve.engine.core_client import CoreCallError, EngineCoreClient
from pdserve.engine.core_wire import CoreWireError, typed

_GONE_KEPT = 1 << 16  # transfers ended here whose late events are dropped, not mirrored again


# -- errors -------------------------------------------------------------------------------------

def error_reply(exc: BaseException) -> tuple[str, list[str]]:
    """The name and detail an exception of the KV side crosses as (`KV_ERRORS` rebuilds it)."""
    if isinstance(exc, KVLayoutMismatch):
        return "kv_layout", [exc.field, exc.local, exc.peer]
    if isinstance(exc, KVTransferTimeout):
        return "kv_timeout", []
    if isinstance(exc, KVTransferError):
        return "kv_error", []
    if isinstance(exc, ValueError):
        return "value", []
    return "runtime", []


def _rebuilt(exc: CoreCallError) -> Exception:
    message = str(exc)
    if exc.kind == "kv_layout" and len(exc.detail) == 3:
        return KVLayoutMismatch(exc.detail[0], exc.detail[1], exc.detail[2], message)
    if exc.kind == "kv_timeout":
        return KVTransferTimeout(message)
    if exc.kind == "kv_error":
        return KVTransferError(message)
    return RuntimeError(message)


async def _call(client: EngineCoreClient, kv: list[Any]) -> Any:
    try:
        return await client.call_kv(kv)
    except CoreCallError as exc:
        raise _rebuilt(exc) from None


# -- events -------------------------------------------------------------------------------------

def encode_event(event: KVEvent) -> list[Any]:
    if isinstance(event, KVProgress):
        return ["progress", event.request_id, event.layer, list(event.block_ids)]
    if isinstance(event, KVDone):
        return ["done", event.request_id, event.record]
    return ["rejected", event.request_id, event.reason]


def decode_event(value: list[Any]) -> KVEvent:
    kind, rid, *fields = value
    typed(rid, str, "transfer id")
    if kind == "progress" and len(fields) == 2:
        layer, blocks = fields
        return KVProgress(rid, typed(layer, int, "layer"), tuple(typed(b, int, "block") for b in
                                                                  typed(blocks, list, "blocks")))
    if kind == "done" and len(fields) == 1:
        return KVDone(rid, typed(fields[0], bytes, "hand-off record"))
    if kind == "rejected" and len(fields) == 1:
        return KVRejected(rid, typed(fields[0], str, "reason"))
    raise CoreWireError(f"KV event: unknown {kind!r} with {len(fields)} fields")


# -- the API process's stand-ins ----------------------------------------------------------------

class RemoteReceiver:
    """Decode role, API process: the `ReceiverView` of the KV receiver in the engine process. The
    engine side expects a transfer as its blocks are reserved (`ReserveRemote`) or when told here
    (`expect`: a retarget), and reports its events; this mirror queues them per transfer and times
    them (`wait`, `touch`) as the receiver's own event box would."""

    def __init__(self, client: EngineCoreClient, layout: KVLayout, kv_address: str) -> None:
        self.client = client
        self._layout = layout
        self._kv_address = kv_address
        self._box = EventBox()
        self._lock = threading.Lock()  # the box's open transfers: the event loop and the link's reader
        self._gone: OrderedDict[str, None] = OrderedDict()  # ended here: their late events are dropped
        self._opened: set[str] = set()  # open in the box and not ended here (the lock's)
        client.kv_listener = self._on_events

    @property
    def layout(self) -> KVLayout:
        return self._layout

    @property
    def kv_address(self) -> str:
        return self._kv_address

    @property
    def num_dtype_conversions(self) -> int:
        return self.client.kv_stats.get("num_dtype_conversions", 0)

    def expect(self, request_id: str, block_ids: list[int] | tuple[int, ...], token: str = "") -> None:
        with self._lock:
            self._gone.pop(request_id, None)
            self._open(request_id)
        self.client.tell_kv(["expect", request_id, list(block_ids), token])

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self._end(request_id)
            self._box.close(request_id, "cancelled")
        self.client.tell_kv(["cancel", request_id])

    def touch(self, request_id: str, step_s: float | None = None) -> None:
        self._box.touch(request_id, step_s)

    async def settled(self) -> None:
        """The engine side runs `expect` and `cancel` in the order they were sent, each at once on
        its KV loop: the answer to a call sent after them means they are in effect."""
        await _call(self.client, ["settled"])

    async def wait(self, request_id: str, timeout_s: float) -> KVEvent:
        with self._lock:
            if request_id not in self._gone:
                self._open(request_id)
        return await self._box.get(request_id, timeout_s)

    def close(self) -> None:
        """The receiver closes with its engine process."""

    def _on_events(self, events: list[list[Any]]) -> None:
        """The link's reader thread: the engine side's events, in order."""
        for value in events:
            event = decode_event(value)
            rid = event.request_id
            with self._lock:
                if rid in self._gone:
                    continue  # NOTE: ended here (cancelled, or its last event is in): a late event
                self._open(rid)
                if isinstance(event, KVDone | KVRejected):
                    self._end(rid)
            self._box.put(event)

    def _open(self, request_id: str) -> None:
        """Lock held. NOTE: the box's own set is looked at once per transfer, not per event."""
        if request_id not in self._opened:
            if request_id not in self._box.request_ids():
                self._box.open(request_id)
            self._opened.add(request_id)

    def _end(self, request_id: str) -> None:
        """Lock held."""
        self._opened.discard(request_id)
        self._gone[request_id] = None
        if len(self._gone) > _GONE_KEPT:
            self._gone.popitem(last=False)


class RemoteSenders:
    """Prefill role, API process: the `SenderHandles` of the engine side's `PrefillKV`."""

    def __init__(self, client: EngineCoreClient) -> None:
        self.client = client

    async def connect(self, kv_address: str) -> int:
        return int(await _call(self.client, ["connect", kv_address]))

    def send_done(self, handle: int, request_id: str, record: bytes, *, token: str) -> None:
        self.client.tell_kv(["send_done", handle, request_id, record, token])

    async def flush(self, handle: int, request_id: str, timeout_s: float) -> None:
        await _call(self.client, ["flush", handle, request_id, timeout_s])

    async def release(self, handle: int, request_id: str) -> None:
        await _call(self.client, ["release", handle, request_id])

    def close(self) -> None:
        """The senders close with their engine process."""
