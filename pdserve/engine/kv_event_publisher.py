"""Where an engine's KV-cache events go: `KVEventPublisher`, chosen by `--kv-events-config`'s
`publisher` ("zmq": `ZmqPublisher`, vLLM's ZMQ PUB + replay ROUTER; "null": `NullPublisher`).

    engine thread, after each step:  publish(events) -> a batch onto a bounded queue (never waits)
    publisher thread:                 batch -> sequence number, msgpack (kv_event_wire.py), PUB send,
                                      replay buffer; answers replay requests between batches

pyzmq is imported only when a ZMQ publisher is made: an engine with events off never loads it.
"""

from __future__ import annotations

import abc
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.kv_event_wire import END_SEQ, encode_batch
from pdserve.engine.kv_events import KVCacheEvent, KVEventBatch, KVEventLog, KVEventsConfig

if TYPE_CHECKING:
    import zmq

logger = logging.getLogger(__name__)
_POLL_S = 0.05  # how long the publisher thread waits for a batch before looking at replay requests
_START_TIMEOUT_S = 10.0
_CLOSE_TIMEOUT_S = 1.0


@dataclass(frozen=True, slots=True)
class KVEventEndpoints:
    """Where subscribers find a publisher: the addresses its sockets are bound to (a wildcard
    host, e.g. tcp://0.0.0.0:5557, means this machine's: a subscriber puts the host it reaches the
    worker at in its place). `publish` None: the publisher connects out to its consumer instead."""

    publish: str | None
    replay: str | None
    topic: str


class KVEventPublisher(abc.ABC):
    """Sends an engine's KV-cache events. `publish` is called by the engine's thread once per step
    that recorded any, and must return at once (no network, no lock a sender holds); the batches
    leave in the order given. `close` (the engine's `close`) stops it; nothing is sent after."""

    endpoints: KVEventEndpoints | None = None  # None: nothing to subscribe to
    num_dropped_batches = 0  # batches dropped because the queue to the publisher thread was full

    @abc.abstractmethod
    def publish(self, events: list[KVCacheEvent]) -> None: ...

    @abc.abstractmethod
    def close(self) -> None: ...


class NullPublisher(KVEventPublisher):
    """Events recorded (`enable_kv_cache_events`) but sent nowhere: vLLM's "null" publisher."""

    def publish(self, events: list[KVCacheEvent]) -> None:
        return

    def close(self) -> None:
        return


def binds(endpoint: str) -> bool:
    """vLLM's rule: an address with a wildcard host, or an ipc/inproc one, is bound; any other is
    connected to (a consumer that binds, e.g. one collector for many engines)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqPublisher(KVEventPublisher):
    """vLLM's ZmqEventPublisher: PUB of `[topic, seq, payload]` and, with `replay_endpoint`, a
    ROUTER that re-sends the last `buffer_steps` batches from a requested sequence number. The
    sockets live on the publisher thread only (ZMQ sockets are not thread-safe); the constructor
    returns once they are bound (OSError if they cannot be)."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        import zmq  # NOTE: here, not at the top: see the module docstring

        self._config = config
        self._rank = data_parallel_rank
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._context = zmq.Context()
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._dropped_logged = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="pdserve-kv-events", daemon=True)
        self._thread.start()
        if not self._started.wait(_START_TIMEOUT_S) or self._start_error is not None:
            self._context.destroy(linger=0)  # NOTE: closes a socket made before the bind failed (term would wait)
            raise OSError(f"KV events: cannot open {config.endpoint}: {self._start_error!r}")

    def publish(self, events: list[KVCacheEvent]) -> None:
        if self._closed:
            return
        try:
            self._queue.put_nowait(KVEventBatch(time.time(), tuple(events), self._rank))
        except queue.Full:
            # NOTE: the thread is not keeping up (or is stuck); the engine must not wait for it
            self.num_dropped_batches += 1
            if not self._dropped_logged:
                logger.warning("KV events: the publisher's queue is full (%d batches); dropping batches",
                               self._config.max_queue_size)
                self._dropped_logged = True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=_CLOSE_TIMEOUT_S)
        self._thread.join(_CLOSE_TIMEOUT_S)

    def _open(self) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes] | None]:
        import zmq

        config = self._config
        pub = self._context.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, config.hwm)
        pub.setsockopt(zmq.LINGER, 0)
        if binds(config.endpoint):
            pub.bind(config.endpoint)
            publish: str | None = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            pub.connect(config.endpoint)
            publish = None
        replay, replay_at = None, None
        if config.replay_endpoint is not None:
            replay = self._context.socket(zmq.ROUTER)
            replay.setsockopt(zmq.LINGER, 0)
            replay.bind(config.replay_endpoint)
            replay_at = replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self.endpoints = KVEventEndpoints(publish, replay_at, config.topic)
        return pub, replay

    def _run(self) -> None:
        try:
            pub, replay = self._open()
        except BaseException as exc:  # noqa: BLE001 - the constructor raises it
            self._start_error = exc
            self._started.set()
            return
        self._started.set()
        logger.info("KV events: publishing on %s (replay: %s, topic %r)", self._config.endpoint,
                    self._config.replay_endpoint, self._config.topic)
        sequence = itertools.count()
        try:
            while True:
                if replay is not None and replay.poll(0):
                    self._answer_replay(replay)
                try:
                    batch = self._queue.get(timeout=_POLL_S)
                except queue.Empty:
                    continue
                if batch is None:
                    return
                seq, payload = next(sequence), encode_batch(batch)
                pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
        except Exception:  # noqa: BLE001 - events stop; the engine carries on
            logger.exception("KV events: the publisher thread failed; no more events are sent")
        finally:
            pub.close()
            if replay is not None:
                replay.close()
            self._context.term()

    def _answer_replay(self, replay: zmq.Socket[bytes]) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("KV events: a replay request of %d frames (expected identity, empty, start seq)",
                           len(frames))
            return
        identity, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= start_seq:
                replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
        replay.send_multipart((identity, b"", END_SEQ, b""))


def make_publisher(config: KVEventsConfig) -> KVEventPublisher:
    """The publisher `config` names (events must be enabled)."""
    return ZmqPublisher(config) if config.publisher_name == "zmq" else NullPublisher()


def start_kv_events(config: KVEventsConfig | None, pool: BlockPool,
                    block_size: int) -> tuple[KVEventLog | None, KVEventPublisher | None]:
    """An engine's event log, hooked into its block pool, and its publisher; (None, None) when
    events are off (--kv-events-config absent or not enabled)."""
    if config is None or not config.enabled:
        return None, None
    log = pool.events = KVEventLog(block_size)
    return log, make_publisher(config)


def dropped_batches(publisher: KVEventPublisher | None) -> int:
    """Batches `publisher` dropped so far (its queue full); 0 without one (events off)."""
    return 0 if publisher is None else publisher.num_dropped_batches


def endpoints_info(publisher: KVEventPublisher | None) -> dict[str, Any] | None:
    """Its endpoints as plain JSON (what an engine process tells its API process)."""
    if publisher is None or publisher.endpoints is None:
        return None
    e = publisher.endpoints
    return {"publish": e.publish, "replay": e.replay, "topic": e.topic}


def endpoints_of(info: dict[str, Any] | None) -> KVEventEndpoints | None:
    """`endpoints_info`'s inverse (the API process's side)."""
    return None if info is None else KVEventEndpoints(info["publish"], info["replay"], info["topic"])
