"""Triton specializes pointer arguments on 16-byte alignment: every int32 view the step buffers
hand the kernels starts 16 bytes apart whatever the step (so the set of compiled variants stays
bounded: no new variant in the middle of serving when the number of decodes changes)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from pdserve import LLM
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.step_buffers import StepBuffers
from pdserve.engine.step_plan import PlannedPrefill, StepPlan


def _plan(num_decodes: int, num_prefix: int) -> StepPlan:
    plan = StepPlan()
    for i in range(num_decodes):
        plan.token_ids.append(1)
        plan.positions.append(5)
        plan.slots.append(100 + i)
        plan.decode_rows.append(i)
        plan.decode_tables.append([i + 1, i + 2])
        plan.decode_lens.append(6)
    for i in range(num_prefix):
        start = len(plan.token_ids)
        plan.token_ids += [1, 2, 3]
        plan.positions += [4, 5, 6]
        plan.slots += [200 + 3 * i, 201 + 3 * i, 202 + 3 * i]
        plan.prefills.append(PlannedPrefill(start, start + 3, 7, [40 + i, 50 + i]))
    return plan


def test_every_view_is_16_byte_aligned_whatever_the_step() -> None:
    buffers = StepBuffers(max_tokens=37, max_seqs=9, max_blocks_per_seq=5, device=torch.device("cpu"),
                          splits=lambda n: 1)
    for num_decodes in range(0, 8):
        for num_prefix in (1, 2):
            ids, positions, meta = buffers.prepare(_plan(num_decodes, num_prefix))
            views = (ids, positions, meta.slot_mapping, meta.decode_rows, meta.decode_tables, meta.decode_lens,
                     meta.prefix_starts, meta.prefix_ends, meta.prefix_tables, meta.prefix_lens)
            assert {v.data_ptr() % 16 for v in views} == {0}, (num_decodes, num_prefix)
            assert meta.prefix_lens.tolist() == [7] * num_prefix
            assert meta.prefix_tables[:, :2].tolist() == [[40 + i, 50 + i] for i in range(num_prefix)]
            assert meta.decode_tables[:, :2].tolist() == [[i + 1, i + 2] for i in range(num_decodes)]
            assert meta.decode_tables.stride(0) % 4 == 0


def test_a_step_of_the_last_steps_shape_keeps_its_views_and_no_other_does() -> None:
    """The views of a step of the last step's shape are last step's (steady decodes); a step that
    differs in any count the views depend on (tokens, decodes, prompt chunks, their longest query,
    the fresh prompts) gets its own, each the same as a fresh buffer's."""
    def plan(num_decodes: int, *chunks: tuple[int, int]) -> StepPlan:
        """`num_decodes` decodes, then a prompt chunk of `size` tokens ending at `end` for each (size, end)."""
        planned = _plan(num_decodes, 0)
        for size, end in chunks:
            start = len(planned.token_ids)
            planned.token_ids += [1] * size
            planned.positions += list(range(end - size, end))
            planned.slots += list(range(300 + start, 300 + start + size))
            planned.prefills.append(PlannedPrefill(start, start + size, end, [40, 50, 60]))
        return planned

    def make() -> StepBuffers:
        buffers = StepBuffers(max_tokens=37, max_seqs=9, max_blocks_per_seq=5, device=torch.device("cpu"),
                              splits=lambda n: n)
        buffers.fresh_in_kernel_below = 4  # a fresh prompt of 4 tokens attends apart (SDPA)
        return buffers

    kept = make()
    # each step differs from the one before in one count the views depend on, but steps 1 and 6 (the same again):
    # decodes, tokens (2 + 6 against 2 + 5), the longest query (4 + 2 against 3 + 3), where the fresh prompt is
    # (a 4-token prompt with no context attends apart)
    steps = [plan(2, (3, 9)), plan(2, (3, 9)), plan(2, (4, 9)), plan(3, (4, 9)), plan(3, (4, 4)), plan(3, (4, 9)),
             plan(3, (4, 9)), plan(3, (4, 9), (2, 9)), plan(3, (4, 9), (1, 9)), plan(3, (3, 9), (2, 9)),
             plan(3, (4, 4), (2, 9)), plan(3, (2, 9), (4, 4))]
    last = None
    for index, step in enumerate(steps):
        views = kept.prepare(step)
        assert (views is last) == (index in (1, 6)), index
        last = views
        (ids, positions, meta), (want_ids, want_positions, want) = views, make().prepare(step)
        assert torch.equal(ids, want_ids) and torch.equal(positions, want_positions)
        for name in ("slot_mapping", "decode_rows", "decode_lens", "prefix_starts", "prefix_ends", "prefix_lens"):
            assert torch.equal(getattr(meta, name), getattr(want, name)), (index, name)
        assert (meta.num_splits, meta.max_prefix_query_len, meta.fresh_prefills) == (
            want.num_splits, want.max_prefix_query_len, want.fresh_prefills)


def _paged_runner(model_dirs: dict[str, Path], graphs: bool, max_num_seqs: int) -> ModelRunner:
    """The tiny model's runner on the Triton path (the kernels in Triton's interpreter), float32."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton kernels on CPU need the interpreter")
    llm = LLM(model=str(model_dirs["tiny"]), device="cpu", dtype="float32", num_kv_blocks=16, block_size=4,
              max_num_seqs=max_num_seqs, max_model_len=64)
    runner = llm.engine.runner
    runner.use_paged_step(graphs=graphs)
    return runner


def test_prefill_warm_up_writes_no_kv(model_dirs: dict[str, Path]) -> None:
    """The start-up warm-up of the prefill kernels (CUDA: before serving) runs a mixed step on the
    Triton path that leaves the pool as it was."""
    runner = _paged_runner(model_dirs, graphs=True, max_num_seqs=4)
    runner.kv_cache.normal_()
    before = runner.kv_cache.clone()
    runner.warm_up_prefill()
    assert torch.equal(runner.kv_cache, before)


def test_decode_tables_are_written_where_they_grew_and_always_read_back_whole() -> None:
    """Decode tables that are views of persistent rows (`BlockTables`) are copied in only past what
    the same row held last step; whatever the step does (order changes, a row that grew into a new
    array, prefix rows over a later decode's row, a step that raised), every decode reads its whole
    table back."""
    import numpy as np

    buffers = StepBuffers(max_tokens=32, max_seqs=8, max_blocks_per_seq=12, device=torch.device("cpu"),
                          splits=lambda n: 1)
    rows = {name: np.arange(base, base + 16, dtype=np.int32) for name, base in (("a", 10), ("b", 40), ("c", 70))}

    def step(tables: list[tuple[str, int]], num_prefix: int = 0) -> None:
        plan = _plan(len(tables), num_prefix)
        plan.decode_tables = [rows[name][:count] for name, count in tables]
        _, _, meta = buffers.prepare(plan)
        for i, (name, count) in enumerate(tables):
            assert meta.decode_tables[i, :count].tolist() == rows[name][:count].tolist(), (tables, i)

    step([("a", 3), ("b", 2)])
    step([("a", 4), ("b", 2)])  # a grew by one block
    step([("a", 4), ("b", 1)])  # a shorter view of b (its row still holds the ids after it)
    step([("b", 3), ("c", 5)])  # another order
    step([("b", 3)], num_prefix=2)  # prefix rows from row 4 on
    step([("b", 3), ("c", 5), ("a", 6), ("a", 2), ("c", 7)])  # rows 1..4: one was a prefix row
    rows["a"] = rows["a"].copy()  # a row grown into a new array (BlockTables doubles): all of it again
    rows["a"][:] += 100
    step([("b", 3), ("c", 5), ("a", 6)])
    with pytest.raises(ValueError, match="exceeds the step buffers"):
        step([("c", 5), ("b", 3), ("a", 13)])  # rows 0 and 1 are rewritten before the step raises
    step([("b", 3), ("c", 5), ("a", 6)])


def test_eager_warm_up_compiles_every_split_count(model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
                                                  ) -> None:
    """Without decode graphs (`--enforce-eager`) a decode batch splits by its own size, and each split
    count is a kernel variant (NUM_SPLITS is a constexpr): start-up runs each once, so none compiles in
    the middle of serving; the pool is left as it was."""
    runner = _paged_runner(model_dirs, graphs=False, max_num_seqs=6)
    from pdserve.model import triton_attention

    assert runner.step_buffers is not None
    expected = {runner.step_buffers.splits(n) for n in range(1, 7)}
    assert len(expected) > 1
    seen: set[int] = set()
    launch = triton_attention.decode_attention

    def recording(*args: object, num_splits: int, **kwargs: object) -> None:
        seen.add(num_splits)
        launch(*args, num_splits=num_splits, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(triton_attention, "decode_attention", recording)
    runner.kv_cache.normal_()
    before = runner.kv_cache.clone()
    runner.warm_up_prefill()
    assert seen == expected
    assert torch.equal(runner.kv_cache, before)


def test_the_warm_up_runs_through_the_runners_own_run() -> None:
    """Tensor parallelism: `TPModelRunner.run` sends each plan to every rank before running it on
    rank 0, so a warm-up through `self.run` (start_tensor_parallel, once every rank is up) compiles
    the kernels on every rank together; a direct `ModelRunner.run` would run rank 0's collectives alone."""
    from types import SimpleNamespace

    plans: list[int] = []
    runner = SimpleNamespace(decode_graphs=None, step_buffers=SimpleNamespace(splits=lambda n: 4 if n < 3 else 1),
                             config=SimpleNamespace(scheduler=SimpleNamespace(max_num_seqs=8)),
                             run=lambda plan: plans.append(len(plan.decode_rows)))
    ModelRunner.warm_up_prefill(runner)  # type: ignore[arg-type]
    assert plans == [1, 3]  # the mixed step (one decode), then the smallest batch of the other split count
