"""How a disaggregated worker's KV transport hooks into its engine: the records and hooks the engine
commands of the prefill and decode roles (engine/commands.py) hand to it, on the engine thread.

    prefill role  layer_observer   after each layer of a step: stream its KV (disagg/worker/kv_streamer.py)
                  stream_targets   where each request's KV goes: `expect` as the engine takes the
                                   request (`KVTarget`, or None: not placed yet), `place` once its
                                   decode reservation is known, `forget` once its blocks are freed
    decode role   expectations     `expect` a transfer into the blocks just reserved for it
                  remote_kv_quarantine_s   how long the blocks of a reservation that ended before its
                                   KV arrived stay out of reuse (the KV receiver's late-write window)

Every field of a command is data (`KVTarget` names the KV sender by a handle, not the object), so
the same command runs on an engine thread of the worker's process or, sent over the engine-core
link, in an engine process of its own (disagg/worker/core.py); the hooks are that side's objects.

Where the KV moves from and into is the runner's: its `kv_cache`, and with tensor parallelism and a
pool per rank its `rank_pools` (`RankPools`: the other ranks, each moving its own heads through a
rank hook); the KV side reads both through disagg/worker/kv_side.py's `kv_pools`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pdserve.config import EngineConfig
from pdserve.engine.request import Request
from pdserve.engine.scheduler_output import ScheduledChunk

# Prefill role: called after layer l's K/V of every chunk of the step are in the pool.
LayerObserver = Callable[[int, list[ScheduledChunk]], None]


@dataclass(frozen=True, slots=True)
class KVTarget:
    """Prefill role: a decode reservation a request's KV goes into."""

    block_ids: tuple[int, ...]  # the reservation's blocks in the decode pool, in token order
    num_cached_tokens: int  # leading tokens decode holds already (whole blocks): not sent
    sender: int  # the engine side's handle of the connected KV sender to that decode worker
    kv_address: str  # that decode worker's KV address
    token: str  # the reservation's, which every KV message presents


class StreamTargets(Protocol):
    """Prefill role, engine thread only, between steps (so a target never changes mid-step)."""

    def expect(self, request_id: str, target: KVTarget | None) -> None:
        """The engine is about to take the request: stream it to `target` (None: `place` says where)."""

    def place(self, request_id: str, target: KVTarget, request: Request | None) -> bool:
        """Its reservation is known now: send what `request` computed so far, stream the rest.
        False: the request is not expected (any more)."""

    def forget(self, request_id: str) -> None:
        """Its blocks are freed (or the engine refused it): stream nothing more of it."""


class TransferExpectations(Protocol):
    """Decode role: the KV receiver's side of a reservation (engine thread, as the blocks are
    reserved: before anyone can learn of the reservation, so before prefill can send a byte)."""

    def expect(self, request_id: str, block_ids: list[int] | tuple[int, ...], token: str) -> None: ...


@dataclass(frozen=True, slots=True)
class KVTransferSetup:
    """How a disaggregated worker's KV transport hooks into its engine (`configure_kv_transfer`)."""

    layer_observer: LayerObserver | None = None  # prefill role: streams each layer's KV as it is computed
    stream_targets: StreamTargets | None = None  # prefill role: where each request's KV goes
    expectations: TransferExpectations | None = None  # decode role: the receiver expects each transfer
    remote_kv_quarantine_s: float = 0.0  # decode role: see the module docstring


class RankHook(Protocol):
    """What a rank other than 0 does besides computing, with its own runner (its own KV pool).
    Built on the rank by a picklable spec (`install_rank_hook`). Its methods must not raise for
    one request's trouble: the rank has to keep computing every step with the others."""

    def command(self, message: Any) -> Any:
        """Rank 0's `rank_command`, between steps; the reply goes back to rank 0."""

    def step(self, message: Any) -> Callable[[int], None] | None:
        """Before a step, with its plan's `rank_message`: the step's per-layer callback."""

    def close(self) -> None: ...


# built on rank r from its own KV pool (the heads it holds), the engine's config and r
RankHookSpec = Callable[[torch.Tensor, EngineConfig, int], RankHook]


class RankPools(Protocol):
    """Tensor parallelism with a KV pool per rank (`ModelRunner.rank_pools`): the runner's `kv_cache`
    holds rank 0's heads only, and each other rank does its share of the KV hand-off on its own pool
    through a rank hook (engine/tensor_parallel.py; disagg/worker/rank_streaming.py, rank_receiving.py)."""

    @property
    def num_other_ranks(self) -> int: ...

    def install_rank_hook(self, spec: RankHookSpec,
                          step_message: Callable[[list[ScheduledChunk]], object] | None = None) -> None:
        """Build `spec`'s hook on every other rank; each step's plan carries `step_message(chunks)` to them."""

    def rank_command(self, message: Any) -> list[Any]:
        """`message` through every other rank's hook, between steps: their replies, rank 1 first."""
