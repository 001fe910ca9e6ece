"""Prefill role under tensor parallelism with a KV pool per rank (CUDA; CPU with
PDSERVE_TP_RANK_POOLS=1): every rank streams its own KV heads into the decode reservation, over a
connection of its own, straight from its pool; no rank gathers another's heads.

    rank 0 (engine process)                              rank r (one per distinct head range)
    PrefillService -> MirroredKVStreamer                 RankStreaming (its KVStreamer, SenderPool)
      expect / place / forget  ---- rank_command --->      the same call, its sender to that address
      each step: (request, computed, new, blocks)  -->     streams the same blocks, its heads
      layer l done: rank 0's heads --tcp/nixl-->  decode  <--tcp/nixl-- layer l done: rank r's heads
      send_done(n x copies) ------------------->  decode (KVDone once every rank's layers arrived)

Every sending rank makes exactly the sends rank 0 makes (same targets, same chunks, same burst
threshold), so rank 0's final message announces its own layer payloads times the number of sending
ranks (`KVSender.copies`), and decode completes the request only once all of them arrived. Ranks
that hold the same heads (fewer KV heads than ranks) send once: the lowest of them.

Failures: a rank's payload that decode rejects ends the request there (rank 0's final message is
rejected with it). A rank whose connection broke sends nothing more; decode then never completes
the request and its transfer times out (rank 0's `flush` too): slower than a broken rank-0
connection, which fails at once, but never a wrong answer. Blocks: rank 0 forgets a request only
after its release; the forget reaches each rank before the next step (same pipe), and a rank
returns from it only once none of its sends reads the request's blocks any more.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from pdserve.config import EngineConfig
from pdserve.disagg.auth import load_cluster_secret
from pdserve.disagg.kv_layout import KVLayout
from pdserve.disagg.transport.ranked import HeadRange
from pdserve.disagg.transport.ready import LayerReady, layer_ready
from pdserve.disagg.transport.sender_base import KVSender
from pdserve.disagg.worker.kv_streamer import KVDestination, KVStreamer, SendLayer
from pdserve.disagg.worker.sender_pool import PoolSettings, SenderPool
from pdserve.engine.kv_transfer import RankPools
from pdserve.engine.request import Request
from pdserve.engine.scheduler_output import ScheduledChunk
from pdserve.model.parallel import TPShard

logger = logging.getLogger(__name__)

# (request id, its computed tokens before the step, the step's new tokens, its block ids)
_StepChunk = tuple[str, int, int, list[int]]


def rank_layout(model_name: str, pool: torch.Tensor, config: EngineConfig, rank: int) -> KVLayout:
    """The KV layout of one rank's own `pool`: its heads of the model's."""
    start, _ = TPShard(rank, config.tensor_parallel_size).kv_head_range(config.model)
    layout = KVLayout.from_pool(model_name, pool, tp_size=config.tensor_parallel_size,
                                scales=config.kv_scales)
    return dataclasses.replace(layout, kv_head_start=start)


def sending_ranks(config: EngineConfig) -> list[int]:
    """The ranks that send KV: the first of each distinct head range (replicas stay silent)."""
    ranges = [TPShard(rank, config.tensor_parallel_size).kv_head_range(config.model)
              for rank in range(config.tensor_parallel_size)]
    return [rank for rank, heads in enumerate(ranges) if heads not in ranges[:rank]]


def sending_heads(config: EngineConfig) -> list[HeadRange]:
    """The heads of each rank that sends (`sending_ranks`)."""
    return [TPShard(rank, config.tensor_parallel_size).kv_head_range(config.model) for rank in sending_ranks(config)]


@dataclass(frozen=True, slots=True)
class RankStreamingSpec:
    """Picklable: builds a rank's `RankStreaming` there (`RankPools.install_rank_hook`)."""

    transport: str
    model_name: str
    small_blocks: int  # rank 0's streamer's: the ranks must hold exactly the steps it holds
    cluster_secret_file: str | None

    def __call__(self, kv_cache: torch.Tensor, config: EngineConfig, rank: int) -> RankStreaming:
        return RankStreaming(self, kv_cache, config, rank)


class RankStreaming:
    """Rank r's side (`RankHook`): a streamer and senders of its own, fed by rank 0's calls."""

    def __init__(self, spec: RankStreamingSpec, kv_cache: torch.Tensor, config: EngineConfig, rank: int) -> None:
        self.rank = rank
        self.sends = rank in sending_ranks(config)
        layout = rank_layout(spec.model_name, kv_cache, config, rank)
        self.streamer = KVStreamer(layout.block_size, layout.num_layers, small_blocks=spec.small_blocks,
                                   ready=layer_ready(kv_cache.device))
        self.senders = SenderPool(spec.transport, layout, kv_cache, None,
                                  load_cluster_secret(spec.cluster_secret_file),
                                  PoolSettings(sending_heads=sending_heads(config),
                                               num_kv_heads=config.model.num_key_value_heads))
        self._request_senders: dict[str, KVSender] = {}

    def command(self, message: tuple[Any, ...]) -> None:
        if not self.sends:
            return
        kind, tid = message[0], message[1]
        if kind == "forget":
            self.streamer.forget(tid)
            sender = self._request_senders.pop(tid, None)
            if sender is not None:
                sender.release_blocking(tid)
            return
        _, _, dst, cached, address, token, *computed = message
        send = None if dst is None else self._destination(tid, address, token)
        if kind == "expect":
            self.streamer.expect(tid, dst, cached, send)
        elif kind == "place":
            request = None if not computed else _RankRequest(tid, computed[0], computed[1])
            self.streamer.place(tid, dst, cached, send, cast(Request | None, request))
        else:
            raise ValueError(f"unknown rank streaming command {kind!r}")

    def _destination(self, tid: str, address: str, token: str) -> KVDestination:
        sender = self.senders.get(address)  # NOTE: the first time, a handshake (rank 0 waits for it)
        self._request_senders[tid] = sender
        return KVDestination(sender, address, token)

    def step(self, message: list[_StepChunk] | None) -> Callable[[int], None] | None:
        if not self.sends or not message:
            return None
        chunks = cast(list[ScheduledChunk], [_RankChunk(_RankRequest(tid, computed, blocks), new)
                                             for tid, computed, new, blocks in message])

        def layer_done(layer: int) -> None:
            try:
                self.streamer(layer, chunks)
            except Exception:  # NOTE: the rank keeps computing; decode times the request out
                logger.exception("tensor-parallel rank %d: streaming layer %d failed", self.rank, layer)
        return layer_done

    def close(self) -> None:
        self.senders.close()


@dataclass(slots=True)
class _RankRequest:
    """What a `KVStreamer` reads of a request (rank r has no `Request` objects)."""

    request_id: str
    num_computed_tokens: int
    block_ids: list[int]


@dataclass(slots=True)
class _RankChunk:
    request: _RankRequest
    num_new_tokens: int


class MirroredKVStreamer(KVStreamer):
    """Rank 0's streamer: streams rank 0's heads and tells the other ranks to do the same with
    theirs (`rank_command` between steps, each step's chunks with its plan)."""

    def __init__(self, ranks: RankPools, block_size: int, num_layers: int, small_blocks: int,
                 ready: Callable[[], LayerReady] | None = None) -> None:
        super().__init__(block_size, num_layers, small_blocks=small_blocks, ready=ready)
        self.ranks = ranks

    def expect(self, request_id: str, dst_block_ids: Sequence[int] | None, num_cached_on_decode: int = 0,
               send_layer: SendLayer | None = None) -> None:
        address, token = _where(send_layer) if dst_block_ids is not None else (None, None)
        super().expect(request_id, dst_block_ids, num_cached_on_decode, send_layer)
        try:
            self.ranks.rank_command(("expect", request_id, None if dst_block_ids is None else list(dst_block_ids),
                                     num_cached_on_decode, address, token))
        except BaseException:
            self.forget(request_id)
            raise

    def place(self, request_id: str, dst_block_ids: Sequence[int], num_cached_on_decode: int,
              send_layer: SendLayer | None = None, request: Request | None = None) -> bool:
        address, token = _where(send_layer)
        if not super().place(request_id, dst_block_ids, num_cached_on_decode, send_layer, request):
            return False
        computed = () if request is None else (request.num_computed_tokens, list(request.block_ids))
        self.ranks.rank_command(("place", request_id, list(dst_block_ids), num_cached_on_decode, address, token,
                                 *computed))
        return True

    def forget(self, request_id: str) -> None:
        super().forget(request_id)
        self.ranks.rank_command(("forget", request_id))

    def step_message(self, chunks: list[ScheduledChunk]) -> list[_StepChunk] | None:
        """What the ranks need of this step's chunks to stream theirs (those with a target here)."""
        mine = [(c.request.request_id, c.request.num_computed_tokens, c.num_new_tokens, list(c.request.block_ids))
                for c in chunks if self.has_target(c.request.request_id)]
        return mine or None


def _where(send_layer: SendLayer | None) -> tuple[str, str]:
    if not isinstance(send_layer, KVDestination):
        raise ValueError("a prefill worker whose ranks each send their KV heads needs a KVDestination")
    return send_layer.address, send_layer.token
