"""One step's inputs as plain integers: what the scheduler decided, flattened, before any tensor.

The model runner builds its tensors from a `StepPlan`; under tensor parallelism rank 0 builds the
plan once and sends it to the other ranks (a small picklable record: no `Request` objects), which
build the very same tensors on their side.

Flattened batch for chunks [A: 3 new tokens from position 5], [B: 1 decode at position 9]:

    row        0    1    2  | 3
    request    A    A    A  | B
    position   5    6    7  | 9
    slot       bt_A[pos // bs] * bs + pos % bs
    logits     only for rows whose chunk reaches the end of its request (samples)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pdserve.engine.block_tables import BlockTables
from pdserve.engine.request import Request
from pdserve.engine.scheduler import SchedulerOutput


@dataclass(frozen=True, slots=True)
class PlannedPrefill:
    start: int  # first row of the sequence in the flattened batch
    end: int  # one past its last row
    context_len: int  # tokens of KV after this step
    block_ids: list[int]  # its blocks covering context_len


@dataclass(slots=True)
class StepPlan:
    token_ids: list[int] = field(default_factory=list)  # one per row
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # where each row's K/V is written
    decode_rows: list[int] = field(default_factory=list)  # rows of single-token chunks ...
    # ... their block tables (int32 views of `BlockTables` rows where the runner keeps them) ...
    decode_tables: list[list[int] | np.ndarray] = field(default_factory=list)
    decode_lens: list[int] = field(default_factory=list)  # ... and context lengths
    prefills: list[PlannedPrefill] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)  # rows whose logits are sampled
    prompt_rows: list[int] = field(default_factory=list)  # rows whose logits give prompt logprobs
    lora_spans: list[tuple[int, int, str]] = field(default_factory=list)  # rows [start, end) under a LoRA adapter
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, device)
    # tensor parallelism: what the ranks' hooks do with this step (a prefill worker's ranks: which
    # requests' KV to stream), see TPModelRunner.install_rank_hook
    rank_message: object = None


def plan_step(out: SchedulerOutput, block_size: int, tables: BlockTables | None = None
              ) -> tuple[StepPlan, list[Request], list[tuple[Request, int]]]:
    """The plan, the requests that sample, in `sample_rows` order, and for each of `prompt_rows`
    the request and the position of the prompt token whose logprob its logits give. With `tables`
    a decode's block table is a view of its persistent row (O(new blocks)), not a list copy.
    NOTE: runs once per request per step: a decode takes the shortest path (no slices, no ranges)."""
    bs = block_size
    plan = StepPlan(blocks_to_swap_out=out.blocks_to_swap_out, blocks_to_swap_in=out.blocks_to_swap_in)
    samplers: list[Request] = []
    targets: list[tuple[Request, int]] = []
    token_ids, positions, slots, sample_rows = plan.token_ids, plan.positions, plan.slots, plan.sample_rows
    decode_rows, decode_tables, decode_lens = plan.decode_rows, plan.decode_tables, plan.decode_lens
    table = None if tables is None else tables.table
    for chunk in out.chunks:
        request, num_new = chunk.request, chunk.num_new_tokens
        start = request.num_computed_tokens
        row, end, blocks, all_ids = len(token_ids), start + num_new, request.block_ids, request.all_token_ids
        if num_new == 1:
            token_ids.append(all_ids[start])
            positions.append(start)
            slots.append(blocks[start // bs] * bs + start % bs)
            decode_rows.append(row)
            num_blocks = start // bs + 1
            decode_tables.append(blocks[:num_blocks] if table is None else table(request, num_blocks))
            decode_lens.append(end)
        else:
            token_ids.extend(all_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            plan.prefills.append(PlannedPrefill(row, row + num_new, end, blocks[: -(-end // bs)]))
        if request.params.lora_name is not None:
            plan.lora_spans.append((row, row + num_new, request.params.lora_name))
        if end == len(all_ids):  # the chunk samples (`ScheduledChunk.samples`)
            sample_rows.append(row + num_new - 1)
            samplers.append(request)
        if request.prompt_logprobs is not None:
            _plan_prompt_rows(plan, targets, request, row, start, end)
    if tables is not None:
        tables.end_step()
    return plan, samplers, targets


def _plan_prompt_rows(plan: StepPlan, targets: list[tuple[Request, int]], request: Request, row: int, start: int,
                      end: int) -> None:
    """The rows of this chunk whose logits give prompt logprobs: the row of position p predicts
    token p + 1; those already collected (before a preemption) are skipped."""
    assert request.prompt_logprobs is not None
    for p in range(max(start, len(request.prompt_logprobs) - 1), min(end, request.num_prompt_tokens - 1)):
        plan.prompt_rows.append(row + p - start)
        targets.append((request, p + 1))
