"""Scheduler without a model: budgets, chunked prefill, prefix hits, preemption, swapping, aborts, and
a randomized run checked against a KV oracle at every step."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest
from helpers import (
    FAKE_TOKEN_ID,
    FakeClock,
    KVOracle,
    assert_scheduler_clean,
    fake_step,
    make_request,
    make_scheduler,
    run_to_completion,
)

from pdserve.engine.kv_cache_manager import cdiv
from pdserve.engine.request import RequestStatus
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.scheduler_output import SchedulerOutput


def chunk_sizes(out: SchedulerOutput) -> dict[str, int]:
    return {c.request.request_id: c.num_new_tokens for c in out.chunks}


def assert_invariants(scheduler: Scheduler) -> None:
    """Block accounting agrees with what the requests hold, whatever state they are in."""
    pool, bs = scheduler.kv.pool, scheduler.kv.block_size
    holders = Counter(b for r in scheduler.requests.values() for b in r.block_ids)
    assert [pool.ref_counts[b] for b in range(pool.num_blocks)] == [holders[b] for b in range(pool.num_blocks)]
    assert pool.num_free_blocks == sum(1 for count in pool.ref_counts if count == 0)
    assert len(scheduler.running) <= scheduler.config.max_num_seqs
    held_swap = [b for r in scheduler.swapped for b in r.swapped_block_ids]
    assert len(held_swap) == len(set(held_swap))
    assert scheduler.kv.swap.num_free_blocks + len(held_swap) == scheduler.kv.swap.num_blocks
    for request in scheduler.running:
        assert request.status == RequestStatus.RUNNING
        assert len(request.block_ids) == cdiv(request.num_computed_tokens, bs)
    for request in scheduler.waiting:
        assert request.status == RequestStatus.WAITING and not request.block_ids
    for request in scheduler.swapped:
        assert request.status == RequestStatus.SWAPPED and not request.block_ids
        assert len(request.swapped_block_ids) == cdiv(request.num_computed_tokens, bs)
    listed = [r.request_id for r in (*scheduler.running, *scheduler.waiting, *scheduler.swapped)]
    assert sorted(listed) == sorted(scheduler.requests)


def test_single_request_lifecycle() -> None:
    scheduler = make_scheduler(num_blocks=8, block_size=4)
    request = make_request("a", 6, max_tokens=3)
    scheduler.add_request(request)
    outs = run_to_completion(scheduler)
    assert [chunk_sizes(o) for o in outs] == [{"a": 6}, {"a": 1}, {"a": 1}]
    assert request.output_token_ids == [FAKE_TOKEN_ID] * 3
    assert request.status == RequestStatus.FINISHED_LENGTH and request.block_ids == []
    assert_scheduler_clean(scheduler)


def test_tokens_by_chunk_update_as_tokens_by_id() -> None:
    """`update` with one token a chunk (a list, the steady decode's case) does what the same tokens
    by request id do: the same tokens appended, the same stops (a stop token, the length limit), the
    same blocks cached; a list of another length is refused."""
    runs = []
    for by_chunk in (False, True):
        scheduler = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=64)
        requests = [make_request("a", 6, max_tokens=9), make_request("b", 5, max_tokens=3),
                    make_request("c", 7, max_tokens=9, stop_token_ids=[7])]
        for request in requests:
            scheduler.add_request(request)
        for step in range(8):
            out = scheduler.schedule()
            if not out.chunks:
                break
            tokens = [3 + step + i for i in range(len(out.chunks))]
            assert all(chunk.samples for chunk in out.chunks)
            updated = scheduler.update(out, tokens if by_chunk else
                                       {c.request.request_id: t for c, t in zip(out.chunks, tokens, strict=True)})
            assert updated == [c.request for c in out.chunks]
        runs.append([(r.output_token_ids, r.status, r.block_hashes) for r in requests])
        scheduler.add_request(make_request("d", 3))
        out = scheduler.schedule()
        with pytest.raises(ValueError, match=f"{len(out.chunks) + 1} tokens sampled for a step of {len(out.chunks)}"):
            scheduler.update(out, [1] * (len(out.chunks) + 1))
    assert runs[0] == runs[1]
    assert runs[1][2][1] == RequestStatus.FINISHED_STOPPED and runs[1][1][1] == RequestStatus.FINISHED_LENGTH


def test_add_request_rejects_what_can_never_fit() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="KV blocks"):
        scheduler.add_request(make_request("a", 14, max_tokens=3))  # 17 tokens > 16 slots
    scheduler.add_request(make_request("b", 13, max_tokens=3))  # exactly 16
    run_to_completion(scheduler)
    assert_scheduler_clean(scheduler)


def test_max_num_seqs_is_honoured() -> None:
    scheduler = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=2)
    for n in range(5):
        scheduler.add_request(make_request(str(n), 3, max_tokens=4))
    outs = run_to_completion(scheduler)
    assert max(len(o.chunks) for o in outs) == 2
    assert list(chunk_sizes(outs[0])) == ["0", "1"]  # first come, first served
    assert_scheduler_clean(scheduler)


def test_token_budget_and_chunked_prefill_split() -> None:
    scheduler = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=16)
    long, short = make_request("long", 50, max_tokens=2), make_request("short", 5, max_tokens=2)
    scheduler.add_request(long)
    scheduler.add_request(short)
    outs = [fake_step(scheduler) for _ in range(4)]
    assert [chunk_sizes(o) for o in outs] == [{"long": 16}, {"long": 16}, {"long": 16}, {"long": 2, "short": 5}]
    assert long.num_output_tokens == 1 and short.num_output_tokens == 1  # only the last chunk samples
    rest = run_to_completion(scheduler)
    assert all(o.num_batched_tokens <= 16 for o in outs + rest)
    assert_scheduler_clean(scheduler)


def test_decodes_are_scheduled_before_new_prefills() -> None:
    scheduler = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=8)
    scheduler.add_request(make_request("a", 8, max_tokens=3))
    fake_step(scheduler)
    scheduler.add_request(make_request("b", 20, max_tokens=1))
    assert chunk_sizes(fake_step(scheduler)) == {"a": 1, "b": 7}
    run_to_completion(scheduler)
    assert_scheduler_clean(scheduler)


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget() -> None:
    scheduler = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=16, enable_chunked_prefill=False)
    for name in ("a", "b"):
        scheduler.add_request(make_request(name, 10, max_tokens=2))
    assert chunk_sizes(fake_step(scheduler)) == {"a": 10}
    assert chunk_sizes(fake_step(scheduler)) == {"a": 1, "b": 10}
    run_to_completion(scheduler)
    assert_scheduler_clean(scheduler)


def test_prefix_hit_advances_computed_tokens() -> None:
    scheduler = make_scheduler(num_blocks=16, block_size=4)
    prompt = list(range(100, 110))
    scheduler.add_request(make_request("a", prompt, max_tokens=1))
    run_to_completion(scheduler)
    second = make_request("b", prompt + [7], max_tokens=1)
    third = make_request("c", prompt, max_tokens=1)
    scheduler.add_request(second)
    scheduler.add_request(third)
    # 11 tokens: 2 full blocks cached, 3 to compute. 10 tokens: 2 cached blocks (9 // 4), 2 to compute.
    assert chunk_sizes(fake_step(scheduler)) == {"b": 3, "c": 2}
    assert (second.num_cached_tokens, third.num_cached_tokens) == (8, 8)
    assert (scheduler.kv.num_prefix_queries, scheduler.kv.num_prefix_hits) == (10 + 11 + 10, 16)
    assert_scheduler_clean(scheduler)


def test_failed_admission_changes_nothing() -> None:
    """A waiting request with prefix hits that does not fit keeps no hit, no block, no progress."""
    scheduler = make_scheduler(num_blocks=8, block_size=4)
    prompt = list(range(100, 109))
    scheduler.add_request(make_request("a", prompt, max_tokens=1))
    run_to_completion(scheduler)  # 2 full blocks of `prompt` stay cached
    scheduler.add_request(make_request("big", 19, max_tokens=3))  # 5 blocks, its first decode fits in them
    fake_step(scheduler)
    waiting = make_request("b", prompt + list(range(200, 215)), max_tokens=1)  # 24 tokens: 2 hits + 4 new
    scheduler.add_request(waiting)
    before = list(scheduler.kv.pool.ref_counts)
    out = fake_step(scheduler)
    assert chunk_sizes(out) == {"big": 1}
    assert list(scheduler.waiting) == [waiting] and waiting.num_computed_tokens == 0 and not waiting.block_ids
    assert scheduler.kv.pool.ref_counts == before and waiting.num_cached_tokens == 0
    assert_invariants(scheduler)
    run_to_completion(scheduler)
    assert waiting.num_cached_tokens == 8  # admitted later, with its hits
    assert_scheduler_clean(scheduler)


def test_preemption_recompute_picks_the_newest_running_request() -> None:
    scheduler = make_scheduler(num_blocks=6, block_size=4, enable_prefix_caching=False)
    requests = [make_request(name, 8, max_tokens=4) for name in "abc"]
    for request in requests:
        scheduler.add_request(request)
    assert chunk_sizes(fake_step(scheduler)) == {"a": 8, "b": 8, "c": 8}  # 6 blocks: the pool is full
    out = fake_step(scheduler)  # every decode needs a new block: "c" goes, which makes room for "b"
    assert out.preempted_ids == ["c"] and chunk_sizes(out) == {"a": 1, "b": 1}
    victim = requests[2]
    assert scheduler.num_preemptions == 1 and list(scheduler.waiting) == [victim]
    assert victim.status == RequestStatus.WAITING and victim.num_computed_tokens == 0
    assert victim.block_ids == [] and victim.num_preemptions == 1
    assert victim.num_output_tokens == 1  # sampled tokens are kept and recomputed
    assert_invariants(scheduler)
    run_to_completion(scheduler)
    assert all(r.num_output_tokens == 4 for r in requests)
    assert_scheduler_clean(scheduler)


def test_preemption_swap_moves_blocks_and_swapped_come_back_first() -> None:
    scheduler = make_scheduler(num_blocks=6, block_size=4, enable_prefix_caching=False, num_swap_blocks=8,
                               preemption_mode="swap")
    requests = [make_request(name, 8, max_tokens=4) for name in "abc"]
    for request in requests:
        scheduler.add_request(request)
    fake_step(scheduler)
    c_blocks = list(requests[2].block_ids)
    out = fake_step(scheduler)
    assert out.preempted_ids == ["c"] and chunk_sizes(out) == {"a": 1, "b": 1}
    assert [d for d, _ in out.blocks_to_swap_out] == c_blocks
    assert requests[2].status == RequestStatus.SWAPPED and requests[2].num_computed_tokens == 8
    assert [r.request_id for r in scheduler.swapped] == ["c"]
    swap_blocks = list(requests[2].swapped_block_ids)
    scheduler.add_request(make_request("late", 2, max_tokens=1))
    assert_invariants(scheduler)
    while True:
        out = fake_step(scheduler)
        if requests[2].status != RequestStatus.SWAPPED:
            break
        assert "late" not in chunk_sizes(out), "waiting requests wait while a request is swapped"
    assert list(chunk_sizes(out))[-2:] == ["c", "late"]  # swapped back in first, then admitted
    assert [s for s, _ in out.blocks_to_swap_in] == swap_blocks
    assert requests[2].block_ids[:2] == [d for _, d in out.blocks_to_swap_in]
    run_to_completion(scheduler)
    assert all(r.num_output_tokens == 4 for r in requests)
    assert_scheduler_clean(scheduler)


def test_swap_falls_back_to_recompute_when_swap_space_is_full() -> None:
    scheduler = make_scheduler(num_blocks=6, block_size=4, enable_prefix_caching=False, num_swap_blocks=1,
                               preemption_mode="swap")
    for name in "abc":
        scheduler.add_request(make_request(name, 8, max_tokens=4))
    fake_step(scheduler)
    out = fake_step(scheduler)
    assert out.preempted_ids == ["c"] and out.blocks_to_swap_out == []
    assert [r.request_id for r in scheduler.waiting] == ["c"] and not scheduler.swapped
    run_to_completion(scheduler)
    assert_scheduler_clean(scheduler)


@pytest.mark.parametrize("state", ["waiting", "running", "running-mid-prefill", "swapped", "preempted"])
def test_abort_frees_everything(state: str) -> None:
    mid_prefill = state == "running-mid-prefill"
    scheduler = make_scheduler(num_blocks=16 if mid_prefill else 6, block_size=4, max_num_batched_tokens=24,
                               num_swap_blocks=8, preemption_mode="swap" if state == "swapped" else "recompute")
    requests = [make_request(name, 20 if mid_prefill and name == "c" else 8, max_tokens=4) for name in "abc"]
    for request in requests:
        scheduler.add_request(request)
    if state != "waiting":
        fake_step(scheduler)
    if state in ("swapped", "preempted"):
        fake_step(scheduler)
    target = requests[2]
    expected_status = {"waiting": RequestStatus.WAITING, "running": RequestStatus.RUNNING,
                       "running-mid-prefill": RequestStatus.RUNNING, "swapped": RequestStatus.SWAPPED,
                       "preempted": RequestStatus.WAITING}[state]
    assert target.status == expected_status
    if state == "running-mid-prefill":
        assert 0 < target.num_computed_tokens < target.num_prompt_tokens
    if state == "swapped":
        assert target.swapped_block_ids
    assert scheduler.abort("c") is target
    assert target.status == RequestStatus.FINISHED_ABORTED
    assert target.block_ids == [] and target.swapped_block_ids == []
    assert scheduler.abort("c") is None  # aborting twice is harmless
    assert_invariants(scheduler)
    for name in "ab":
        scheduler.abort(name)
    assert_scheduler_clean(scheduler)


CONFIGS: dict[str, dict[str, Any]] = {
    "recompute": {},
    "recompute-no-cache": {"enable_prefix_caching": False},
    "swap": {"preemption_mode": "swap", "num_swap_blocks": 64},
    "swap-small": {"preemption_mode": "swap", "num_swap_blocks": 6},
    "no-chunking": {"enable_chunked_prefill": False, "max_num_batched_tokens": 64},
    "block-1": {"block_size": 1, "num_blocks": 48},
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_randomized_workload_against_kv_oracle(config: str) -> None:
    """Requests with shared prefixes arrive over time into a pool far too small for all of them,
    some are aborted; every step keeps the accounting invariants and reads only correct KV."""
    rng = random.Random(config)
    args: dict[str, Any] = {"num_blocks": 24, "block_size": 4, "max_num_seqs": 6, "max_num_batched_tokens": 24,
                            **CONFIGS[config]}
    scheduler = make_scheduler(**args)
    oracle = KVOracle(scheduler)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randint(3, 30))] for _ in range(4)]
    pending = []
    for n in range(40):
        prompt = rng.choice(prefixes)[: rng.randint(1, 30)] + [rng.randrange(1000) for _ in range(rng.randint(0, 12))]
        pending.append(make_request(str(n), prompt or [1], max_tokens=rng.randint(1, 16)))
    finished, aborted, steps = [], set(), 0
    while pending or scheduler.requests:
        for _ in range(min(rng.randint(0, 3), len(pending))):
            request = pending.pop(0)
            scheduler.add_request(request)
            finished.append(request)
        if scheduler.requests and rng.random() < 0.05:
            victim = rng.choice(sorted(scheduler.requests))
            scheduler.abort(victim)
            aborted.add(victim)
        out = oracle.step()
        assert out.num_batched_tokens <= args["max_num_batched_tokens"]
        assert len({c.request.request_id for c in out.chunks}) == len(out.chunks)
        assert_invariants(scheduler)
        steps += 1
        assert steps < 5000, "no progress"
    for request in finished:
        if request.request_id not in aborted:
            assert request.num_output_tokens == request.params.max_tokens
            assert request.status == RequestStatus.FINISHED_LENGTH
            # the fake model is a function of the prefix, so each token follows from what precedes it
            for pos in range(request.num_prompt_tokens, request.num_tokens):
                assert request.all_token_ids[pos] == KVOracle.next_token(request.all_token_ids[:pos])
    if config != "recompute-no-cache":
        assert scheduler.kv.num_prefix_hits > 0
    assert scheduler.num_preemptions > 0
    assert_scheduler_clean(scheduler)


def test_block_shortages_are_counted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    """`No available block` on a refused reservation and on a preemption (one line a second at
    most; the counter sees every event); `Cannot allocate for request` for one that never fits."""
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="Cannot allocate for request big"):
        scheduler.add_request(make_request("big", 10, max_tokens=10))
    assert scheduler.num_cannot_allocate == 1
    assert scheduler.reserve_remote(make_request("r1", 12, max_tokens=1))
    assert not scheduler.reserve_remote(make_request("r2", 8, max_tokens=1))
    assert not scheduler.reserve_remote(make_request("r3", 8, max_tokens=1))
    assert scheduler.num_no_available_block == 2
    lines = [r for r in caplog.records if r.getMessage().startswith("No available block")]
    # the second refusal came within the same second: counted, not logged
    assert len(lines) == 1 and lines[0].__dict__.get("request_id") == "r2"
    assert any(r.getMessage().startswith("Cannot allocate for request big") for r in caplog.records)
    scheduler.abort("r1")
    assert_scheduler_clean(scheduler)


def test_cancelled_remote_kv_blocks_are_quarantined_then_freed() -> None:
    """Decode over a transport whose writes can land after a cancel (nixl): the blocks of a
    reservation that ends before its KV arrived (abort, or recompute after a failed hand-off) stay
    out of reuse for `remote_kv_quarantine_s`, then return to the pool."""
    clock = FakeClock()
    scheduler = make_scheduler(num_blocks=8, block_size=4, remote_kv_quarantine_s=0.3, clock=clock)
    assert scheduler.reserve_remote(make_request("a", 12, max_tokens=2))
    assert scheduler.reserve_remote(make_request("b", 12, max_tokens=2))
    scheduler.abort("a")
    scheduler.recompute_remote("b")  # b must now compute its 12 tokens here: 3 blocks
    assert scheduler.kv.pool.num_free_blocks == 2  # a's and b's 6 blocks are held, not free
    assert scheduler.kv.release_quarantined() == pytest.approx(0.3)
    assert fake_step(scheduler).chunks == []  # b cannot have its (or a's) old blocks yet
    assert not scheduler.reserve_remote(make_request("c", 12, max_tokens=1))
    clock.advance(0.29)
    assert fake_step(scheduler).chunks == []  # not yet: 10 ms of quarantine left
    assert scheduler.kv.release_quarantined() == pytest.approx(0.01)
    clock.advance(0.01)
    out = fake_step(scheduler)  # releases what is due, then schedules b's recompute
    assert [(c.request.request_id, c.num_new_tokens) for c in out.chunks] == [("b", 12)]
    assert scheduler.kv.release_quarantined() is None
    scheduler.abort("b")
    assert_scheduler_clean(scheduler)


def test_without_quarantine_cancelled_remote_kv_blocks_free_at_once() -> None:
    scheduler = make_scheduler(num_blocks=8, block_size=4)
    assert scheduler.reserve_remote(make_request("a", 12, max_tokens=2))
    scheduler.abort("a")
    assert scheduler.kv.release_quarantined() is None
    assert_scheduler_clean(scheduler)
