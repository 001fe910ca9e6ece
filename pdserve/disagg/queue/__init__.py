"""The prefill job queue between routers and prefill workers (see base.py for the contract).

Its two implementations: the router's own FIFO, pushed to its prefill workers
(router/memory_queue.py), and Redis Streams shared by routers (redis_streams.py; the prefill
worker's consumer is worker/queue_consumer.py). The router picks one (router/memory_queue.py's
`make_queue`).
"""

from __future__ import annotations

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

__all__ = ["AttemptListener", "PlacesLater", "PrefillQueue", "PrefillTicket", "QueueStats",
           "QueueUnavailable", "Refusal", "next_attempt"]
