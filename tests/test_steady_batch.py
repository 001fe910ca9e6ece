"""The scheduler's steady decode (`SteadyBatch`, engine/scheduler_output.py): a step of the very same
running requests is scheduled and updated without reading each one, and must do exactly what the
general path does."""

from __future__ import annotations

import zlib
from operator import is_
from typing import Any

import pytest
from helpers import assert_scheduler_clean, make_request, make_scheduler

from pdserve.engine.kv_events import KVEventLog
from pdserve.engine.request import Request
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.scheduler_output import SteadyBatch

_STOP = 3  # the fake model samples it now and then: requests with it as a stop token end there


def _token(request: Request) -> int:
    """The fake model's token: a function of the request and its length, so both runs sample alike."""
    return zlib.crc32(f"{request.request_id}:{len(request.all_token_ids)}".encode()) % 40


def _arrivals(step: int) -> list[Request]:
    shared = list(range(500, 509))  # a prefix two requests share: the second finds it cached
    plans: dict[int, list[Request]] = {
        0: [make_request("a", 9, max_tokens=60), make_request("b", shared + [1, 2], max_tokens=45),
            make_request("c", 5, max_tokens=70, stop_token_ids=[_STOP]),
            make_request("d", 6, max_tokens=50, stop_token_ids=[_STOP], min_tokens=30)],
        12: [make_request("e", shared + [7], max_tokens=40), make_request("f", 14, max_tokens=30)],
        40: [make_request("g", 3, max_tokens=33), make_request("h", 22, max_tokens=25, stop_token_ids=[_STOP])],
    }
    return plans.get(step, [])


def _drive(scheduler: Scheduler) -> tuple[list[object], int]:
    """Step the scheduler to the end with the fake model, the way the engine hands tokens over (a
    list where every chunk samples, else a dict); returns what each step did and left, and the
    number of steps it scheduled as a steady batch."""
    events = scheduler.kv.pool.events = KVEventLog(scheduler.kv.block_size)
    newly_cached = scheduler.kv.newly_cached = []  # what a disk tier would save, in order
    record: list[object] = []
    steady_steps = 0
    step = 0
    while scheduler.requests or step <= 40:
        for request in _arrivals(step):
            scheduler.add_request(request)
        if step == 30:
            scheduler.abort("a")
        if step in (25, 55):
            scheduler.schedule()  # a step that raised before its update: dropped, nothing advanced
        out = scheduler.schedule()
        steady_steps += out.steady is not None
        samplers = [c.request for c in out.chunks if c.samples]
        if len(samplers) == len(out.chunks):
            updated = scheduler.update(out, [_token(r) for r in samplers])
        else:
            updated = scheduler.update(out, {r.request_id: _token(r) for r in samplers})
        record.append((
            [(c.request.request_id, c.num_new_tokens) for c in out.chunks], list(out.preempted_ids),
            out.num_batched_tokens, [r.request_id for r in updated],
            [(r.request_id, r.status, r.num_computed_tokens, list(r.all_token_ids), list(r.block_ids),
              r.num_indexed_blocks, len(r.block_hashes)) for r in updated + scheduler.running],
            scheduler.kv.pool.num_free_blocks, events.take(), list(newly_cached)))
        newly_cached.clear()
        step += 1
        assert step < 1000
    assert_scheduler_clean(scheduler)
    return record, steady_steps


def _scheduler(num_blocks: int, block_size: int = 4, preemption_mode: str = "recompute", caching: bool = True
               ) -> Scheduler:
    return make_scheduler(num_blocks=num_blocks, block_size=block_size, max_num_seqs=6, max_num_batched_tokens=24,
                          preemption_mode=preemption_mode, num_swap_blocks=200 if preemption_mode == "swap" else 0,
                          enable_prefix_caching=caching)


@pytest.mark.parametrize(("num_blocks", "block_size", "preemption_mode", "caching"), [
    (200, 4, "recompute", True), (30, 4, "recompute", True), (30, 4, "swap", True), (30, 4, "recompute", False),
    (120, 1, "recompute", True), (70, 2, "swap", False)])
def test_steady_steps_do_what_the_general_path_does(num_blocks: int, block_size: int, preemption_mode: str,
                                                    caching: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Step by step: the same chunks, tokens, blocks, cached blocks (the KV events, what a disk tier
    saves) and finishes at a length, at a stop token and not before min_tokens, through arrivals, an
    abort, a prefix hit, dropped steps and, with a small pool, preemptions (recomputed or swapped)."""
    steady, steady_steps = _drive(_scheduler(num_blocks, block_size, preemption_mode, caching))
    with monkeypatch.context() as patch:
        patch.setattr(SteadyBatch, "after_update", classmethod(lambda cls, *args: None))
        general, none = _drive(_scheduler(num_blocks, block_size, preemption_mode, caching))
    assert none == 0
    assert steady == general
    assert steady_steps > len(steady) // 3, f"only {steady_steps} of {len(steady)} steps were steady"


def test_a_preemption_in_a_steady_step_leaves_it_to_the_general_loop() -> None:
    """With the pool used up, a decode entering a new block finds none: the steady batch gives the
    step back, the general loop preempts from the tail, and nothing is lost."""
    scheduler = _scheduler(30)
    calls: list[str] = []
    schedule = SteadyBatch.schedule

    def counted(self: SteadyBatch, running: list[Request], budget: int, kv: Any) -> Any:
        same = len(running) == len(self.requests) <= budget and all(map(is_, running, self.requests))
        chunks = schedule(self, running, budget, kv)
        calls.append("steady" if chunks is not None else "no block" if same else "other requests")
        return chunks

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SteadyBatch, "schedule", counted)
        _drive(scheduler)
    assert calls.count("no block") > 0 and calls.count("steady") > 10
    assert scheduler.num_preemptions >= calls.count("no block")


def test_a_step_of_other_requests_is_not_steady() -> None:
    """A request joining, or one leaving between the steps, ends the steady batch for that step."""
    scheduler = _scheduler(200)
    for name in "xy":
        scheduler.add_request(make_request(name, 4, max_tokens=20))
    for _ in range(3):
        out = scheduler.schedule()
        scheduler.update(out, [_token(c.request) for c in out.chunks])
    out = scheduler.schedule()
    assert out.steady is not None and [c.request.request_id for c in out.chunks] == ["x", "y"]
    scheduler.update(out, [1, 2])
    scheduler.add_request(make_request("z", 4, max_tokens=20))
    out = scheduler.schedule()
    assert out.steady is None and [c.request.request_id for c in out.chunks] == ["x", "y", "z"]
    scheduler.update(out, [_token(c.request) for c in out.chunks])  # z's prompt: not a step of decodes alone
    out = scheduler.schedule()
    assert out.steady is None
    scheduler.update(out, [_token(c.request) for c in out.chunks])
    assert scheduler.schedule().steady is not None  # a dropped step: the batch is gone ...
    assert scheduler.schedule().steady is None  # ... and is kept again only by an update
    out = scheduler.schedule()
    scheduler.update(out, [_token(c.request) for c in out.chunks])
    scheduler.abort("y")
    out = scheduler.schedule()
    assert out.steady is None and [c.request.request_id for c in out.chunks] == ["x", "z"]
