"""KV transfer deadlines judge the peer, not a clock: a wait for the next sign of progress gives up
after the configured timeout or, for a peer that has been slow but regular lately (a long chunk
on a busy machine), after a multiple of its longest recent gap; a peer that goes silent still
times out."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from pdserve.disagg.transport import cadence
from pdserve.disagg.transport.cadence import Cadence
from pdserve.disagg.transport.errors import KVTransferTimeout
from pdserve.disagg.transport.messages import KVProgress
from pdserve.disagg.transport.progress import AckTracker, EventBox

FLOOR_S = 0.1  # the default --kv-transfer-timeout-ms
LONG_GAP_S = 0.2  # a long chunk: twice the floor, within 4 x the 80 ms the sender kept before


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_deadline_is_the_floor_then_a_multiple_of_the_longest_recent_gap_decaying_and_capped() -> None:
    clock = _Clock()
    seen = Cadence(clock)
    assert seen.timeout_s(FLOOR_S) == FLOOR_S  # nothing seen: the floor
    seen.saw(0.01)
    assert seen.timeout_s(FLOOR_S) == FLOOR_S  # quick peers: still the floor
    seen.saw(0.2)
    seen.saw(0.05)  # the longest recent gap counts, not the last
    assert seen.timeout_s(FLOOR_S) == pytest.approx(cadence.FACTOR * 0.2)
    clock.now += cadence.HALF_LIFE_S
    assert seen.timeout_s(FLOOR_S) == pytest.approx(cadence.FACTOR * 0.1)  # halved
    seen.saw(60.0)
    assert seen.timeout_s(FLOOR_S) == cadence.CAP_S  # a dead peer never holds a request longer
    assert seen.timeout_s(30.0) == 30.0  # a floor above the cap wins


def _feed(box: EventBox, request_id: str, gaps_s: list[float]) -> threading.Thread:
    """A sender that is alive but slow: one payload after each gap, from its own thread."""
    def run() -> None:
        for layer, gap_s in enumerate(gaps_s):
            time.sleep(gap_s)
            box.put(KVProgress(request_id, layer, [0]))
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_slow_but_regular_sender_is_not_timed_out_and_a_silent_one_is() -> None:
    """Payloads every 80 ms (a busy machine), then a 200 ms gap (a long chunk): with the fixed 100 ms
    the wait for that payload timed out; judged by the peer's own cadence it does not. Then the
    sender goes silent: the wait gives up after the cadence's deadline, not never."""
    async def scenario() -> tuple[int, float, float]:
        box = EventBox()
        box.open("r")
        regular = [0.02] + [0.08] * 5
        # NOTE: sent before they are read (the cadence learns at arrival): a sender thread woken late
        # on a loaded machine only makes its gaps longer, and no wait judges them by the floor alone
        _feed(box, "r", regular).join()
        for _ in regular:
            await box.get("r", FLOOR_S)
        feeder = _feed(box, "r", [LONG_GAP_S])
        await box.get("r", FLOOR_S)  # the long gap, waited for as it happens
        feeder.join()
        start = time.monotonic()
        with pytest.raises(KVTransferTimeout) as raised:
            await box.get("r", FLOOR_S)
        return len(regular) + 1, time.monotonic() - start, raised.value.limit_s

    received, silent_s, limit_s = asyncio.run(scenario())
    assert received == 7
    assert limit_s == pytest.approx(cadence.FACTOR * LONG_GAP_S, rel=0.3)  # learnt from the long gap
    assert 0.5 < silent_s < 2.0


def test_keepalives_feed_the_cadence_too() -> None:
    box = EventBox()
    box.open("r")
    box.touch("r")
    time.sleep(0.15)
    box.touch("r")
    assert box.cadence.longest_gap_s() >= 0.15
    box.close("r", "done")


def test_a_receiver_slow_to_acknowledge_lately_does_not_time_the_flush_out() -> None:
    """Acks every 80 ms, then one after 250 ms: the sender's flush waits for it."""
    async def scenario() -> None:
        acks = AckTracker()
        for gap_s in [0.08] * 4:
            acks.sent_layer("r")
            await asyncio.sleep(gap_s)
            acks.acked("r")
        acks.sent_done("r")
        threading.Timer(0.25, acks.acked, ("r",)).start()
        await acks.flush("r", FLOOR_S)

    asyncio.run(scenario())


def _heard_from() -> AckTracker:
    """A tracker whose receiver acknowledged once at once: past its first-contact allowance."""
    acks = AckTracker()
    acks.sent_layer("hello")
    acks.acked("hello")
    return acks


def test_a_receiver_that_never_acknowledges_still_times_the_flush_out() -> None:
    async def scenario() -> float:
        acks = _heard_from()
        acks.sent_layer("r")
        start = time.monotonic()
        with pytest.raises(KVTransferTimeout):
            await acks.flush("r", FLOOR_S)
        return time.monotonic() - start

    assert asyncio.run(scenario()) < 1.0


def test_a_timed_out_wait_and_its_late_acknowledgement_lengthen_the_next_deadline() -> None:
    """The first wait (on a receiver heard from, quick so far) gives up at the floor; the
    acknowledgement that comes 300 ms later shows the peer was slow, not gone: the next flush waits
    for a 300 ms acknowledgement."""
    async def scenario() -> None:
        acks = _heard_from()
        acks.sent_layer("a")
        with pytest.raises(KVTransferTimeout):
            await acks.flush("a", FLOOR_S)
        await asyncio.sleep(0.2)
        acks.acked("a")  # late: after its flush gave up
        assert acks.cadence.longest_gap_s() >= 0.3
        acks.sent_layer("b")
        threading.Timer(0.3, acks.acked, ("b",)).start()
        await acks.flush("b", FLOOR_S)

    asyncio.run(scenario())
