"""KV transfer deadlines from what the peer says about itself: a prefill worker's keepalives carry its
engine's step time (`Keepalive.step_s`), and decode's wait for the next sign of progress is a
multiple of it, so a prefill engine whose steps take many times the configured timeout is not timed
out, from the very first request after start; a hung or dead one still is, within a bound."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from pdserve.disagg.attempt_states import Reservation
from pdserve.disagg.client import WorkerClient
from pdserve.disagg.control import Keepalive, KeepaliveReply, PrefillJob, WireSamplingParams
from pdserve.disagg.transport import cadence
from pdserve.disagg.transport.cadence import Cadence, StepClock, deadline_s
from pdserve.disagg.transport.errors import KVTransferTimeout
from pdserve.disagg.transport.messages import KVDone, KVProgress
from pdserve.disagg.transport.progress import AckTracker, EventBox
from pdserve.disagg.worker.decode_service import DecodeService
from pdserve.disagg.worker.prefill_service import PrefillService
from pdserve.engine.async_llm import EngineDeadError
from pdserve.engine.commands import AddPrefillOnly
from pdserve.engine.sampling_params import SamplingParams

FLOOR_S = 0.1  # the default --kv-transfer-timeout-ms


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_deadline_is_a_multiple_of_the_announced_step_time_or_of_the_gaps_seen_floored_and_capped() -> None:
    seen = Cadence(_Clock())
    assert seen.timeout_s(FLOOR_S) == FLOOR_S
    assert seen.timeout_s(FLOOR_S, announced_s=0.01) == FLOOR_S  # quick steps: the floor
    assert seen.timeout_s(FLOOR_S, announced_s=0.5) == pytest.approx(cadence.FACTOR * 0.5)  # before any gap seen
    seen.saw(0.8)
    assert seen.timeout_s(FLOOR_S, announced_s=0.5) == pytest.approx(cadence.FACTOR * 0.8)  # the larger counts
    assert seen.timeout_s(FLOOR_S, announced_s=60.0) == cadence.CAP_S  # a peer never holds a wait longer
    assert seen.timeout_s(30.0, announced_s=60.0) == 30.0  # a floor above the cap wins
    for insane in (-1.0, math.inf, math.nan):  # what a peer says is not trusted blindly
        assert deadline_s(FLOOR_S, insane) == FLOOR_S


def test_a_peer_not_heard_from_yet_gets_the_first_contact_allowance_until_its_first_gap() -> None:
    clock = _Clock()
    fresh = Cadence(clock, first_contact_s=cadence.FIRST_CONTACT_S)
    assert fresh.timeout_s(FLOOR_S) == pytest.approx(cadence.FACTOR * cadence.FIRST_CONTACT_S)
    clock.now += 600.0  # NOTE: not decayed: it holds until the peer is heard from, however late
    assert fresh.timeout_s(FLOOR_S) == pytest.approx(cadence.FACTOR * cadence.FIRST_CONTACT_S)
    fresh.timed_out(cadence.FACTOR * cadence.FIRST_CONTACT_S)  # silence from the start teaches no pace
    assert fresh.timeout_s(FLOOR_S) == pytest.approx(cadence.FACTOR * cadence.FIRST_CONTACT_S)
    fresh.saw(0.01)  # from the first sign of progress on, only what the peer did counts
    assert fresh.timeout_s(FLOOR_S) == FLOOR_S


def test_the_first_acknowledgements_of_a_new_decode_peer_may_come_slower_than_the_floor() -> None:
    """A sender's first hand-off to a decode worker that has decoded nothing yet: its first
    acknowledgement comes 3 floors late (its engine starting its first steps on a busy machine).
    That is no timeout; a peer that never acknowledges still times out, after FACTOR x
    FIRST_CONTACT_S; and once heard from, the floor is back."""
    async def scenario() -> tuple[float, float]:
        acks = AckTracker()
        acks.sent_layer("first")
        loop = asyncio.get_running_loop()
        loop.call_later(3 * FLOOR_S, acks.acked, "first")
        started = time.monotonic()
        await acks.flush("first", FLOOR_S)
        slow_first_s = time.monotonic() - started
        acks.sent_done("first")
        acks.acked("first")
        await acks.flush("first", FLOOR_S)
        return slow_first_s, acks.cadence.timeout_s(FLOOR_S)

    slow_first_s, learned_s = asyncio.run(scenario())
    assert slow_first_s >= 3 * FLOOR_S
    assert learned_s == pytest.approx(cadence.FACTOR * 3 * FLOOR_S, rel=0.5)  # what it did, not the allowance

    async def silent() -> float:
        acks = AckTracker()
        acks.sent_layer("never")
        started = time.monotonic()
        with pytest.raises(KVTransferTimeout):
            await acks.flush("never", FLOOR_S)
        return time.monotonic() - started

    assert cadence.FACTOR * cadence.FIRST_CONTACT_S <= asyncio.run(silent()) < cadence.CAP_S


def test_the_step_clock_counts_the_running_step_from_when_work_reached_an_idle_engine() -> None:
    clock = _Clock()
    steps = StepClock(clock, stuck_s=5.0)
    last_step_end_s = clock.now - 100.0  # idle since start-up, 100 s ago
    steps.busy()  # the first request comes
    clock.now += 0.3
    steps.sample(last_step_end_s, computing=True)
    assert steps.step_s() == pytest.approx(0.3) and not steps.stuck  # not "a step of 100 s": not stuck either
    clock.now += 1.2
    steps.sample(last_step_end_s, computing=True)
    assert steps.step_s() == pytest.approx(1.5)  # it grows while the long chunk runs
    last_step_end_s = clock.now  # the chunk ended, the next one starts
    clock.now += 0.1
    steps.sample(last_step_end_s, computing=True)
    assert steps.step_s() == pytest.approx(1.5, rel=0.05)  # the longest recent step is remembered...
    clock.now += 10 * cadence.STEP_HALF_LIFE_S
    steps.sample(clock.now - 0.05, computing=True)
    assert steps.step_s() == pytest.approx(0.05, abs=0.01)  # ...for a few seconds
    steps.sample(clock.now - 6.0, computing=True)
    assert steps.stuck  # a step past `stuck_s`: hung
    steps.sample(clock.now - 6.0, computing=False)
    assert not steps.stuck  # nothing computing: no step runs, however long ago the last one ended


def test_the_keepalive_carries_the_step_time_as_an_optional_checked_field() -> None:
    assert Keepalive.model_validate_json('{"transfer_ids": ["a@1"]}').step_s is None  # an older prefill worker
    assert Keepalive.model_validate_json(Keepalive(transfer_ids=["a@1"], step_s=1.5).model_dump_json()).step_s == 1.5
    with pytest.raises(ValidationError):
        Keepalive.model_validate({"transfer_ids": ["a@1"], "step_s": -1.0})


def test_an_announced_step_time_stretches_a_wait_from_the_first_keepalive() -> None:
    """A payload, then a keepalive saying the engine's step takes 0.5 s, then nothing for 0.6 s (six
    times the floor, before any slow gap was seen): the next payload is still waited for."""
    async def scenario() -> None:
        box = EventBox()
        box.open("r")
        box.put(KVProgress("r", 0, (0,)))
        await box.get("r", FLOOR_S)
        box.touch("r", step_s=0.5)
        assert box.timeout_s("r", FLOOR_S) == pytest.approx(cadence.FACTOR * 0.5)
        asyncio.get_running_loop().call_later(0.6, box.put, KVProgress("r", 1, (0,)))
        assert isinstance(await box.get("r", FLOOR_S), KVProgress)
        box.close("r", "done")

    async def just_placed() -> None:
        box = EventBox()
        box.open("x")
        box.touch("x", step_s=0.5)  # another request's sender
        box.open("s")  # just placed: no keepalive of its own yet; what senders announced lately counts
        assert box.timeout_s("s", FLOOR_S) == pytest.approx(cadence.FACTOR * 0.5, rel=0.05)
        box.touch("s", step_s=0.05)  # its own sender's word, once it came
        assert box.timeout_s("s", FLOOR_S) == pytest.approx(cadence.FACTOR * 0.05)

    asyncio.run(scenario())
    asyncio.run(just_placed())


class _StalledEngine:
    """A prefill engine client idle since start-up (its last step ended 100 s ago) whose first
    request's step takes `step_s`, then ends without a first token; `hang`: never ends; `die`: its
    engine dies after `step_s`. `answers_after_step`: as an engine process, the command that adds
    the job is answered after the step that follows it (the whole of a one-chunk prompt)."""

    def __init__(self, step_s: float, *, hang: bool = False, die: bool = False,
                 answers_after_step: bool = False) -> None:
        self.step_s = step_s
        self.hang = hang
        self.die = die
        self.answers_after_step = answers_after_step
        self.last_step_s = time.monotonic() - 100.0

    async def send(self, command: Any, stream: Any = None) -> Any:
        if isinstance(command, AddPrefillOnly) and self.answers_after_step:
            await self._step()
        return True

    async def _step(self) -> None:
        await asyncio.sleep(math.inf if self.hang else self.step_s)
        self.last_step_s = time.monotonic()

    async def consume(self, request_id: str, stream: Any) -> AsyncIterator[Any]:
        if not self.answers_after_step:
            await self._step()
        if self.die:
            raise EngineDeadError("the engine process is gone")
        for _ in ():
            yield _


class _NoKV:
    def close(self) -> None:
        pass


class _DecodeOverTheWire(WorkerClient):
    """POST /pd/alive to a decode worker whose receiver is `box`, through the Keepalive's JSON form;
    the ones sent between `starved` seconds after the start are lost (the prefill API process was not
    scheduled: on a busy machine it is not, for hundreds of ms)."""

    def __init__(self, box: EventBox, starved: tuple[float, float] = (0.0, 0.0)) -> None:
        super().__init__(timeout_s=1.0)
        self.box = box
        self.starved = starved
        self.started = time.monotonic()
        self.step_s: list[float | None] = []

    async def alive(self, url: str, transfer_ids: list[str], ended: list[str] | None = None,
                    timeout_s: float | None = None, step_s: float | None = None) -> KeepaliveReply:
        since_s = time.monotonic() - self.started
        if self.starved[0] <= since_s < self.starved[1]:
            return KeepaliveReply()
        body = Keepalive.model_validate_json(Keepalive(transfer_ids=transfer_ids, ended=ended or [],
                                                       step_s=step_s).model_dump_json())
        self.step_s.append(body.step_s)
        for tid in body.transfer_ids:
            self.box.touch(tid, body.step_s)
        return KeepaliveReply()  # an older decode worker's `{}`


def _job(tid: str) -> PrefillJob:
    return PrefillJob(request_id="r", transfer_id=tid, decode_url="http://decode", prompt_token_ids=[1, 2, 3],
                      params=WireSamplingParams.of(SamplingParams(max_tokens=2)), kv_address="", block_ids=[],
                      num_cached_tokens=0)


async def _decode_waits(box: EventBox, tid: str) -> str:
    """Decode's watch once payloads flow: wait for the next event with the floor, until the final one."""
    while True:
        event = await box.get(tid, FLOOR_S)
        if isinstance(event, KVDone):
            return "done"


@pytest.mark.parametrize("answers_after_step", [False, True], ids=["engine_thread", "engine_process"])
def test_a_prefill_engine_stalled_on_a_long_first_step_is_not_timed_out_by_decode(answers_after_step: bool) -> None:
    """The first request after start-up; its step takes 1.2 s (12 times the floor) and the prefill
    API process is starved for 0.4 s in the middle of it. The first payload came at once (layer 0):
    decode waits for the final message, and the keepalives' step time keeps it waiting. With an
    engine process the job's first step runs before the command adding it is answered: the
    keepalives go during it too."""
    async def scenario() -> list[float | None]:
        box = EventBox()
        tid = "r@1"
        box.open(tid)
        engine = _StalledEngine(1.2, answers_after_step=answers_after_step)
        service = PrefillService(engine, _NoKV(), transfer_timeout_s=FLOOR_S)  # type: ignore[arg-type]
        decode = _DecodeOverTheWire(box, starved=(0.35, 0.75))
        service.keepalives.workers = decode
        submitted = asyncio.ensure_future(service.submit(_job(tid)))
        await asyncio.sleep(0)
        box.put(KVProgress(tid, 0, (0,)))  # layer 0 of the chunk
        submitted.add_done_callback(  # the final message, after the step
            lambda done: done.result().add_done_callback(lambda _: box.put(KVDone(tid, b""))))
        assert await asyncio.wait_for(_decode_waits(box, tid), 5.0) == "done"
        await (await submitted)
        service.close()
        return decode.step_s

    announced = asyncio.run(scenario())
    assert announced and all(step_s is not None for step_s in announced)
    assert max(s for s in announced if s is not None) > 0.75  # the running step's age, growing


@pytest.mark.parametrize("how", ["hung", "dead"])
def test_a_hung_or_dead_prefill_engine_is_still_timed_out_within_a_bound(how: str) -> None:
    """A hung engine (a step running past `stuck_s`) gets no more keepalives, a dead one ends its
    attempt: decode's wait gives up after the last deadline announced, not never."""
    async def scenario() -> float:
        box = EventBox()
        tid = "r@1"
        box.open(tid)
        engine = _StalledEngine(0.4, hang=how == "hung", die=how == "dead")
        service = PrefillService(engine, _NoKV(), transfer_timeout_s=FLOOR_S)  # type: ignore[arg-type]
        service.keepalives.steps.stuck_s = 0.4
        service.keepalives.workers = _DecodeOverTheWire(box)
        await service.submit(_job(tid))
        box.put(KVProgress(tid, 0, (0,)))
        start = time.monotonic()
        with pytest.raises(KVTransferTimeout):
            await _decode_waits(box, tid)
        waited_s = time.monotonic() - start
        await service.abort(tid)
        service.close()
        return waited_s

    waited_s = asyncio.run(scenario())
    assert 0.4 < waited_s < 0.4 + cadence.FACTOR * 0.6 + 1.0  # silent after ~0.4 s, then FACTOR x its step


class _DecodeEngine:
    """A decode engine client, idle since long before the first request."""

    def __init__(self) -> None:
        self.last_step_s = time.monotonic() - 100.0


def test_decode_answers_keepalives_with_its_own_step_time() -> None:
    """A decode worker's steps take 0.4 s (a batch on a busy core): its answer to a keepalive says
    so, counted from when its first request ran, not from when it last stepped (100 s ago)."""
    async def scenario() -> list[float | None]:
        engine = _DecodeEngine()
        service = DecodeService(engine, SimpleNamespace(layout=None), "fail",  # type: ignore[arg-type]
                                transfer_timeout_s=FLOOR_S)
        answers = [service.keepalive_reply().step_s]  # nothing running: no step
        service._busy()  # a request starts decoding
        service._requests["r"] = SimpleNamespace(state=SimpleNamespace(  # type: ignore[assignment]
            is_in=lambda *states: Reservation.DECODING in states))
        await asyncio.sleep(0.4)
        answers.append(service.keepalive_reply().step_s)
        engine.last_step_s = time.monotonic()  # that step ended
        answers.append(service.keepalive_reply().step_s)  # the longest recent one is still said
        return answers

    idle, running, after = asyncio.run(scenario())
    assert idle == 0.0
    assert running is not None and 0.35 < running < 2.0
    assert after is not None and after == pytest.approx(running, rel=0.2)


class _AnsweringDecode(_DecodeOverTheWire):
    """A decode worker whose answers to keepalives say its steps take `step_s` (None: an older one, `{}`)."""

    def __init__(self, box: EventBox, step_s: float | None) -> None:
        super().__init__(box)
        self.answer_s = step_s

    async def alive(self, url: str, transfer_ids: list[str], ended: list[str] | None = None,
                    timeout_s: float | None = None, step_s: float | None = None) -> KeepaliveReply:
        await super().alive(url, transfer_ids, ended, timeout_s, step_s)
        body = "{}" if self.answer_s is None else KeepaliveReply(step_s=self.answer_s).model_dump_json()
        return KeepaliveReply.model_validate_json(body)


@pytest.mark.parametrize("decode_step_s", [0.5, None])
def test_prefill_waits_on_a_decode_worker_as_long_as_its_announced_step_time_says(
        decode_step_s: float | None) -> None:
    """The acknowledgement and placement waits' floors become FACTOR times the step time the decode
    worker's keepalive answers announce (capped); an older decode worker's `{}` leaves them as configured."""
    async def scenario() -> tuple[float, float]:
        box = EventBox()
        box.open("r@1")
        engine = _StalledEngine(0.3)
        service = PrefillService(engine, _NoKV(), transfer_timeout_s=FLOOR_S)  # type: ignore[arg-type]
        service.keepalives.workers = _AnsweringDecode(box, decode_step_s)
        task = await service.submit(_job("r@1"))
        await asyncio.sleep(0.2)  # a few keepalives, answered
        floors = service.keepalives.floor_s(FLOOR_S, "http://decode"), service.keepalives.floor_s(1.0)
        await task
        service.close()
        return floors

    ack_floor_s, placement_floor_s = asyncio.run(scenario())
    if decode_step_s is None:
        assert (ack_floor_s, placement_floor_s) == (FLOOR_S, 1.0)
    else:
        assert ack_floor_s == pytest.approx(cadence.FACTOR * decode_step_s, rel=0.05)
        assert placement_floor_s == pytest.approx(max(1.0, cadence.FACTOR * decode_step_s), rel=0.05)
