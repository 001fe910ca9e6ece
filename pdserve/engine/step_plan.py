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
from operator import is_

import numpy as np

from pdserve.engine.block_tables import BlockTables
from pdserve.engine.request import Request
from pdserve.engine.scheduler_output import ScheduledChunk, SchedulerOutput


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
    # a steady decode's positions, slots and context lengths again, as the int64 arrays it planned them
    # in (`SteadyDecodes`): the step buffers copy these, not the lists (None: the lists alone)
    decode_arrays: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    # tensor parallelism: what the ranks' hooks do with this step (a prefill worker's ranks: which
    # requests' KV to stream), see TPModelRunner.install_rank_hook
    rank_message: object = None


_SHARED_ROWS: dict[int, list[int]] = {}


def shared_rows(n: int) -> list[int]:
    """range(n), one list for each n, never changed: a plan that takes its rows from here gives the
    step buffers the very list they wrote last step, and they skip it (`StepBuffers.prepare`)."""
    rows = _SHARED_ROWS.get(n)
    if rows is None:
        rows = _SHARED_ROWS[n] = list(range(n))
    return rows


class SteadyDecodes:
    """The last step's batch when it was decodes alone, every one sampling: the steady decode. A
    step of the very same decodes, each one token further, is planned from it: the positions,
    slots and lengths are last step's plus one (numpy), and only the decodes entering a new block
    touch their block list and persistent table (1 in `block_size` a step). What is left per
    request is a few list comprehensions (reading an attribute: tens of ns each on CPython 3.11),
    not the general planner's loop body (about 1 µs)."""

    def __init__(self) -> None:
        self._chunks: list[ScheduledChunk] = []  # empty: the last step was not a steady decode
        self._positions = np.zeros(0, dtype=np.int64)
        self._slots = np.zeros(0, dtype=np.int64)
        self._tables: list[list[int] | np.ndarray] = []
        self._lora_spans: list[tuple[int, int, str]] = []

    def remember(self, out: SchedulerOutput, plan: StepPlan, num_samplers: int) -> None:
        """Keep `plan` as the base of the next step's if it is decodes alone, every one sampling."""
        steady = (not plan.prefills and not plan.prompt_rows and not plan.blocks_to_swap_out
                  and not plan.blocks_to_swap_in and len(plan.decode_rows) == num_samplers == len(out.chunks))
        self._chunks = list(out.chunks) if steady else []
        if steady:
            self._positions = np.array(plan.positions, dtype=np.int64)
            self._slots = np.array(plan.slots, dtype=np.int64)
            self._tables, self._lora_spans = plan.decode_tables, plan.lora_spans

    def next_plan(self, out: SchedulerOutput, block_size: int, tables: BlockTables
                  ) -> tuple[StepPlan, list[Request]] | None:
        """This step's plan and samplers, if it is the last step's decodes, each one token further
        (None: plan it in full)."""
        chunks, last = out.chunks, self._chunks
        num = len(last)
        # NOTE: the scheduler hands a decode the same ScheduledChunk every step (`_decode_chunk`)
        if (not num or len(chunks) != num or out.blocks_to_swap_out or out.blocks_to_swap_in
                or not all(map(is_, chunks, last))):
            return None
        positions = self._positions + 1
        len_array = positions + 1
        position_list, lens = positions.tolist(), len_array.tolist()
        if out.steady is not None:  # NOTE: the scheduler vouches for what the checks below read
            if not np.array_equal(out.steady.positions, positions):
                return None  # this plan's memory is not of the step the scheduler's batch followed
            requests, token_ids = out.steady.requests, out.steady.tokens
        else:
            requests = [c.request for c in chunks]
            if [r.num_computed_tokens for r in requests] != position_list:
                return None  # a step in between did not advance them all (it raised)
            token_lists = [r.all_token_ids for r in requests]
            if [len(t) for t in token_lists] != lens:
                return None  # each holds its one new token, so its chunk samples
            token_ids = [t[-1] for t in token_lists]
        slots = self._slots + 1
        decode_tables = list(self._tables)
        for row in np.flatnonzero(positions % block_size == 0).tolist():  # decodes entering a new block
            request, position = requests[row], position_list[row]
            slots[row] = request.block_ids[position // block_size] * block_size
            decode_tables[row] = tables.table(request, position // block_size + 1)
        tables.end_step(keep_all=True)
        rows = shared_rows(num)
        plan = StepPlan(token_ids=list(token_ids), positions=position_list, slots=slots.tolist(),
                        decode_rows=rows, decode_tables=decode_tables, decode_lens=lens,
                        sample_rows=rows, lora_spans=self._lora_spans,
                        decode_arrays=(positions, slots, len_array))
        self._positions, self._slots, self._tables = positions, slots, decode_tables
        return plan, list(requests)


def plan_step(out: SchedulerOutput, block_size: int, tables: BlockTables | None = None,
              steady: SteadyDecodes | None = None) -> tuple[StepPlan, list[Request], list[tuple[Request, int]]]:
    """The plan, the requests that sample, in `sample_rows` order, and for each of `prompt_rows`
    the request and the position of the prompt token whose logprob its logits give. With `tables`
    a decode's block table is a view of its persistent row (O(new blocks)), not a list copy; with
    `tables` and `steady`, a steady decode step is planned from the last one (`SteadyDecodes`).
    NOTE: runs once per request per step: a decode takes the shortest path (no slices, no ranges)."""
    if steady is not None and tables is not None and (planned := steady.next_plan(out, block_size, tables)):
        return planned[0], planned[1], []
    plan, samplers, targets = _plan_in_full(out, block_size, tables)
    if steady is not None:
        steady.remember(out, plan, len(samplers))
    return plan, samplers, targets


def _plan_in_full(out: SchedulerOutput, block_size: int, tables: BlockTables | None
                  ) -> tuple[StepPlan, list[Request], list[tuple[Request, int]]]:
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
