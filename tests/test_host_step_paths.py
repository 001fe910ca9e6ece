"""The short paths a steady decode step takes on the host (scheduler, block tables, output state):
each must give what the general path gives, and leave nothing behind."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest
from helpers import assert_scheduler_clean, fake_step, make_request, make_scheduler

from pdserve.engine.block_tables import BlockTables
from pdserve.engine.logprobs import TokenLogprobs
from pdserve.engine.output import OutputSettings, RequestState, StepTokens
from pdserve.engine.request import RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler_output import ScheduledChunk
from pdserve.tokenizer import Tokenizer


class _LetterTokenizer:
    """Token t is the letter chr(97 + t % 26): whole characters, one per token."""

    def token_text(self, token_id: int, skip_special_tokens: bool = True) -> str:
        return chr(97 + token_id % 26)

    def token_bytes(self, token_id: int, skip_special_tokens: bool = True) -> bytes:
        return self.token_text(token_id).encode()


def _state(**params: object) -> RequestState:
    settings = OutputSettings(cast(Tokenizer, _LetterTokenizer()))
    return RequestState.of_request("r", None, [1, 2], SamplingParams(**params), settings, 0.0)  # type: ignore[arg-type]


def test_a_snapshot_never_changes_while_later_tokens_arrive() -> None:
    state = _state(logprobs=1)
    kept = []
    for token_id in range(6):
        state.add_token(0, token_id, TokenLogprobs(token_id, -1.0, ((token_id, -1.0),)))
        kept.append(state.snapshot())
    for count, output in enumerate(kept, start=1):
        seq = output.outputs[0]
        assert seq.token_ids == list(range(count))
        assert seq.logprobs is not None and [lp.token_id for lp in seq.logprobs] == list(range(count))
        assert seq.text == "abcdef"[:count]


def test_a_dropped_snapshot_lets_the_next_token_append_in_place() -> None:
    """The step is O(new tokens): a sequence's list is copied only while a snapshot holds it."""
    state = _state()
    state.add_token(0, 0, None)
    state.snapshot()  # dropped at once, as the engine core's delta path does
    list_id = id(state.sequences[0].token_ids)
    state.add_token(0, 1, None)
    assert id(state.sequences[0].token_ids) == list_id
    held = state.snapshot()
    state.add_token(0, 2, None)
    assert held.outputs[0].token_ids == [0, 1]
    assert state.snapshot().outputs[0].token_ids == [0, 1, 2]


def test_finished_counts_each_sequence_once() -> None:
    state = _state(n=2)
    assert not state.finished
    state.finish(0, RequestStatus.FINISHED_LENGTH, None)
    state.finish(0, RequestStatus.FINISHED_ABORTED, None)  # already finished: no second count
    assert not state.finished and not state.snapshot().finished
    state.finish(1, RequestStatus.FINISHED_STOPPED, None)
    assert state.finished and state.snapshot().finished


def test_deltas_carry_each_token_logprob_and_finish_once() -> None:
    """`RequestState.delta` (the engine core's output): new tokens only, a finish reason once, the
    prompt's logprobs once; a sequence with nothing new is left out."""
    state = _state(n=2, logprobs=1)
    lp = TokenLogprobs(3, -0.5, ((3, -0.5),))
    state.add_token(0, 3, lp)
    first = state.delta()
    assert [(s.index, s.token_ids, s.finish_reason) for s in first.sequences] == [(0, [3], None)]
    assert first.sequences[0].logprobs == [lp]
    state.add_token(0, 4, lp)
    state.add_token(1, 5, lp)
    state.finish(1, RequestStatus.FINISHED_LENGTH, None)
    state.prompt_logprobs = [None]
    second = state.delta()
    assert [(s.index, s.token_ids, s.finish_reason) for s in second.sequences] == [(0, [4], None), (1, [5], "length")]
    assert second.prompt_logprobs == [None]
    third = state.delta()
    assert third.sequences == [] and third.prompt_logprobs is None
    state.finish(0, RequestStatus.FINISHED_STOPPED, 7)
    assert [(s.index, s.token_ids, s.finish_reason, s.stop_reason) for s in state.delta().sequences] == [
        (0, [], "stop", 7)]
    assert state.delta().sequences == []


def test_the_engine_core_deltas_add_up_to_the_snapshots(model_dirs: dict[str, Path]) -> None:
    """`step_deltas` (the engine core process) and `step` (snapshots) over the same requests: the
    deltas, concatenated, are the final snapshots' tokens, logprobs and finish reasons; `step(final_only)`
    returns finished requests only."""
    from helpers import random_prompt

    from pdserve.config import EngineArgs
    from pdserve.engine.llm_engine import LLMEngine

    def run(mode: str) -> dict[str, list[tuple[list[int], list[int], str | None]]]:
        engine = LLMEngine.from_engine_args(EngineArgs(model=str(model_dirs["tiny"]), dtype="float32",
                                                       num_kv_blocks=64))
        for index, max_tokens in enumerate((3, 9, 5)):
            params = SamplingParams(n=2, max_tokens=max_tokens, temperature=0.8, seed=index, logprobs=1)
            engine.add_request(f"r{index}", random_prompt(20 + index, seed=index), params)
        got: dict[str, list[tuple[list[int], list[int], str | None]]] = {}
        while engine.has_unfinished_requests():
            if mode == "delta":
                for delta in engine.step_deltas():
                    seqs = got.setdefault(delta.request_id, [([], [], None), ([], [], None)])
                    for seq in delta.sequences:
                        tokens, logprobs, reason = seqs[seq.index]
                        assert reason is None  # nothing after a sequence's finish
                        assert seq.logprobs is not None and len(seq.logprobs) == len(seq.token_ids)
                        seqs[seq.index] = (tokens + seq.token_ids, logprobs + [x.token_id for x in seq.logprobs],
                                           seq.finish_reason)
            else:
                for output in engine.step(final_only=mode == "final"):
                    assert output.finished or mode == "snapshot"
                    got[output.request_id] = [(o.token_ids, [x.token_id for x in o.logprobs or []], o.finish_reason)
                                              for o in output.outputs]
        assert engine.scheduler.kv.pool.num_free_blocks == 64
        return got

    snapshots = run("snapshot")
    assert all(reason == "length" for seqs in snapshots.values() for _, _, reason in seqs)
    assert run("delta") == snapshots == run("final")


def test_the_engine_cores_short_form_carries_what_the_deltas_would(model_dirs: dict[str, Path]) -> None:
    """`step_deltas(alone)` as the engine core runs it (no detokenization): the one-token deltas of
    plain decodes go to `StepTokens`; read back as deltas (what the API process does), every request's
    tokens, logprobs, finish, cached count and prompt logprobs equal those of plain `step_deltas`. The
    short form is used (most tokens) and never for a first token, a finish or a request with logprobs."""
    from helpers import random_prompt

    from pdserve.config import EngineArgs
    from pdserve.engine.llm_engine import LLMEngine

    requests = {"plain": SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True),
                "seeded": SamplingParams(max_tokens=7, temperature=0.8, seed=3, ignore_eos=True),
                "logprobs": SamplingParams(max_tokens=6, temperature=0.0, logprobs=1, ignore_eos=True),
                "prompt": SamplingParams(max_tokens=5, temperature=0.0, prompt_logprobs=1, ignore_eos=True),
                "two": SamplingParams(n=2, max_tokens=4, temperature=0.8, seed=5, ignore_eos=True),
                "short": SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)}

    def run(short: bool) -> tuple[dict[str, list[object]], StepTokens]:
        engine = LLMEngine.from_engine_args(EngineArgs(model=str(model_dirs["tiny"]), dtype="float32",
                                                       num_kv_blocks=64))
        engine.detokenize = False  # NOTE: as the engine core process runs (engine/core_proc.py)
        for index, (request_id, params) in enumerate(requests.items()):
            engine.add_request(request_id, random_prompt(12 + index, seed=index), params)
        got: dict[str, list[object]] = {}
        every = StepTokens()
        for _ in range(100):
            if not engine.has_unfinished_requests():
                break
            alone = StepTokens() if short else None
            deltas = engine.step_deltas(alone)
            if alone is not None:
                every.request_ids += alone.request_ids
                every.token_ids += alone.token_ids
                assert not {d.request_id for d in deltas} & set(alone.request_ids)
                deltas += alone.deltas()
            for delta in deltas:
                got.setdefault(delta.request_id, []).append(
                    (delta.num_cached_tokens or None, delta.first_scheduled_time and "scheduled", delta.prompt_logprobs,
                     [(s.index, s.token_ids, s.logprobs, s.finish_reason, s.stop_reason) for s in delta.sequences]))
        assert not engine.has_unfinished_requests()
        assert engine.scheduler.kv.pool.num_free_blocks == 64
        return got, every

    def replayed(deltas: list[object]) -> list[object]:
        """A request's deltas as the API process folds them in: per sequence, tokens, logprobs and
        finish; the first cached count, scheduled time and prompt logprobs sent."""
        folded: dict[object, list[object]] = {}
        firsts: list[object] = [None, None, None]
        for cached, scheduled, prompt, sequences in deltas:  # type: ignore[misc]
            for k, value in enumerate((cached, scheduled, prompt)):
                firsts[k] = firsts[k] if firsts[k] is not None else value
            for index, tokens, logprobs, finish, stop in sequences:
                seq = folded.setdefault(index, [[], [], None, None])
                seq[0] += tokens
                seq[1] += logprobs or []
                seq[2], seq[3] = finish or seq[2], stop if finish else seq[3]
        return [firsts, sorted(folded.items())]

    (plain, none), (short, alone) = run(False), run(True)
    assert not none.request_ids
    assert {r: replayed(d) for r, d in short.items()} == {r: replayed(d) for r, d in plain.items()}
    assert set(alone.request_ids) == {"plain", "seeded", "prompt"}
    for request_id in alone.request_ids:  # the first token and the finish in deltas; every token between alone
        max_tokens = requests[request_id].max_tokens
        assert max_tokens is not None and alone.request_ids.count(request_id) == max_tokens - 2


def test_a_steady_step_of_the_same_requests_goes_alone_as_each_state_would_send_it(
        model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """`SteadyAlone`: a step of the last step's requests, every one alone, records their tokens
    without asking each state. The engine core's messages, step by step, are those of the engine
    that asks every state, through finishes at their length and at a stop token, a stop string the
    API process found, an abort, an arrival, a request with logprobs joining and steps without the short
    form in between; and it is taken."""
    from helpers import random_prompt

    from pdserve.config import EngineArgs
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.output import SteadyAlone

    taken = []
    take = SteadyAlone.take

    def counted(self: SteadyAlone, *args: Any) -> bool:
        took = take(self, *args)
        taken.append(took)
        return took

    def run(steady: bool) -> list[object]:
        monkeypatch.setattr(SteadyAlone, "take", counted if steady else lambda *args: False)
        engine = LLMEngine.from_engine_args(EngineArgs(model=str(model_dirs["tiny"]), dtype="float32",
                                                       num_kv_blocks=64))
        engine.detokenize = False  # NOTE: as the engine core process runs (engine/core_proc.py)
        for index, max_tokens in enumerate((10, 30, 18, 22)):
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            engine.add_request(f"r{index}", random_prompt(10 + index, seed=index), params)
        messages: list[object] = []
        for step in range(60):
            if step == 4:
                engine.stop_sequence("r3", 0, "stop")  # the API process found a stop string
            if step == 6:
                engine.abort_request("r2")
            if step == 8:
                engine.add_request("late", random_prompt(9, seed=9), SamplingParams(max_tokens=5, temperature=0.0))
            if step == 11:
                engine.add_request("lp", random_prompt(8, seed=8), SamplingParams(max_tokens=4, logprobs=1))
            if not engine.has_unfinished_requests():
                break
            if step == 19:  # a step of snapshots in between (`add_token`: the token not counted sent) ...
                messages.append([(o.request_id, [q.token_ids for q in o.outputs]) for o in engine.step()])
                continue
            if step == 21:  # ... and one of whole deltas
                messages.append([(d.request_id, [q.token_ids for q in d.sequences]) for d in engine.step_deltas()])
                continue
            alone = StepTokens()
            deltas = engine.step_deltas(alone)
            messages.append((list(alone.request_ids), list(alone.token_ids),
                             [(d.request_id, [(q.token_ids, q.finish_reason) for q in d.sequences]) for d in deltas]))
        assert engine.scheduler.kv.pool.num_free_blocks == 64
        return messages

    assert run(True) == run(False)
    assert taken.count(True) >= 5 and False in taken


def test_end_step_keeps_the_rows_asked_for_and_drops_the_others() -> None:
    tables = BlockTables()
    requests = [make_request(f"r{i}", 4) for i in range(3)]
    for i, request in enumerate(requests):
        request.block_ids = [i, 10 + i]
        assert tables.table(request, 1).tolist() == [i]
    tables.end_step()
    assert len(tables) == 3
    requests[1].block_ids.append(21)
    assert tables.table(requests[1]).tolist() == [1, 11, 21]
    assert tables.table(requests[1]).tolist() == [1, 11, 21]  # asked twice in a step: still one row
    tables.end_step()
    assert len(tables) == 1
    tables.end_step()
    assert len(tables) == 0
    for request in requests[:2]:
        tables.table(request)
    tables.end_step()
    assert len(tables) == 2
    requests[0].block_ids = [5]
    tables.table(requests[0])
    requests[0].block_ids = [6]  # rebuilt twice within the step: still one row asked for ...
    assert tables.table(requests[0]).tolist() == [6]
    tables.end_step()  # ... so the other one, not asked for, is dropped
    assert len(tables) == 1


def test_decode_chunks_are_made_once_and_forgotten_with_their_requests() -> None:
    scheduler = make_scheduler(num_blocks=32, block_size=4)
    for index in range(3):
        scheduler.add_request(make_request(f"r{index}", 5, max_tokens=6 + index))
    fake_step(scheduler)  # the prompts
    first = fake_step(scheduler).chunks
    assert all(c.num_new_tokens == 1 for c in first)
    second = fake_step(scheduler).chunks
    assert [c is d for c, d in zip(first, second, strict=True)] == [True] * 3
    assert second[0] == ScheduledChunk(first[0].request, 1)
    while scheduler.requests:
        fake_step(scheduler)
    assert not scheduler._decode_chunks
    assert_scheduler_clean(scheduler)


def test_the_host_step_bench_runs_every_stream_through_its_decode_steps(tmp_path: Path) -> None:
    """`python -m pdserve.bench.host_step` at a small shape: prompts over more than one step's
    budget (8,192 tokens), so a step mixes decodes with a chunk, then decode steps with every
    stream decoding (`measure` checks it): 32 prompts fill the first step, the 33rd's shares the
    next with 32 decodes."""
    from pdserve.bench.host_step import measure, tiny_long_context_model

    model_dir = tiny_long_context_model(tmp_path / "tiny")
    assert measure(model_dir, num_streams=33, context_len=256, num_steps=3) > 0


def test_steady_decode_plans_and_step_buffers_equal_the_full_ones() -> None:
    """`SteadyDecodes` (a steady decode step planned from the last one) and the step buffers' table
    rows skipped by identity and views kept from the last step of the same shape give, step after
    step, what the general planner and a fresh fill give: through arrivals, finishes, decodes entering
    new blocks, and preemptions (a pool too small)."""
    import torch

    from pdserve.engine.step_buffers import StepBuffers
    from pdserve.engine.step_plan import SteadyDecodes, _plan_in_full, plan_step

    block_size = 4
    class Counted(SteadyDecodes):
        hits = 0

        def next_plan(self, *args: Any) -> Any:
            planned = super().next_plan(*args)
            Counted.hits += planned is not None
            return planned

    scheduler = make_scheduler(num_blocks=20, block_size=block_size, max_num_seqs=6, max_num_batched_tokens=32)
    tables, steady = BlockTables(), Counted()
    kept = StepBuffers(64, 8, 64, torch.device("cpu"), lambda n: 1)
    views_kept, last_views, steady_steps, arrays_planned = 0, None, 0, 0
    arrivals = {0: [(5, 30), (9, 14), (3, 40)], 6: [(7, 25)], 20: [(2, 12), (11, 9)]}  # step: (prompt, max_tokens)
    step = 0
    while scheduler.requests or step <= max(arrivals):
        for index, (prompt, max_tokens) in enumerate(arrivals.get(step, [])):
            scheduler.add_request(make_request(f"s{step}-{index}", prompt, max_tokens=max_tokens))
        out = scheduler.schedule()
        expected, expected_samplers, _ = _plan_in_full(out, block_size, None)
        if step == 27:  # NOTE: a step the planner does not see: the next one's memory is of an older one
            scheduler.update(out, [100 + i for i in range(len(expected_samplers))])
            step += 1
            continue
        plan, samplers, targets = plan_step(out, block_size, tables, steady)
        assert samplers == expected_samplers and not targets
        for name in ("token_ids", "positions", "slots", "decode_rows", "decode_lens", "sample_rows", "lora_spans"):
            assert getattr(plan, name) == getattr(expected, name), name
        assert [list(t) for t in plan.decode_tables] == [list(t) for t in expected.decode_tables]
        if plan.decode_arrays is not None:  # what the step buffers copy instead of the lists
            assert [a.tolist() for a in plan.decode_arrays] == [plan.positions, plan.slots, plan.decode_lens]
            arrays_planned += 1
        assert len(tables) == len(plan.decode_rows)  # a row per decode kept, none rebuilt needlessly
        views = kept.prepare(plan)
        want_views = StepBuffers(64, 8, 64, torch.device("cpu"), lambda n: 1).prepare(expected)
        views_kept += views is last_views
        last_views = views
        (ids, positions, got), (want_ids, want_positions, want) = views, want_views
        assert torch.equal(ids, want_ids) and torch.equal(positions, want_positions)
        for name in got.__slots__:  # type: ignore[attr-defined]
            value, wanted = getattr(got, name), getattr(want, name)
            if name.endswith("_tables"):  # NOTE: a row's ids past its context are never read (and may be stale)
                lens = (got.decode_lens if name == "decode_tables" else got.prefix_lens).tolist()
                value, wanted = ([row[:-(-n // block_size)].tolist() for row, n in zip(t, lens, strict=True)]
                                 for t in (value, wanted))
            assert torch.equal(value, wanted) if isinstance(value, torch.Tensor) else value == wanted, name
        steady_steps += out.steady is not None
        if len(samplers) == len(out.chunks):  # NOTE: as the engine does: the list form keeps a steady batch
            scheduler.update(out, [100 + (step + i) % 7 for i in range(len(samplers))])
        else:
            scheduler.update(out, {r.request_id: 100 + (step + i) % 7 for i, r in enumerate(samplers)})
        step += 1
        assert step < 500
    assert scheduler.num_preemptions > 0, "the workload must preempt"
    assert steady_steps > 20 and arrays_planned > 20, "the scheduler's steady batch must plan many of them"
    assert Counted.hits > 20, "most decode steps must be planned from the last one"
    assert views_kept > 20, "a step of the last one's shape keeps its views"
    assert_scheduler_clean(scheduler)


def test_a_steady_padded_step_rewrites_no_padded_table_row() -> None:
    """Padded rows share one table object (`cuda_graphs._PAD_TABLE`), so the step buffers skip them
    by identity from the second step on: a marker written into a padded row survives the next fill."""
    import numpy as np
    import torch

    from pdserve.engine.cuda_graphs import pad_decode_plan
    from pdserve.engine.step_buffers import StepBuffers
    from pdserve.engine.step_plan import StepPlan

    buffers = StepBuffers(16, 8, 4, torch.device("cpu"), lambda n: 1)
    rows = np.arange(4, dtype=np.int32)
    plan = StepPlan(token_ids=[1, 2, 3], positions=[0, 1, 2], slots=[0, 1, 2], decode_rows=[0, 1, 2],
                    decode_tables=[rows[:1], rows[1:2], rows[2:3]], decode_lens=[1, 2, 3], sample_rows=[0, 1, 2])
    _, _, meta = buffers.prepare(pad_decode_plan(plan, 8))
    assert meta.decode_tables[:, 0].tolist() == [0, 1, 2, 0, 0, 0, 0, 0]
    meta.decode_tables[5, 0] = 77  # on CPU the metadata views the host buffer itself
    _, _, meta = buffers.prepare(pad_decode_plan(plan, 8))
    assert meta.decode_tables[5, 0] == 77 and meta.decode_tables[:3, 0].tolist() == [0, 1, 2]


def test_a_plan_with_arrays_fills_the_step_buffers_as_its_lists_do() -> None:
    """A steady plan's arrays (`StepPlan.decode_arrays`) and its kept rows list are copied in place of
    the lists: step after step, padded or not, the buffers hold what the lists alone would give."""
    from dataclasses import replace

    import numpy as np
    import torch

    from pdserve.engine.cuda_graphs import pad_decode_plan
    from pdserve.engine.step_buffers import StepBuffers
    from pdserve.engine.step_plan import StepPlan

    # NOTE: a row's table is a view of that request's own array, as `BlockTables` hands them
    tables = [np.arange(start, start + n, dtype=np.int32) for start, n in ((0, 2), (2, 3), (5, 3))]
    rows = [0, 1, 2]
    with_arrays = StepBuffers(16, 8, 8, torch.device("cpu"), lambda n: 1)
    for step in range(4):
        positions = np.array([5, 9, 17], dtype=np.int64) + step
        slots, lens = positions * 2, positions + 1
        plan = StepPlan(token_ids=[7 + step, 8, 9], positions=positions.tolist(), slots=slots.tolist(),
                        decode_rows=rows, decode_tables=[t[:] for t in tables], decode_lens=lens.tolist(),
                        sample_rows=rows, decode_arrays=(positions, slots, lens))
        other = StepPlan(token_ids=[1, 2, 3, 4], positions=[1, 2, 3, 4], slots=[1, 2, 3, 4], decode_rows=[0, 2, 3],
                         decode_tables=[np.array([9], dtype=np.int32) for _ in range(3)], decode_lens=[2, 3, 4],
                         sample_rows=[0, 2, 3])
        for padded in (plan, pad_decode_plan(plan, 8), other) if step % 2 else (plan,):  # then rows 0, 2, 3
            got = with_arrays.prepare(padded)
            fresh = StepBuffers(16, 8, 8, torch.device("cpu"), lambda n: 1)  # NOTE: no memory of a last step
            want = fresh.prepare(replace(padded, decode_arrays=None))
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            for name in ("slot_mapping", "decode_rows", "decode_lens"):
                assert torch.equal(getattr(got[2], name), getattr(want[2], name)), (step, name)
            # NOTE: a row's ids past its table are never read (and may be stale)
            assert [row[:len(t)].tolist() for row, t in zip(got[2].decode_tables, padded.decode_tables, strict=True)] \
                == [list(t) for t in padded.decode_tables]
