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
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

from pdserve.disagg.control import FirstToken, Placement, PrefillJob
from pdserve.disagg.request_ids import attempt_of, transfer_id
from pdserve.serving.trace import RequestTrace, current_trace


class QueueUnavailable(RuntimeError):
    """The queue's backing store cannot be reached (the router answers 503)."""


def next_attempt(job: PrefillJob) -> PrefillJob:
    """The same job as a new attempt (new transfer id), for a re-delivery or a retry."""
    return job.model_copy(update={"transfer_id": transfer_id(job.request_id, attempt_of(job.transfer_id) + 1)})


@dataclass(frozen=True, slots=True)
class Refusal:
    """A prefill worker refused a job for good (bad job, KV layout mismatch): the client gets
    this status and message rather than the decode worker's generic error."""

    status: int
    message: str


@dataclass(slots=True, eq=False)  # NOTE: compared by identity: a queue finds its own tickets
class PrefillTicket:
    """One prefill attempt put on a queue, as the router that put it follows it."""

    job: PrefillJob  # a queue that re-queues the job (its worker was lost) swaps in the new attempt
    trace: RequestTrace = field(default_factory=current_trace)  # the request's TTFT phases (metrics)


class AttemptListener(Protocol):
    """What the router hears of an attempt from a queue that pushes its jobs to prefill workers
    and so sees their answers (memory). A shared queue's consumers report to the stream, not to a
    router: such a queue calls none of these, and the request learns the same from its decode stream."""

    @property
    def wants_first_token(self) -> bool:
        """Whether `first_token` is worth the prefill worker's streamed answer."""

    def first_token(self, first: FirstToken) -> None:
        """The prefill worker sampled the job's first token (before the hand-off ended)."""

    def handed_off(self, prefill_cached_tokens: int) -> None:
        """The hand-off ended; `prefill_cached_tokens`: prompt tokens prefill took from its cache."""

    def refused(self, refusal: Refusal) -> None:
        """A prefill worker refused the job for good; called before decode ends the request."""


class PlacesLater(Protocol):
    """The capability of a queue that takes a job before its decode reservation is made, so that
    prefill computes while decode reserves (`PrefillQueue.places_later`)."""

    async def place(self, ticket: PrefillTicket, placement: Placement) -> bool:
        """The decode reservation of a job put without one. False: the attempt is not running any
        more (cancelled, or its worker lost it: then it is queued again with this placement);
        raises WorkerRefused when the prefill worker cannot use it."""


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
    decode worker (the job names that reservation; or at once, and `PlacesLater.place` when the
    reservation is made, where the queue `places_later`), and keeps the ticket; `cancel` when the
    attempt is superseded (a stalled transfer is retried) or the request ends early; `refresh`
    after each poll of its worker pool (every 0.5 s), and reads `ready`/`error` to admit requests.
    The ticket's trace is marked when the job leaves this router (`mark_left_router`).

    Failures: `put` raises QueueUnavailable when the backing store cannot be reached (the router
    answers 503); everything else is best effort and never raises. A job the prefill side gives
    up on is ended on its decode worker (POST /pd/fail), which ends the request's stream with an
    error; when the client must see the prefill worker's own status instead, the queue tells the
    attempt's listener (`refused`) before that.
    """

    @abc.abstractmethod
    async def put(self, job: PrefillJob, *, prefix_affinity: bool = False,
                  cached_tokens: Mapping[str, int] | None = None,
                  listener: AttemptListener | None = None) -> PrefillTicket:
        """Queue one attempt; raises QueueUnavailable. `prefix_affinity`: prefer the prefill worker
        whose prefix cache (pool, disk tier) holds the longest part of the prompt (memory queue; a
        shared queue's workers pull jobs, so it does not apply there). `cached_tokens`: what the
        router already knows each prefill worker caches of the prompt (URL -> tokens, from their KV
        events): the memory queue picks by it as by `prefix_affinity`, without asking. `listener`: hears what this
        queue learns of the attempt, if it learns anything (AttemptListener)."""

    def places_later(self) -> PlacesLater | None:
        """How to place a job put before its decode reservation was made, where this queue can
        (the router asks once); None: every job is put placed."""
        return None

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
    def expected_back(self) -> bool:
        """No prefill worker can take jobs now, but one could before and is expected back."""
        return False

    @property
    @abc.abstractmethod
    def error(self) -> str:
        """Why the queue is unreachable; "" when it is fine."""

    @abc.abstractmethod
    def stats(self) -> QueueStats: ...

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop; jobs not handed off yet are dropped (their requests end with the router)."""
