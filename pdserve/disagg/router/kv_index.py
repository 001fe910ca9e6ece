"""The router's view of its workers' prefix caches, kept from their KV-cache events (vLLM's format,
engine/kv_event_wire.py) instead of asked per request.

    worker's engine --PUB [topic, seq, batch]--> KVEventSubscription (a task on the router's loop)
                                                   -> KVBlockIndex of that worker: the hashes it caches
    DecodePolicy "kv-events" (policy.py): prompt -> its block hashes (as the engine hashes them)
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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from pdserve.disagg.control import WorkerInfo
from pdserve.engine.kv_cache_manager import prompt_prefix_digests
from pdserve.engine.kv_event_wire import KVEventWireError, decode_batch
from pdserve.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, external_block_hash

if TYPE_CHECKING:
    import zmq.asyncio

logger = logging.getLogger(__name__)
_REPLAY_TIMEOUT_S = 2.0
_WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]", "")


def prompt_block_hashes(prompt_token_ids: Sequence[int], block_size: int) -> list[int]:
    """The event hashes of the prompt's blocks a worker could serve from its cache: every full block
    but one holding the prompt's last token (the engine always computes that one; kv_cache_manager.py
    `find_cached_prefix`), chained as the engine chains them (base model: no adapter root)."""
    return [external_block_hash(digest) for digest in prompt_prefix_digests(b"", prompt_token_ids, block_size)]


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


class KVEventSubscription:
    """One worker's event stream into its `KVBlockIndex`: a task on the router's event loop over a
    SUB socket (and a DEALER to its replay socket when it has one). `close` ends it."""

    def __init__(self, context: zmq.asyncio.Context, source: EventSource, name: str) -> None:
        import zmq

        self.source = source
        self.name = name
        self.index = KVBlockIndex()
        self.stats = SubscriptionStats()
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
                self._reset()
                continue
            await self.receive(int.from_bytes(seq_bytes, "big"), batch)

    async def receive(self, seq: int, batch: KVEventBatch) -> None:
        """Apply a live batch, filling a gap before it (or starting over) as the module says."""
        expected = self._next_seq
        if expected is not None and seq < expected:
            if seq != 0:
                return  # already applied (a replay overlapped the live stream)
            logger.info("KV events from %s start again at 0: the worker restarted; its index is dropped", self.name)
            self._reset()
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
            self._reset()
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

    def _reset(self) -> None:
        self.index.clear()
        self.stats.num_resets += 1


def source_of(info: WorkerInfo | None, worker_url: str) -> EventSource | None:
    """A worker's event source from its WorkerInfo (None: it publishes none to subscribe to)."""
    if info is None or not info.kv_events_endpoint:
        return None
    replay = info.kv_events_replay_endpoint
    return EventSource(reachable_endpoint(info.kv_events_endpoint, worker_url),
                       None if not replay else reachable_endpoint(replay, worker_url), info.kv_events_topic)
