"""Prefill job queue: how a request's prefill job gets from a router to a prefill worker.

Two implementations, chosen by `QueueArgs.queue` (`make_queue`):
- in memory (`memory.py`, the embedded default): the router keeps a FIFO and pushes each job to a
  prefill worker of its pool whose token budget has room (POST /pd/prefill, which answers once
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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from pdserve.disagg.control import FirstToken, Placement, PrefillJob, transfer_id
from pdserve.serving.trace import RequestTrace, current_trace


class QueueUnavailable(RuntimeError):
    """The queue's backing store cannot be reached (the router answers 503)."""


def next_attempt(job: PrefillJob) -> PrefillJob:
    """The same job as a new attempt (new transfer id), for a re-delivery or a retry."""
    attempt = int(job.transfer_id.rpartition("@")[2] or 0) + 1
    return job.model_copy(update={"transfer_id": transfer_id(job.request_id, attempt)})


@dataclass(frozen=True, slots=True)
class Refusal:
    """A prefill worker refused a job for good (bad job, KV layout mismatch): the client gets
    this status and message rather than the decode worker's generic error."""

    status: int
    message: str


@dataclass(slots=True, eq=False)  # NOTE: compared by identity: a queue finds its own tickets
class PrefillTicket:
    """One prefill attempt put on a queue, as the router that put it follows it."""

    job: PrefillJob  # the memory queue swaps in the new attempt when it re-queues the job
    trace: RequestTrace = field(default_factory=current_trace)  # the request's TTFT phases (metrics)
    refusal: Refusal | None = None  # set if a prefill worker refused the job (memory queue only)
    # called once (then cleared) with the hand-off's `prefill_cached_tokens` (prompt tokens prefill
    # took from its cache, not computed) when a prefill worker handed the job off (memory queue only:
    # a shared queue's consumers acknowledge to the stream, not to the router)
    on_handed_off: Callable[[int], None] | None = None
    # called with the job's first token as soon as the prefill worker sampled it, before the hand-off
    # ended (memory queue only; set before the first await after `put`: the push reads it)
    on_first_token: Callable[[FirstToken], None] | None = None


@dataclass(frozen=True, slots=True)
class QueueStats:
    kind: Literal["memory", "redis"]
    num_pending: int  # jobs waiting in this router (memory); 0 for a shared queue
    num_backlog: int  # jobs no prefill worker has taken yet: `num_pending` (memory), the group's lag (Redis; shared)
    num_live_consumers: int  # prefill workers pulling from a shared queue; 0 for memory
    num_redispatched: int  # jobs re-queued by this router after their prefill worker was lost or drained
    error: str  # why the queue is unreachable; "" when it is fine


class PrefillQueue(abc.ABC):
    """Router side of the prefill queue. One per router, used from its event loop only.

    The router calls `put` once per prefill attempt, after reserving the prompt's blocks on a
    decode worker (the job names that reservation; or at once, and `place` when the reservation
    is made, where the queue `places_later`), and keeps the ticket; `cancel` when the
    attempt is superseded (a stalled transfer is retried) or the request ends early; `refresh`
    after each poll of its worker pool (every 0.5 s), and reads `ready`/`error` to admit requests.
    The ticket's trace is marked when the job leaves this router (`mark_left_router`).

    Failures: `put` raises QueueUnavailable when the backing store cannot be reached (the router
    answers 503); everything else is best effort and never raises. A job the prefill side gives
    up on is ended on its decode worker (POST /pd/fail), which ends the request's stream with an
    error; when the client must see the prefill worker's own status instead, the queue sets
    `ticket.refusal` before that.
    """

    @abc.abstractmethod
    async def put(self, job: PrefillJob, prefix_affinity: bool = False) -> PrefillTicket:
        """Queue one attempt; raises QueueUnavailable. `prefix_affinity`: prefer the prefill worker
        whose prefix cache (pool, disk tier) holds the longest part of the prompt (memory queue; a
        shared queue's workers pull jobs, so it does not apply there)."""

    # NOTE: whether `put` takes a job not placed yet (no decode reservation), `place` naming it later
    places_later = False

    async def place(self, ticket: PrefillTicket, placement: Placement) -> bool:
        """The decode reservation of a job put unplaced (`places_later` queues only). False: the
        attempt is not running any more (cancelled, or its worker lost it: then it is queued again
        with this placement); raises WorkerRefused when the prefill worker cannot use it."""
        raise NotImplementedError

    @abc.abstractmethod
    async def cancel(self, ticket: PrefillTicket) -> None:
        """Drop this attempt: not started, it is skipped without compute; started, it is aborted
        where it runs (memory) or left to finish and be rejected by decode (Redis)."""

    @abc.abstractmethod
    async def refresh(self) -> None:
        """The pool was just polled: take another look (jobs that fit nowhere before, the count of
        live consumers, whether the store is back)."""

    @property
    @abc.abstractmethod
    def ready(self) -> bool:
        """Some prefill worker can take jobs now (as of the last `refresh`)."""

    @property
    @abc.abstractmethod
    def error(self) -> str:
        """Why the queue is unreachable; "" when it is fine."""

    @abc.abstractmethod
    def stats(self) -> QueueStats: ...

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop; jobs not handed off yet are dropped (their requests end with the router)."""
