"""The prefill job queue between routers and prefill workers (see base.py for the contract)."""

from __future__ import annotations

from pdserve.disagg.client import WorkerClient
from pdserve.disagg.config import QueueArgs
from pdserve.disagg.pool import WorkerPool
from pdserve.disagg.queue.base import (
    AttemptListener,
    PlacesLater,
    PrefillQueue,
    PrefillTicket,
    QueueStats,
    QueueUnavailable,
    Refusal,
    next_attempt,
)
from pdserve.disagg.queue.memory import MemoryPrefillQueue

__all__ = ["AttemptListener", "MemoryPrefillQueue", "PlacesLater", "PrefillQueue", "PrefillTicket", "QueueStats",
           "QueueUnavailable", "Refusal", "make_queue", "next_attempt"]


def make_queue(args: QueueArgs, pool: WorkerPool, client: WorkerClient) -> PrefillQueue:
    """The router's queue: its own FIFO pushed to `pool`'s prefill workers through `client`
    ('memory'), or a Redis Streams queue shared with other routers (`redis://host:port/db`)."""
    args.validate()
    if args.queue == "memory":
        return MemoryPrefillQueue(pool, client)
    # NOTE: imported here: that module also holds the prefill workers' consumer (and imports their
    # service), which a router on the memory queue never needs.
    from pdserve.disagg.queue.redis_streams import RedisPrefillQueue

    return RedisPrefillQueue(args.queue, args.queue_deployment)
