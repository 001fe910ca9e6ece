"""No KV posted before the device wrote it (issue 44, item 2; transport/ready.py). On a GPU the
layer callback fires when layer l's kernels are launched, not done; each send carries an event
recorded on the compute stream right after the layer, and a sender's I/O thread waits on it before
it reads the pool. Here a fake stream stands for the GPU: its "kernels" (the writes of each layer's
KV) run only when an event recorded after them is synchronized, so any read that does not wait
sees the stale pool."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from kv_transport_helpers import PoolSpec, record

from pdserve.disagg.transport import KVDone, KVProgress, make_receiver, make_sender
from pdserve.disagg.transport.messages import Grant
from pdserve.disagg.transport.nixl.sender import NixlKVSender, _PendingClaim
from pdserve.disagg.transport.progress import AckTracker
from pdserve.disagg.transport.ready import NO_WAIT, layer_ready
from pdserve.disagg.worker.kv_streamer import KVDestination, KVStreamer

SPEC = PoolSpec()
TIMEOUT_S = 10.0


class FakeStream:
    """Launched kernels that run only when an event recorded after them is synchronized (any thread)."""

    def __init__(self) -> None:
        self.kernels: list[Callable[[], None]] = []
        self.done = 0
        self._lock = threading.Lock()

    def launch(self, kernel: Callable[[], None]) -> None:
        with self._lock:
            self.kernels.append(kernel)

    def record(self) -> FakeEvent:
        with self._lock:
            return FakeEvent(self, len(self.kernels))

    def run_until(self, end: int) -> None:
        with self._lock:
            while self.done < end:
                self.kernels[self.done]()
                self.done += 1


class FakeEvent:
    def __init__(self, stream: FakeStream, end: int) -> None:
        self.stream, self.end = stream, end

    def synchronize(self) -> None:
        self.stream.run_until(self.end)


def _chunk(rid: str, num_tokens: int, block_ids: list[int]) -> Any:
    request = SimpleNamespace(request_id=rid, num_computed_tokens=0, block_ids=block_ids)
    return SimpleNamespace(request=request, num_new_tokens=num_tokens)


def test_tcp_sends_what_each_layer_wrote_not_the_stale_pool() -> None:
    """A prefill step's layers through the streamer into the TCP sender; decode must hold the KV
    the "kernels" wrote (without the wait: the zeros the pool held before the step)."""
    truth, prefill_pool, decode_pool = SPEC.pool(1), torch.zeros_like(SPEC.pool(1)), SPEC.pool(2)
    receiver = make_receiver("tcp", SPEC.layout(decode_pool), decode_pool)
    sender = make_sender("tcp", SPEC.layout(prefill_pool), prefill_pool)
    stream = FakeStream()
    try:
        sender.connect(receiver.address)
        src, dst = [3, 4, 9], [1, 2, 5]
        receiver.expect("r", dst)
        streamer = KVStreamer(SPEC.block_size, SPEC.num_layers, KVDestination(sender, receiver.address, ""),
                              ready=stream.record)
        streamer.expect("r", dst, 0)
        chunks = [_chunk("r", 3 * SPEC.block_size, src)]
        for layer in range(SPEC.num_layers):  # the forward: launch the layer, then its callback
            stream.launch(lambda layer=layer: prefill_pool[layer].copy_(truth[layer]))
            streamer(layer, chunks)
        sender.send_done("r", record(7))

        async def finish() -> object:
            await sender.flush("r", TIMEOUT_S)
            event = await receiver.wait("r", TIMEOUT_S)
            while isinstance(event, KVProgress):
                event = await receiver.wait("r", TIMEOUT_S)
            return event

        assert asyncio.run(finish()) == KVDone("r", record(7))
        assert torch.equal(decode_pool[:, :, dst], truth[:, :, src]), "decode received KV the layers had not written"
    finally:
        sender.close()
        receiver.close()


class _Agent:
    """NIXL's agent as `_post_write` uses it: the WRITE must not be posted before the layer's event."""

    def __init__(self, written: list[bool]) -> None:
        self.written, self.posted = written, 0

    def get_xfer_descs(self, rows: np.ndarray, mem_type: str) -> np.ndarray:
        return rows

    def initialize_xfer(self, *args: object) -> str:
        assert all(self.written), "a NIXL WRITE was posted before the layer's event completed"
        self.posted += 1
        return "handle"

    def transfer(self, handle: str) -> str:
        return "PROC"


def test_nixl_posts_a_write_only_once_the_layers_event_completed() -> None:
    pool = SPEC.pool(1)
    layout = SPEC.layout(pool)
    written = [False]
    event = SimpleNamespace(synchronize=lambda: written.__setitem__(0, True))
    sender = object.__new__(NixlKVSender)  # NOTE: no agent, no peer: only the post under test
    sender.layout, sender.kv_cache, sender._acks, sender._rows = layout, pool, AckTracker(), False
    sender._mem_type, sender._device_id, sender._peer, sender._in_flight = "DRAM", 0, "decode", []
    sender._agent = agent = _Agent(written)
    header = sender._layer_header("r", 1, 2, [5, 6], "")
    grant = Grant("r", 0, tuple(range(0, 4 * layout.region_bytes, layout.region_bytes)), layout.region_bytes)
    sender._post_write(grant, _PendingClaim(header, (3, 4), ready=event))
    assert agent.posted == 1 and written == [True] and len(sender._in_flight) == 1


def test_every_send_carries_the_event_after_its_layer_and_place_one_after_the_step() -> None:
    stream, sent = FakeStream(), []
    streamer = KVStreamer(SPEC.block_size, SPEC.num_layers, lambda *a: sent.append(a), ready=stream.record)
    streamer.expect("r", [1], 0)
    for layer in range(SPEC.num_layers):
        stream.launch(lambda: None)
        streamer(layer, [_chunk("r", 2, [7])])
    assert [(s[1], s[4].end) for s in sent] == [(layer, layer + 1) for layer in range(SPEC.num_layers)]
    sent.clear()
    streamer.expect("u", None)
    stream.launch(lambda: None)
    assert streamer.place("u", [2], 0, request=SimpleNamespace(num_computed_tokens=3, block_ids=[8]))
    assert [s[4].end for s in sent] == [len(stream.kernels)] * SPEC.num_layers
    assert layer_ready(torch.device("cpu"))() is NO_WAIT
