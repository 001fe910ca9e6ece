"""The engine side of a worker's KV transport: what lives beside the engine and its KV pool, in the
worker's process (engine on a thread: `--engine-in-process`, the in-process test clusters) or in
its engine process (disagg/worker/core.py, the default).

    decode   `DecodeKV`: the KV receiver (listening on the KV port, writing into the pool), which the
             engine's `ReserveRemote` makes expect each transfer (`KVTransferSetup.expectations`)
    prefill  `PrefillKV`: the layer streamer and the senders to decode workers; the engine's
             `AddPrefillOnly`/`PlaceKV`/`ReleaseKV` tell it where each request's KV goes
             (`KVTransferSetup.stream_targets`, a `KVTarget` naming its sender by handle), and the
             prefill service drives the hand-off through it: `connect`, `send_done`, `flush`, `release`

`build_kv_side` makes either from the engine and the worker's settings (`KVSideSpec`), over the
engine's pools as its runner holds them (`kv_pools`: `OnePool`, or `PoolPerRank` under tensor
parallelism with a pool per rank); `attach_kv_side` also hooks it into the engine (`build_worker`,
the engine process's `WorkerCoreSide`).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from pdserve.config import EngineConfig
from pdserve.disagg.auth import load_cluster_secret
from pdserve.disagg.config import WorkerConfig
from pdserve.disagg.kv_layout import KVLayout
from pdserve.disagg.transport import make_receiver, nixl_available
from pdserve.disagg.transport.base import KVReceiver
from pdserve.disagg.transport.errors import KVTransferError
from pdserve.disagg.transport.handshake import KVPeerPolicy
from pdserve.disagg.transport.messages import KVEvent
from pdserve.disagg.transport.ranked import HeadRange
from pdserve.disagg.transport.ready import layer_ready
from pdserve.disagg.transport.sender_base import KVSender
from pdserve.disagg.worker.kv_streamer import KVDestination, KVStreamer, small_step_blocks
from pdserve.disagg.worker.rank_receiving import link_ranks
from pdserve.disagg.worker.rank_streaming import MirroredKVStreamer, RankStreamingSpec, rank_layout, sending_heads
from pdserve.disagg.worker.sender_pool import PoolSettings, SenderPool
from pdserve.engine.kv_transfer import KVTarget, KVTransferSetup, RankPools, TransferExpectations
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.request import Request


@dataclass(frozen=True, slots=True)
class KVSideSpec:
    """What the engine side needs of a worker's settings (sent to its engine process as a dict)."""

    role: Literal["prefill", "decode"]
    transport: str  # resolved: nixl, tcp (fake: tests, one process)
    model_name: str
    kv_host: str = "127.0.0.1"
    kv_port: int = 0
    cluster_secret_file: str | None = None
    kv_max_connections: int = 64
    kv_handshake_timeout_s: float = 5.0

    @classmethod
    def of(cls, config: WorkerConfig, model_name: str) -> KVSideSpec:
        return cls(config.role, config.kv_transport or ("nixl" if nixl_available() else "tcp"), model_name,
                   config.kv_host, config.kv_port, config.cluster_secret_file, config.kv_max_connections,
                   config.kv_handshake_timeout_s)


class ReceiverView(Protocol):
    """What the decode service uses of the KV receiver: the receiver itself, or its mirror in the
    API process of a worker whose engine runs in its own process (disagg/worker/core.py)."""

    @property
    def layout(self) -> KVLayout: ...

    @property
    def kv_address(self) -> str: ...

    @property
    def num_dtype_conversions(self) -> int: ...

    def expect(self, request_id: str, block_ids: list[int] | tuple[int, ...], token: str = "") -> None: ...

    def cancel(self, request_id: str) -> None: ...

    def touch(self, request_id: str, step_s: float | None = None) -> None: ...

    async def settled(self) -> None: ...

    async def wait(self, request_id: str, timeout_s: float) -> KVEvent: ...

    def close(self) -> None: ...


class SenderHandles(Protocol):
    """What the prefill service drives a hand-off through: `PrefillKV` itself, or its proxy in the
    API process of a worker whose engine runs in its own process (disagg/worker/core.py)."""

    async def connect(self, kv_address: str) -> int: ...

    def send_done(self, handle: int, request_id: str, record: bytes, *, token: str) -> None: ...

    async def flush(self, handle: int, request_id: str, timeout_s: float) -> None: ...

    async def release(self, handle: int, request_id: str) -> None: ...

    def close(self) -> None: ...


class PrefillKV:
    """Prefill role: where each request's KV goes (`StreamTargets`, engine thread) and the
    senders that carry it, named by handle so a command can say which (any thread, event loop)."""

    def __init__(self, streamer: KVStreamer, senders: SenderPool) -> None:
        self.streamer = streamer
        self.senders = senders
        self._handles = itertools.count(1)
        self._lock = threading.Lock()
        self._by_handle: weakref.WeakValueDictionary[int, KVSender] = weakref.WeakValueDictionary()
        self._handle_of: weakref.WeakKeyDictionary[KVSender, int] = weakref.WeakKeyDictionary()

    # -- the sender handles (event loop) --------------------------------------------------------

    async def connect(self, kv_address: str) -> int:
        """The handle of the connected sender to a decode worker (KVLayoutMismatch, KVTransferError:
        it cannot be used)."""
        sender = self.senders.connected(kv_address)
        if sender is None:  # not connected yet (or broken, or another to close): connecting blocks
            sender = await asyncio.to_thread(self.senders.get, kv_address)
        with self._lock:
            handle = self._handle_of.get(sender)
            if handle is None:
                handle = self._handle_of[sender] = next(self._handles)
                self._by_handle[handle] = sender
        return handle

    def sender(self, handle: int) -> KVSender:
        sender = self._by_handle.get(handle)
        if sender is None:
            raise KVTransferError(f"KV sender {handle} is gone (its connection was closed)")
        return sender

    def send_done(self, handle: int, request_id: str, record: bytes, *, token: str) -> None:
        """The final message: `record` is the encoded hand-off record (disagg/handoff.py)."""
        self.sender(handle).send_done(request_id, record, token=token)

    async def flush(self, handle: int, request_id: str, timeout_s: float) -> None:
        await self.sender(handle).flush(request_id, timeout_s)

    async def release(self, handle: int, request_id: str) -> None:
        sender = self._by_handle.get(handle)
        if sender is not None:  # NOTE: gone: closed, so nothing of it reads the blocks any more
            await sender.release(request_id)

    def close(self) -> None:
        self.senders.close()

    # -- StreamTargets (engine thread) ----------------------------------------------------------

    def expect(self, request_id: str, target: KVTarget | None) -> None:
        if target is None:
            self.streamer.expect(request_id, None)
            return
        self.streamer.expect(request_id, target.block_ids, target.num_cached_tokens, self._destination(target))

    def place(self, request_id: str, target: KVTarget, request: Request | None) -> bool:
        return self.streamer.place(request_id, target.block_ids, target.num_cached_tokens, self._destination(target),
                                   request)

    def forget(self, request_id: str) -> None:
        self.streamer.forget(request_id)

    def _destination(self, target: KVTarget) -> KVDestination:
        return KVDestination(self.sender(target.sender), target.kv_address, target.token)


@dataclass(frozen=True, slots=True)
class KVSide:
    """A worker's engine side, as `build_kv_side` made it."""

    spec: KVSideSpec
    layout: KVLayout
    setup: KVTransferSetup  # what the engine is configured with
    receiver: KVReceiver | None = None  # decode
    prefill: PrefillKV | None = None  # prefill

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
        if self.prefill is not None:
            self.prefill.close()


class KVPools(Protocol):
    """The engine's KV pools, as its KV side moves KV from and into them (`kv_pools`): the pool the
    KV side reads and writes here is always `runner.kv_cache`."""

    @property
    def layout(self) -> KVLayout: ...

    @property
    def sending_heads(self) -> list[HeadRange] | None:
        """Prefill: the heads of each pool that sends (`SenderPool`'s; None: this one's)."""

    def link(self, receiver: KVReceiver, peers: KVPeerPolicy) -> None:
        """Decode: `receiver` (this pool's) receives into the engine's other pools too, if any."""

    def streamer(self, small_blocks: int) -> KVStreamer:
        """Prefill: the streamer of this pool, which has the engine's other pools streamed too, if any."""


@dataclass(frozen=True, slots=True)
class OnePool:
    """Every KV head of the engine in one pool: one process, or tensor-parallel ranks sharing one (CPU)."""

    layout: KVLayout
    device: torch.device = torch.device("cpu")  # the pool's: where its layers' ready events are recorded
    sending_heads: None = None

    def link(self, receiver: KVReceiver, peers: KVPeerPolicy) -> None:
        return None  # NOTE: the receiver writes every head itself

    def streamer(self, small_blocks: int) -> KVStreamer:
        return KVStreamer(self.layout.block_size, self.layout.num_layers, small_blocks=small_blocks,
                          ready=layer_ready(self.device))


class PoolPerRank:
    """Tensor parallelism with a pool per rank (`ModelRunner.rank_pools`): `kv_cache` holds rank
    0's heads, and every other rank moves its own (rank_receiving.py, rank_streaming.py)."""

    def __init__(self, ranks: RankPools, pool: torch.Tensor, config: EngineConfig, spec: KVSideSpec) -> None:
        if spec.transport == "fake":
            raise ValueError("the fake KV transport moves KV within one process: a worker with "
                             "--tensor-parallel-size > 1 and a KV pool per rank (CUDA) needs tcp or nixl")
        self.ranks, self.spec, self.device = ranks, spec, pool.device
        self.layout = rank_layout(spec.model_name, pool, config, 0)
        self.sending_heads = sending_heads(config)

    def link(self, receiver: KVReceiver, peers: KVPeerPolicy) -> None:
        link_ranks(self.ranks, receiver, self.spec, peers)  # every rank receives its heads

    def streamer(self, small_blocks: int) -> KVStreamer:
        streamer = MirroredKVStreamer(self.ranks, self.layout.block_size, self.layout.num_layers, small_blocks,
                                      layer_ready(self.device))
        self.ranks.install_rank_hook(RankStreamingSpec(self.spec.transport, self.spec.model_name, small_blocks,
                                                       self.spec.cluster_secret_file), streamer.step_message)
        return streamer


def kv_pools(runner: ModelRunner, config: EngineConfig, spec: KVSideSpec) -> KVPools:
    """The pools of the engine whose `runner` and `config` these are, moved as `spec` says."""
    ranks = runner.rank_pools
    if ranks is not None:
        return PoolPerRank(ranks, runner.kv_cache, config, spec)
    return OnePool(KVLayout.from_pool(spec.model_name, runner.kv_cache, tp_size=config.tensor_parallel_size,
                                      scales=config.kv_scales), runner.kv_cache.device)


def build_kv_side(runner: ModelRunner, config: EngineConfig, spec: KVSideSpec,
                  sender_options: Mapping[str, object] | None = None,
                  expectations: TransferExpectations | None = None) -> KVSide:
    """The receiver (decode) or the streamer and senders (prefill) of the engine whose `runner` and
    `config` these are; `sender_options` go to each KV sender (tests: the fake transport's);
    `expectations` (decode): what the engine's reservations expect their transfers through (default:
    the receiver)."""
    pools = kv_pools(runner, config, spec)
    layout = pools.layout
    secret = load_cluster_secret(spec.cluster_secret_file)
    if spec.role == "decode":
        peers = KVPeerPolicy(secret, spec.kv_max_connections, spec.kv_handshake_timeout_s)
        receiver = make_receiver(spec.transport, layout, runner.kv_cache, host=spec.kv_host, port=spec.kv_port,
                                 peers=peers)
        pools.link(receiver, peers)
        setup = KVTransferSetup(expectations=receiver if expectations is None else expectations,
                                remote_kv_quarantine_s=receiver.late_write_window_s)
        return KVSide(spec, layout, setup, receiver=receiver)
    small_blocks = small_step_blocks(layout.block_bytes_per_layer, layout.num_layers)
    streamer = pools.streamer(small_blocks)
    settings = PoolSettings(sending_heads=pools.sending_heads, num_kv_heads=config.model.num_key_value_heads)
    senders = SenderPool(spec.transport, layout, runner.kv_cache, sender_options, secret, settings)
    prefill = PrefillKV(streamer, senders)
    return KVSide(spec, layout, KVTransferSetup(layer_observer=streamer, stream_targets=prefill), prefill=prefill)


def attach_kv_side(engine: LLMEngine, spec: KVSideSpec, sender_options: Mapping[str, object] | None = None,
                   expectations: TransferExpectations | None = None) -> KVSide:
    """The engine's KV side (`build_kv_side`), its hooks set on the engine and its step log naming
    the role: before the engine's thread (or loop) starts, which alone reads them from then on."""
    kv = build_kv_side(engine.runner, engine.config, spec, sender_options, expectations)
    engine.configure_kv_transfer(kv.setup)
    if engine.step_log is not None:
        engine.step_log.role = spec.role
    return kv
