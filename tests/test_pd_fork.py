"""Decode role, n > 1 (Scheduler.resample_remote): the prompt's KV arrives once; the other
sequences take its full blocks by reference, compute only the rest of the prompt, and every
sequence reads the right KV until all finish, with nothing left behind."""

from __future__ import annotations

from helpers import (
    KVOracle,
    assert_no_leak,
    assert_scheduler_clean,
    make_request,
    make_scheduler,
    random_prompt,
    token_prompts,
)

from pdserve import LLM, SamplingParams


def test_forks_share_the_handed_off_prompt_blocks_by_reference() -> None:
    scheduler = make_scheduler(num_blocks=16, block_size=4)
    oracle = KVOracle(scheduler)
    parent = make_request("r", 14, max_tokens=5)
    assert scheduler.reserve_remote(parent)
    for pos in range(parent.num_prompt_tokens):  # the prompt's KV, as a prefill worker wrote it
        block = oracle.device.setdefault(parent.block_ids[pos // 4], [None] * 4)
        block[pos % 4] = hash(tuple(parent.all_token_ids[:pos + 1]))
    forks = [make_request(f"r#{i}", parent.prompt_token_ids, max_tokens=5) for i in (1, 2)]
    used_before = scheduler.kv.pool.num_used_blocks

    scheduler.resample_remote("r", forks)

    shared = parent.block_ids[:3]  # (14 - 1) // 4 full blocks; the 4th holds the last prompt tokens
    assert all(fork.block_ids == shared and fork.num_computed_tokens == 12 for fork in forks)
    assert [scheduler.kv.pool.ref_counts[b] for b in shared] == [3, 3, 3]
    assert scheduler.kv.pool.num_used_blocks == used_before, "nothing copied, nothing new yet"
    first = oracle.step()
    assert {(c.request.request_id, c.num_new_tokens) for c in first.chunks} == {("r", 1), ("r#1", 2), ("r#2", 2)}
    assert all(len(r.output_token_ids) == 1 for r in (parent, *forks))  # each sampled its own first token
    while scheduler.requests:
        oracle.step()
    assert all(r.num_output_tokens == 5 for r in (parent, *forks))
    assert_scheduler_clean(scheduler)


def test_an_aborted_fork_gives_back_only_its_references() -> None:
    scheduler = make_scheduler(num_blocks=16, block_size=4)
    parent = make_request("r", 9, max_tokens=3)
    assert scheduler.reserve_remote(parent)
    fork = make_request("r#1", parent.prompt_token_ids, max_tokens=3)
    scheduler.resample_remote("r", [fork])
    scheduler.abort("r#1")
    assert [scheduler.kv.pool.ref_counts[b] for b in parent.block_ids[:2]] == [1, 1]
    scheduler.abort("r")
    assert_scheduler_clean(scheduler)


def test_n_sequences_of_a_reservation_prefilled_on_decode_equal_colocated(colocated: LLM) -> None:
    """The failure policy "recompute" (or conditional disaggregation) with n > 1: the reservation's
    other sequences start as ordinary requests, with the same seeds as in a colocated engine."""
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
    prompt = random_prompt(21, seed=5)
    engine = colocated.engine
    assert engine.reserve_remote("r", prompt, params) is not None
    engine.prefill_locally("r")
    finals = []
    while engine.has_unfinished_requests():
        finals += [out for out in engine.step() if out.finished]
    (decoded,) = finals
    (expected,) = colocated.generate(token_prompts([prompt]), params)
    assert [s.token_ids for s in decoded.outputs] == [s.token_ids for s in expected.outputs]
    assert len({tuple(s.token_ids) for s in decoded.outputs}) == 3
    assert_no_leak(colocated)
