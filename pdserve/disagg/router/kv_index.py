"""The router's view of its workers' prefix caches, kept from their KV-cache events (vLLM's format,
engine/kv_event_wire.py) instead of asked per request.

    worker's engine --PUB [topic, seq, batch]--> KVEventSubscription (a task on the router's loop)
                                                   -> KVBlockIndex of that worker: the hashes it caches
    KVEventsView (one per role followed): the subscriptions of that role's workers, kept as the pool changes
    DecodePolicy "kv-events" (policy.py), and --prefill-policy kv-events (the memory queue's pick):
        prompt (+ its LoRA adapter's root) -> its block hashes (as the engine hashes them)
        -> leading blocks each worker holds -> best first

Consistency. Batches carry sequence numbers from 0. A gap (a batch the SUB socket dropped, e.g. at
its high-water mark) is filled from the worker's replay socket when it advertises one; what the
replay no longer holds, or a worker without one, clears that worker's index (it fills again as
blocks are stored: an under-estimate, never a block it does not hold for long). A sequence that
starts again at 0, or a new instance id or endpoint at the worker's URL (a restart), starts from
an empty index, and so does `AllBlocksCleared`. A subscription joining late replays from 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from pdserve.disagg.control import WorkerInfo
from pdserve.disagg.router.pool import Worker
from pdserve.engine.kv_cache_manager import prompt_prefix_digests
from pdserve.engine.kv_event_wire import KVEventWireError, decode_batch
from pdserve.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, external_block_hash
from pdserve.engine.lora_manager import LoRAInfo, hash_root

if TYPE_CHECKING:
    import zmq.asyncio

logger = logging.getLogger(__name__)
_REPLAY_TIMEOUT_S = 2.0
_WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]", "")


def prompt_block_hashes(prompt_token_ids: Sequence[int], block_size: int, root: bytes = b"") -> list[int]:
    """The event hashes of the prompt's blocks a worker could serve from its cache: every full block
    but one holding the prompt's last token (the engine always computes that one; kv_cache_manager.py
    `find_cached_prefix`), chained as the engine chains them from `root` (b"": the base model; a LoRA
    adapter's: `lora_root`)."""
    return [external_block_hash(digest) for digest in prompt_prefix_digests(root, prompt_token_ids, block_size)]


def base_root(lora_name: str | None) -> bytes:
    """Every prompt hashed as the base model's (a router that knows no adapters)."""
    return b""


def lora_root(lora_name: str | None, info: LoRAInfo | None) -> bytes:
    """The hash root of a prompt under adapter `lora_name` as the workers chain it (lora_manager.py
    `hash_root`: the adapter's name and weights' digest), from what the router knows of the adapter
    (`info`: its workers' GET /v1/lora_adapters). An adapter the router has no digest for yet gets a
    root with an empty digest, which matches no worker's blocks (rather than the base model's)."""
    if lora_name is None:
        return b""
    return hash_root(info if info is not None and info.name == lora_name else LoRAInfo(lora_name, "", "", 0))


def reachable_endpoint(endpoint: str, worker_url: str) -> str:
    """A worker's advertised ZMQ address with a wildcard host replaced by the host the router reaches
    the worker's URL at (tcp://0.0.0.0:5557 on http://10.0.0.7:8000 -> tcp://10.0.0.7:5557)."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    if host not in _WILDCARD_HOSTS:
        return endpoint
    worker_host = urlsplit(worker_url).hostname or "127.0.0.1"
    return f"tcp://[{worker_host}]:{port}" if ":" in worker_host else f"tcp://{worker_host}:{port}"


class KVBlockIndex:
    """The block hashes one worker's prefix cache holds, as its events said."""

    def __init__(self) -> None:
        self.hashes: set[int] = set()
        self.block_size: int | None = None  # from its BlockStored events

    def apply(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.hashes.update(event.block_hashes)
                self.block_size = event.block_size
            elif isinstance(event, BlockRemoved):
                self.hashes.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.hashes.clear()

    def clear(self) -> None:
        self.hashes.clear()

    def num_prefix_blocks(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of these (a prompt's, chained) it holds."""
        for count, value in enumerate(hashes):
            if value not in self.hashes:
                return count
        return len(hashes)


@dataclass(frozen=True, slots=True)
class EventSource:
    """Where one worker's events come from (what its /pd/info advertised, made reachable)."""

    publish: str
    replay: str | None
    topic: str


@dataclass(slots=True)
class SubscriptionStats:
    num_batches: int = 0
    num_replayed: int = 0  # batches a gap was filled with
    num_resets: int = 0  # times the index was dropped: a gap replay could not fill, a restart
    # the same, by reason (RESET_REASONS); the router's pdserve:kv_events_index_resets_total
    resets: Counter[str] = field(default_factory=Counter)


# why a worker's index was dropped: batches missed and not replayed, its sequence starting again at
# 0 (a restart), a batch that does not decode, a new instance id or endpoint at its URL (KVEventsView)
RESET_REASONS = ("gap", "restart", "bad_batch", "worker_changed")


class KVEventSubscription:
    """One worker's event stream into its `KVBlockIndex`: a task on the router's event loop over a
    SUB socket (and a DEALER to its replay socket when it has one). `close` ends it."""

    def __init__(self, context: zmq.asyncio.Context, source: EventSource, name: str,
                 stats: SubscriptionStats | None = None) -> None:
        import zmq

        self.source = source
        self.name = name
        self.index = KVBlockIndex()
        self.stats = SubscriptionStats() if stats is None else stats  # NOTE: a view's, shared by its subscriptions
        self._context = context
        self._next_seq: int | None = None  # None: nothing received yet
        self._sub = context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
        self._sub.connect(source.publish)
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"kv-events {name}")

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._sub.close(linger=0)

    async def _run(self) -> None:
        while True:
            topic, seq_bytes, payload = await self._sub.recv_multipart()
            try:
                batch = decode_batch(payload)
            except KVEventWireError as exc:
                logger.warning("KV events from %s: a batch that does not decode (%s); its index is dropped",
                               self.name, exc)
                self._reset("bad_batch")
                continue
            await self.receive(int.from_bytes(seq_bytes, "big"), batch)

    async def receive(self, seq: int, batch: KVEventBatch) -> None:
        """Apply a live batch, filling a gap before it (or starting over) as the module says."""
        expected = self._next_seq
        if expected is not None and seq < expected:
            if seq != 0:
                return  # already applied (a replay overlapped the live stream)
            logger.info("KV events from %s start again at 0: the worker restarted; its index is dropped", self.name)
            self._reset("restart")
            expected = 0
        start = 0 if expected is None else expected
        if seq > start:
            await self._fill(start, seq)
        self.index.apply(batch)
        self.stats.num_batches += 1
        self._next_seq = seq + 1

    async def _fill(self, start: int, end: int) -> None:
        """Batches start..end-1 from the replay socket; without them, an emptied index."""
        replayed = await self._replay(start, end) if self.source.replay is not None else None
        if replayed is None or [seq for seq, _ in replayed] != list(range(start, end)):
            if self._next_seq is not None:  # NOTE: a late joiner's missing start is no news
                logger.warning("KV events from %s: batches %d..%d missed and not replayed; its index is dropped",
                               self.name, start, end - 1)
                self._reset("gap")
            else:
                self.index.clear()
            for _, batch in replayed or []:  # what there is still helps, after the reset
                self.index.apply(batch)
            return
        for _, batch in replayed:
            self.index.apply(batch)
        self.stats.num_replayed += len(replayed)

    async def _replay(self, start: int, end: int) -> list[tuple[int, KVEventBatch]] | None:
        import zmq

        assert self.source.replay is not None
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.source.replay)
        replayed: list[tuple[int, KVEventBatch]] = []
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                _, seq_bytes, payload = await asyncio.wait_for(dealer.recv_multipart(), _REPLAY_TIMEOUT_S)
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq < 0:
                    return replayed
                if seq < end:
                    replayed.append((seq, decode_batch(payload)))
        except (TimeoutError, KVEventWireError, ValueError) as exc:
            logger.warning("KV events from %s: replay failed (%r)", self.name, exc)
            return None
        finally:
            dealer.close(linger=0)

    def _reset(self, reason: str) -> None:
        self.index.clear()
        self.stats.num_resets += 1
        self.stats.resets[reason] += 1


def source_of(info: WorkerInfo | None, worker_url: str) -> EventSource | None:
    """A worker's event source from its WorkerInfo (None: it publishes none to subscribe to)."""
    if info is None or not info.kv_events_endpoint:
        return None
    replay = info.kv_events_replay_endpoint
    return EventSource(reachable_endpoint(info.kv_events_endpoint, worker_url),
                       None if not replay else reachable_endpoint(replay, worker_url), info.kv_events_topic)


class KVEventsView:
    """The indexes of one role's workers (decode for the kv-events decode policy, prefill for
    --prefill-policy kv-events): a subscription per worker advertising an event endpoint, kept by
    `observe` as the pool changes. Contract: the router's event loop only; `close` when it stops."""

    def __init__(self) -> None:
        import zmq.asyncio  # NOTE: only a router following events loads pyzmq

        self._context = zmq.asyncio.Context()
        self._subscriptions: dict[str, tuple[tuple[str, EventSource], KVEventSubscription]] = {}
        self._closing: set[asyncio.Task[None]] = set()  # subscriptions of workers gone, closing
        self.stats = SubscriptionStats()  # all its subscriptions', past ones' too

    def observe(self, workers: list[Worker]) -> None:
        """The role's workers after a poll of the pool, ready or not: whom to subscribe to."""
        listed = {w.url for w in workers}
        for url in [u for u in self._subscriptions if u not in listed]:
            self._drop(url)
        for worker in workers:
            if worker.info is None:
                continue  # NOTE: unreachable now: its subscription stays (ZMQ reconnects), a restart shows in its info
            source = source_of(worker.info, worker.url)
            key = None if source is None else (worker.info.instance_id, source)
            held = self._subscriptions.get(worker.url)
            if held is not None and held[0] == key:
                continue
            if held is not None:
                logger.info("KV events: %s changed (restarted, or a new endpoint); its index starts over", worker.url)
                self._drop(worker.url)
                self.stats.num_resets += 1
                self.stats.resets["worker_changed"] += 1
            if source is not None and key is not None:
                subscription = KVEventSubscription(self._context, source, worker.url, self.stats)
                self._subscriptions[worker.url] = (key, subscription)
                logger.info("KV events: following %s at %s", worker.url, source.publish)

    def _drop(self, url: str) -> None:
        _, subscription = self._subscriptions.pop(url)
        task = asyncio.get_running_loop().create_task(subscription.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def index(self, url: str) -> KVBlockIndex | None:
        held = self._subscriptions.get(url)
        return None if held is None else held[1].index

    def block_size(self, worker: Worker) -> int:
        """Its KV layout's block size, else its events' (0: not known yet)."""
        index = self.index(worker.url)
        from_info = int(worker.info.kv_layout.get("block_size", 0)) if worker.info is not None else 0
        return from_info or (index.block_size if index is not None and index.block_size else 0)

    def num_prefix_blocks(self, worker: Worker, prompt_token_ids: list[int], root: bytes,
                          hashes_by_size: dict[int, list[int]]) -> int:
        """Leading blocks of the prompt (chained from `root`) `worker` caches; 0 for one that
        publishes no events. `hashes_by_size` memoizes the prompt's hashes per block size."""
        index, block_size = self.index(worker.url), self.block_size(worker)
        if index is None or worker.info is None or not block_size:
            return 0
        if block_size not in hashes_by_size:
            hashes_by_size[block_size] = prompt_block_hashes(prompt_token_ids, block_size, root)
        return index.num_prefix_blocks(hashes_by_size[block_size])

    def num_cached_tokens(self, workers: list[Worker], prompt_token_ids: list[int],
                          root: bytes = b"") -> dict[str, int]:
        """URL -> prompt tokens each worker caches, as its events say (the memory queue's pick)."""
        hashes: dict[int, list[int]] = {}
        return {w.url: self.num_prefix_blocks(w, prompt_token_ids, root, hashes) * self.block_size(w)
                for w in workers}

    def num_cached(self, worker: Worker) -> int:
        """Blocks `worker` caches in all."""
        index = self.index(worker.url)
        return 0 if index is None else len(index.hashes)

    async def close(self) -> None:
        for url in list(self._subscriptions):
            _, subscription = self._subscriptions.pop(url)
            await subscription.close()
        self._context.destroy(linger=0)
