"""What one scheduling step decides (engine/scheduler.py): the chunks it computes, with what it
swaps and preempts, and the scheduler's fields of the engine's stats. And `SteadyBatch`, the
scheduler's steady decode: a step of the very same running requests, each one token further than
the last `update` left it, scheduled and updated with no pass over every request's fields.

`Scheduler.update` keeps a `SteadyBatch` when its step was decodes alone, every one sampling (the
token list form), none finished, and `running` is exactly the step's requests in chunk order. Then,
for each request, the general paths' tests are known without reading it:

    len(all_token_ids) == num_computed_tokens + 1     (it sampled: its chunk reached its end,
                                                       and update appended one token)
    num_computed_tokens < len(block_ids) * block_size  unless num_computed_tokens % block_size == 0
                                                       (its blocks hold its computed KV)

and the next `schedule`, finding `running` the same objects in the same order (one identity test
per request, in C), hands out last step's chunks, allocating only for the decodes entering a new
block (1 in `block_size` a step). Its `update` advances each request and appends its token in one
loop; the rows that may cache a block, stop or reach their length are found with numpy and only
those are looked at, in chunk order, as the general loop would.

NOTE: `running` changes only inside the scheduler (admission, preemption, `finish`), so a request
aborted, finished or added between two steps breaks the identity test; a step that raised between
`schedule` and `update` leaves no batch (`schedule` takes it, only `update` keeps one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from operator import contains, is_
from typing import TYPE_CHECKING, TypedDict

import numpy as np

from pdserve.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from pdserve.engine.kv_cache_manager import KVCacheManager


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    request: Request
    num_new_tokens: int  # tokens computed this step, starting at request.num_computed_tokens

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the request's tokens: the step samples."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


class SchedulerStatsFields(TypedDict):
    """The scheduler's and its KV cache's fields of `EngineStats` (engine_types.py): a TypedDict, so
    mypy checks each name and type where `LLMEngine.stats` unpacks it into that dataclass."""

    num_running: int
    num_waiting: int
    num_swapped: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    num_quarantined_kv_blocks: int
    kv_cache_usage: float
    num_preemptions: int
    num_prefix_query_tokens: int
    num_prefix_hit_tokens: int
    num_evictions: int
    num_no_available_block: int
    num_cannot_allocate: int
    num_remote_waiting: int
    num_scheduler_requests: int
    block_size: int


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, device)
    preempted_ids: list[str] = field(default_factory=list)
    num_batched_tokens: int = 0
    # the running requests' steady decode (`SteadyBatch`): these chunks are last step's, each
    # one token further; its `tokens` are their input ids (None: a step scheduled in full)
    steady: SteadyBatch | None = None

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class SteadyBatch:
    __slots__ = ("chunks", "requests", "positions", "tokens", "plain_greedy", "_max_totals", "_stop_sets")

    def __init__(self, chunks: list[ScheduledChunk], requests: list[Request], tokens: list[int]) -> None:
        self.chunks, self.requests = chunks, requests
        self.positions = np.array([r.num_computed_tokens for r in requests], dtype=np.int64)
        self.tokens = tokens  # each request's newest token, in chunk order: this step's input ids
        self._max_totals = np.array([r.max_total_tokens for r in requests], dtype=np.int64)
        self._stop_sets = [r.stop_tokens for r in requests]
        # every row is its logits' argmax alone (`Request.plain_greedy`; no grammar: `after_update`)
        self.plain_greedy = all(r.plain_greedy for r in requests)

    @classmethod
    def after_update(cls, out: SchedulerOutput, tokens: list[int], running: list[Request]) -> SteadyBatch | None:
        """The batch a general `update` of `out` (every chunk sampling, `tokens`) leaves, if steady."""
        chunks = out.chunks
        if (len(chunks) != len(running) or out.num_batched_tokens != len(chunks) or out.preempted_ids
                or out.blocks_to_swap_in or out.blocks_to_swap_out):
            return None  # a request finished (it left `running`), joined, or took more than one token
        requests = [c.request for c in chunks]
        if not all(map(is_, requests, running)) or any(r.matcher is not None for r in requests):
            return None
        return cls(list(chunks), requests, tokens)

    def schedule(self, running: list[Request], budget: int, kv: KVCacheManager) -> list[ScheduledChunk] | None:
        """This step's chunks, each request one token further (None: schedule `running` in full). A
        decode entering a new block gets it here; where the pool has none, None: the general loop,
        finding the blocks given so far, preempts from the tail as it always does."""
        requests = self.requests
        if len(running) != len(requests) or len(requests) > budget or not all(map(is_, running, requests)):
            return None
        for row in np.flatnonzero(self.positions % kv.block_size == 0).tolist():
            if not kv.allocate(requests[row], 1):
                return None
        return list(self.chunks)

    def update(self, tokens: list[int], kv: KVCacheManager,
               finish: Callable[[Request, RequestStatus], None]) -> tuple[list[Request], bool]:
        """Advance each request by its token, cache the blocks that filled, finish those that stop;
        returns the requests (all of them got a token) and whether the batch is still steady."""
        requests = self.requests
        for request, token in zip(requests, tokens, strict=True):
            request.num_computed_tokens += 1
            request.all_token_ids.append(token)
        positions = self.positions = self.positions + 1
        self.tokens = tokens
        rows = set(np.flatnonzero(positions + 1 >= self._max_totals).tolist())  # len(all_token_ids) reached
        if any(map(contains, self._stop_sets, tokens)):
            rows.update(i for i, hit in enumerate(map(contains, self._stop_sets, tokens)) if hit)
        filled = set(np.flatnonzero(positions % kv.block_size == 0).tolist()) if kv.pool.enable_caching else set()
        finished = False
        for row in sorted(rows | filled):  # NOTE: in chunk order, as the general loop caches and finishes
            request = requests[row]
            if row in filled:
                kv.cache_computed_blocks(request)
            if row in rows and (status := request.check_stop()) is not None:
                finish(request, status)
                finished = True
        return list(requests), not finished
