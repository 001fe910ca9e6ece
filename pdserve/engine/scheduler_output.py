"""What one scheduling step decides (engine/scheduler.py): the chunks it computes, with what it
swaps and preempts, and the scheduler's fields of the engine's stats."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypedDict

from pdserve.engine.request import Request


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

    @property
    def is_empty(self) -> bool:
        return not self.chunks
