"""A worker's KV side across the engine-core link (disagg/worker/kv_link.py, disagg/worker/core.py): its
events and errors cross typed; the API process's mirror of the receiver delivers events that came
before anyone waited, times transfers out as the receiver would (keepalives included), and drops
the late events of a transfer it ended. (A whole PD cluster with its workers' engines in their own
processes: tests/test_up.py and every test that spawns `pdserve serve --role`.)"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgpack
import pytest

from pdserve.disagg.kv_layout import KVLayout, KVLayoutMismatch
from pdserve.disagg.transport.errors import KVTransferError, KVTransferTimeout
from pdserve.disagg.transport.messages import KVDone, KVProgress, KVRejected
from pdserve.disagg.worker.core import _coalesced, _typed
from pdserve.disagg.worker.kv_link import RemoteReceiver, RemoteSenders, decode_event, encode_event, error_reply
from pdserve.engine.core_client import CoreCallError
from pdserve.engine.core_wire import CoreWireError

LAYOUT = KVLayout("m", "float32", "float32", 16, 2, 2, 8)


class FakeClient:
    """What the stand-ins use of an `EngineCoreClient`: calls out, and the events' listener."""

    def __init__(self, fail_with: CoreCallError | None = None) -> None:
        self.told: list[list[Any]] = []
        self.called: list[list[Any]] = []
        self.kv_listener: Any = None
        self.kv_stats = {"num_dtype_conversions": 3}
        self.fail_with = fail_with

    def tell_kv(self, kv: list[Any]) -> None:
        self.told.append(kv)

    async def call_kv(self, kv: list[Any]) -> Any:
        self.called.append(kv)
        if self.fail_with is not None:
            raise self.fail_with
        return 7


def test_events_round_trip_and_a_malformed_one_is_refused() -> None:
    for event in (KVProgress("r@0", 3, (4, 5)), KVDone("r@0", b'{"first_token_id":9}'), KVDone("r@1", b""),
                  KVRejected("r@0", "bad token")):
        assert decode_event(msgpack.unpackb(msgpack.packb(encode_event(event)))) == event
    for bad in (["progress", "r", "3", [4]], ["done", "r", "text"], ["done", "r", 9, None, None, None, 0, None],
                ["nope", "r"],
                ["rejected", 5, "why"], ["progress", "r", 3, [4], "extra"]):
        with pytest.raises(CoreWireError):
            decode_event(bad)


def test_errors_cross_by_name_and_are_rebuilt_as_the_caller_expects_them() -> None:
    mismatch = KVLayoutMismatch("dtype", "float32", "bfloat16", "dtype differs")
    assert error_reply(mismatch) == ("kv_layout", ["dtype", "float32", "bfloat16"])
    assert error_reply(KVTransferTimeout("slow"))[0] == "kv_timeout"
    assert error_reply(KVTransferError("gone"))[0] == "kv_error"

    async def connect(error: CoreCallError) -> None:
        await RemoteSenders(FakeClient(error)).connect("tcp://x")  # type: ignore[arg-type]

    with pytest.raises(KVLayoutMismatch) as raised:
        asyncio.run(connect(CoreCallError("kv_layout", "dtype differs", ["dtype", "float32", "bfloat16"])))
    assert (raised.value.field, raised.value.local, raised.value.peer) == ("dtype", "float32", "bfloat16")
    with pytest.raises(KVTransferTimeout):
        asyncio.run(connect(CoreCallError("kv_timeout", "slow", [])))
    with pytest.raises(KVTransferError):
        asyncio.run(connect(CoreCallError("kv_error", "gone", [])))
    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(connect(CoreCallError("runtime", "boom", [])))


def test_the_receivers_mirror_delivers_times_out_and_drops_late_events() -> None:
    client = FakeClient()
    receiver = RemoteReceiver(client, LAYOUT, "tcp://127.0.0.1:1")  # type: ignore[arg-type]
    assert receiver.num_dtype_conversions == 3 and receiver.layout == LAYOUT

    async def scenario() -> None:
        # events that came before anyone waited (the engine reports them as they happen) wait for the watcher
        client.kv_listener([encode_event(KVProgress("a@0", 1, (1, 2))), encode_event(KVDone("a@0", b"5"))])
        assert await receiver.wait("a@0", 1.0) == KVProgress("a@0", 1, (1, 2))
        assert await receiver.wait("a@0", 1.0) == KVDone("a@0", b"5")
        with pytest.raises(KVTransferError):  # its last event is in: nothing more expected
            await receiver.wait("a@0", 0.01)
        client.kv_listener([encode_event(KVProgress("a@0", 1, (1, 2)))])  # late: dropped, not mirrored again
        assert "a@0" not in receiver._box.request_ids()
        # no event for the timeout: a timeout; a keepalive counts the timeout from then on
        started = time.monotonic()
        with pytest.raises(KVTransferTimeout):
            await receiver.wait("b@0", 0.05)
        waiting = asyncio.ensure_future(receiver.wait("b@0", 0.2))
        for _ in range(4):
            await asyncio.sleep(0.1)
            receiver.touch("b@0")
        assert not waiting.done(), "a keepalive must keep the transfer's clock from running out"
        client.kv_listener([encode_event(KVRejected("b@0", "bad"))])
        assert await waiting == KVRejected("b@0", "bad")
        assert time.monotonic() - started > 0.4
        # a retarget: the old attempt is cancelled there (its late events dropped), the new one expected
        receiver.expect("c@0", [3], "tok")
        receiver.cancel("c@0")
        receiver.expect("c@1", [3], "tok")
        client.kv_listener([encode_event(KVDone("c@0", b"1")), encode_event(KVDone("c@1", b"2"))])
        assert await receiver.wait("c@1", 1.0) == KVDone("c@1", b"2")
        with pytest.raises(KVTransferError):
            await receiver.wait("c@0", 0.01)
        assert client.told == [["expect", "c@0", [3], "tok"], ["cancel", "c@0"], ["expect", "c@1", [3], "tok"]]
        await receiver.settled()  # NOTE: a call behind them: they are in effect on the engine side once it answers
        assert client.called == [["settled"]]

    asyncio.run(scenario())
    assert receiver._box.request_ids() == frozenset()


def test_progress_that_arrived_together_goes_as_one_and_arguments_are_checked() -> None:
    events = [KVProgress("r", 0, (1, 2)), KVProgress("r", 1, (1, 2)), KVDone("r", b"4")]
    assert _coalesced(events) == [KVProgress("r", 1, (1, 2, 1, 2)), KVDone("r", b"4")]
    assert _coalesced(events[:1]) == events[:1]
    assert _typed([3, "r", 0.5], int, str, (int, float)) == [3, "r", 0.5]
    for bad in ([True, "r", 0.5], [3, "r"], ["3", "r", 0.5]):
        with pytest.raises(ValueError):
            _typed(bad, int, str, (int, float))
