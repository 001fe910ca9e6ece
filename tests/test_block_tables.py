"""Persistent block tables (engine/block_tables.py): a decode's table is always its request's
current block list, whichever way the list changed, and rows leave with their requests."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from helpers import make_request

from pdserve import LLM, SamplingParams
from pdserve.engine.block_tables import BlockTables


def test_rows_follow_appends_replacements_and_truncations() -> None:
    tables = BlockTables()
    request = make_request("a", 8)
    request.block_ids = [5, 9]
    assert tables.table(request).tolist() == [5, 9]
    request.block_ids.extend(range(100, 200))  # grows past the first capacity
    assert tables.table(request).tolist() == [5, 9, *range(100, 200)]
    request.block_ids = [7, 3]  # swapped in / preempted and reallocated: a new list
    assert tables.table(request).tolist() == [7, 3]
    del request.block_ids[1:]  # truncated in place, then extended by other ids
    request.block_ids.append(11)
    assert tables.table(request).tolist() == [7, 11]
    assert tables.table(request).dtype == np.int32


def test_truncated_then_regrown_past_the_old_length_is_not_trusted() -> None:
    tables = BlockTables()
    request = make_request("a", 8)
    request.block_ids = [1, 2]
    tables.table(request)
    tables.retain(set())  # out of a step: its row is dropped
    assert len(tables) == 0
    del request.block_ids[:]
    request.block_ids.extend([8, 9, 10])
    assert tables.table(request).tolist() == [8, 9, 10]


def test_retain_keeps_only_the_steps_requests() -> None:
    tables = BlockTables()
    requests = [make_request(f"r{i}", 4) for i in range(3)]
    for i, request in enumerate(requests):
        request.block_ids = [i]
        tables.table(request)
    tables.retain({"r1"})
    assert len(tables) == 1
    assert tables.table(requests[1]).tolist() == [1]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton kernels on CPU need the interpreter")
@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_tokens_equal_through_preemptions_on_the_step_buffer_path(model_dirs: dict[str, Path],
                                                                   preemption_mode: str) -> None:
    """A pool too small for every stream: requests are preempted (their block lists rebuilt or
    swapped) and resumed; the step-buffer path, tables from persistent rows, gives the torch path's
    tokens."""
    pytest.importorskip("triton")
    prompts = [{"prompt_token_ids": list(range(10 + 7 * i, 30 + 7 * i))} for i in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm = LLM(model=str(model_dirs["tiny"]), device="cpu", dtype="float32", num_kv_blocks=40, block_size=4,
              max_num_seqs=6, max_model_len=64, max_num_batched_tokens=32, preemption_mode=preemption_mode,
              swap_space=0.01 if preemption_mode == "swap" else 0.0)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    llm.engine.runner.use_paged_step(graphs=True)
    preempted_before = llm.engine.scheduler.num_preemptions
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert llm.engine.scheduler.num_preemptions > preempted_before, "the workload must preempt"
    assert got == expected
    tables = llm.engine.runner.block_tables
    # rows live from one step to the next: those of the last step's decodes stay until the next one
    assert tables is not None and len(tables) <= 6
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    assert len(tables) <= 1  # nothing of the earlier requests left behind
