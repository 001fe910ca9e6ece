"""Decode attention reads each context's longest run of adjacent blocks in place and gathers only
the blocks left, joining the two by log-sum-exp (model/attention.py): the logits equal those of
attention over each whole context gathered, whatever the block tables look like."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import MODEL_NAMES

from pdserve import LLM
from pdserve.engine.model_runner import longest_run
from pdserve.engine.step_plan import PlannedPrefill, StepPlan

BLOCK_SIZE = 4
# (block table, context length): one run; a run then scattered blocks, the last one partly filled;
# scattered blocks then a run ending in a partly filled block; the run in the middle; one block;
# no two adjacent blocks
DECODES = [([3, 4, 5], 12), ([10, 11, 12, 30, 20], 18), ([40, 33, 34, 35], 14), ([50, 21, 22, 23, 44], 17),
           ([60], 2), ([9, 7, 27, 1], 13)]


def test_longest_run_is_the_first_of_the_longest() -> None:
    assert longest_run([5]) == (0, 1)
    assert longest_run([4, 5, 6]) == (0, 3)
    assert longest_run([7, 8, 2, 3, 4]) == (2, 5)
    assert longest_run([1, 2, 9, 3, 4]) == (0, 2)
    assert longest_run([3, 2, 1]) == (0, 1)


def decode_plan(decodes: list[tuple[list[int], int]], block_size: int = BLOCK_SIZE) -> StepPlan:
    """A step of these (block table, context length) decodes, rows 0..n-1, each sampling."""
    plan = StepPlan()
    for row, (table, context_len) in enumerate(decodes):
        position = context_len - 1
        plan.token_ids.append(100 + row)
        plan.positions.append(position)
        plan.slots.append(table[position // block_size] * block_size + position % block_size)
        plan.decode_rows.append(row)
        plan.decode_tables.append(table)
        plan.decode_lens.append(context_len)
        plan.sample_rows.append(row)
    return plan


def _plan() -> StepPlan:
    """The decodes above, plus a 5-token prompt in blocks 61..62, in one step."""
    plan = decode_plan(DECODES)
    start = len(DECODES)
    plan.token_ids.extend(range(200, 205))
    plan.positions.extend(range(5))
    plan.slots.extend(61 * BLOCK_SIZE + p for p in range(5))
    plan.prefills.append(PlannedPrefill(start, start + 5, 5, [61, 62]))
    plan.sample_rows.append(start + 4)
    return plan


@pytest.mark.parametrize("model", MODEL_NAMES)  # GQA 4 query heads on 2 KV heads, and on 1
def test_in_place_decode_matches_attention_over_gathered_contexts(model: str, model_dirs: dict[str, Path]) -> None:
    llm = LLM(model=str(model_dirs[model]), dtype="float32", num_kv_blocks=64, block_size=BLOCK_SIZE)
    runner = llm.engine.runner
    assert runner.in_place_decode
    torch.manual_seed(0)
    runner.kv_cache.normal_()  # every block holds some earlier tokens' K/V
    plan = _plan()
    _, _, meta = runner._prepare(plan)
    assert len(meta.decode_runs) == len(DECODES)
    assert sum(len(batch.rows) for batch in meta.decodes) == 4  # those whose table is not one run
    in_place = runner.run(plan)
    runner.in_place_decode = False
    _, _, meta = runner._prepare(plan)
    assert not meta.decode_runs and sum(len(batch.rows) for batch in meta.decodes) == len(DECODES)
    gathered = runner.run(plan)
    assert in_place is not None and gathered is not None
    torch.testing.assert_close(in_place, gathered, rtol=1e-5, atol=1e-5)
    assert (in_place.argmax(-1) == gathered.argmax(-1)).all()
