"""Prefill job queue: how a request's prefill job gets from a router to a prefill worker.

Two implementations:
- in memory (the embedded default, `router.MemoryDispatcher`): the router keeps a FIFO and pushes
  each job to a prefill worker whose token budget has room (POST /pd/prefill, which answers once
  the hand-off ended). One router.
- Redis Streams (`--queue redis://host:port/db`, `redis_streams.py`): routers XADD jobs to one
  stream; every prefill worker is a consumer of one consumer group and pulls only what its token
  budget can take. Several routers and any number of prefill workers share it.

Either way a job is acknowledged only after its KV hand-off ended, a job whose worker died is
prefilled again from scratch as a new attempt (the KV died with the worker; the decode worker is
told to expect the new attempt first: POST /pd/retarget), and an aborted request is skipped
without compute.
"""

from __future__ import annotations

import abc

from pdserve.disagg.control import PrefillJob, transfer_id


class QueueUnavailable(RuntimeError):
    """The queue's backing store cannot be reached (the router answers 503)."""


def next_attempt(job: PrefillJob) -> PrefillJob:
    """The same job as a new attempt (new transfer id), for a re-delivery or a retry."""
    attempt = int(job.transfer_id.rpartition("@")[2] or 0) + 1
    return job.model_copy(update={"transfer_id": transfer_id(job.request_id, attempt)})


class PrefillQueue(abc.ABC):
    """Router side of a shared queue (Redis). Consumers live in the prefill workers."""

    @abc.abstractmethod
    async def put(self, job: PrefillJob) -> None:
        """Enqueue; raises QueueUnavailable when the store is unreachable."""

    @abc.abstractmethod
    async def cancel(self, transfer_id: str) -> None:
        """The request was aborted: a consumer that has not started this attempt skips it."""

    @abc.abstractmethod
    async def num_live_consumers(self) -> int:
        """Prefill workers that pulled (or heartbeat) recently; raises QueueUnavailable."""

    @abc.abstractmethod
    async def close(self) -> None: ...
