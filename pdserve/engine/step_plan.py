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
    a decode's block table is a view of its persistent row (O(new blocks)), not a list copy."""
    bs = block_size
    plan = StepPlan(blocks_to_swap_out=out.blocks_to_swap_out, blocks_to_swap_in=out.blocks_to_swap_in)
    samplers: list[Request] = []
    targets: list[tuple[Request, int]] = []
    for chunk in out.chunks:
        request, start, num_new = chunk.request, chunk.request.num_computed_tokens, chunk.num_new_tokens
        row = len(plan.token_ids)
        end = start + num_new
        plan.token_ids.extend(request.all_token_ids[start:end])
        plan.positions.extend(range(start, end))
        blocks = request.block_ids
        plan.slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
        if request.params.lora_name is not None:
            plan.lora_spans.append((row, row + num_new, request.params.lora_name))
        if num_new == 1:
            plan.decode_rows.append(row)
            num_blocks = -(-end // bs)
            plan.decode_tables.append(blocks[:num_blocks] if tables is None else tables.table(request)[:num_blocks])
            plan.decode_lens.append(end)
        else:
            plan.prefills.append(PlannedPrefill(row, row + num_new, end, blocks[: -(-end // bs)]))
        if chunk.samples:
            plan.sample_rows.append(row + num_new - 1)
            samplers.append(request)
        if request.prompt_logprobs is not None:
            # row of position p predicts token p + 1; those already collected (before a preemption) are skipped
            for p in range(max(start, len(request.prompt_logprobs) - 1), min(end, request.num_prompt_tokens - 1)):
                plan.prompt_rows.append(row + p - start)
                targets.append((request, p + 1))
    if tables is not None:
        tables.retain({chunk.request.request_id for chunk in out.chunks})
    return plan, samplers, targets
