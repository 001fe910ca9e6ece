"""The in-memory prefill queue (the embedded default): a FIFO in the router, pushed to the prefill
workers of its pool (POST /pd/prefill, answered once the hand-off ended).

A worker takes a job when it holds none, or when the job fits into its `max_num_batched_tokens`
beside what it holds. Jobs are taken in order, but a job that fits nowhere yet does not hold back
smaller ones behind it. A job put with `prefix_affinity` (a request resumed after a decode loss,
or every job with `--prefill-policy prefix-affinity`) goes to the worker, among those it fits, whose
prefix cache (pool or disk tier) holds the longest part of its prompt (POST /pd/prefix, asked once
when the job is put, only when more than one prefill worker is ready, each answer bounded by
`_PREFIX_QUERY_TIMEOUT_S`; no answer counts as nothing cached); ties, and jobs without it, go to the
least loaded. A job put with `cached_tokens` (--prefill-policy kv-events: what the prefill workers'
events say they cache) is placed the same way from those, with no call. A job's listener hears its
first token as soon as the worker sampled it (the POST's answer then streams it, before the
hand-off's end), and its hand-off or refusal. A worker lost (or draining) with a job: the job is
queued again at the front as a new attempt, the decode worker told first; one that answered 503
(draining) gets no new job from then on (`Worker.mark_draining`); a worker whose answer was cut
short (it may still run the attempt, holding its blocks until its placement or transfer timeout) is
told to abort it, best effort. A worker that refuses a job for good: the listener hears the refusal
(for the client), then the decode worker ends the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections import deque
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from pdserve.disagg.auth import sign_job, sign_placement
from pdserve.disagg.client import WorkerClient, WorkerError, WorkerRefused
from pdserve.disagg.config import QueueArgs
from pdserve.disagg.control import Placement, PrefillJob
from pdserve.disagg.queue.base import (
    AttemptListener,
    PlacesLater,
    PrefillQueue,
    PrefillTicket,
    QueueStats,
    Refusal,
    next_attempt,
)
from pdserve.disagg.router.pool import Worker, WorkerPool, reach
from pdserve.logs import bind_request_id

logger = logging.getLogger(__name__)
# NOTE: the query delays only the job it is for; a prefill worker slower than this to say what it
# caches is treated as caching nothing (the job still goes somewhere at once)
_PREFIX_QUERY_TIMEOUT_S = 0.5
_ABORT_TIMEOUT_S = 5.0  # the abort of an attempt whose answer was cut (`_abort_cut`)


@dataclass(slots=True, eq=False)
class _Dispatch(PrefillTicket):
    """A ticket of this queue, from `put` to hand-off."""

    listener: AttemptListener | None = None  # hears its first token, hand-off, refusal
    done: bool = False  # handed off, refused, or cancelled: nothing more to do for it
    worker: Worker | None = None  # where it is being computed
    # the push under way: its worker took the job (its answer started), or the push ended
    accepted: asyncio.Event = field(default_factory=asyncio.Event)
    pushed_placed: bool = False  # the job of the push under way named its reservation already
    charged_tokens: int = 0  # what the push under way added to its worker's `in_flight_tokens`
    cancelled: bool = False
    cached_tokens: dict[str, int] = field(default_factory=dict)  # prefill URL -> prompt tokens it caches

    @property
    def num_tokens(self) -> int:
        """Prompt tokens the prefill worker computes (what its token budget is charged)."""
        return len(self.job.prompt_token_ids) - self.job.num_cached_tokens


class MemoryPrefillQueue(PrefillQueue):
    """See the module docstring. Needs the router's pool (whom to push to) and a client."""

    def __init__(self, pool: WorkerPool, client: WorkerClient) -> None:
        self._pool = pool
        self._client = client
        self._pending: deque[_Dispatch] = deque()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._running: set[asyncio.Task[None]] = set()
        self._num_redispatched = 0

    @property
    def ready(self) -> bool:
        return self._pool.any_ready("prefill")

    @property
    def expected_back(self) -> bool:
        return self._pool.expected_back("prefill")

    @property
    def error(self) -> str:
        return ""

    def stats(self) -> QueueStats:
        return QueueStats("memory", len(self._pending), len(self._pending), 0, self._num_redispatched, "")

    def places_later(self) -> PlacesLater:
        return self

    async def put(self, job: PrefillJob, *, prefix_affinity: bool = False,
                  cached_tokens: Mapping[str, int] | None = None,
                  listener: AttemptListener | None = None) -> PrefillTicket:
        if self._task is None:
            # NOTE: in a fresh context: a task copies its creator's, and this one serves every
            # request (its log lines must not carry the first request's id)
            self._task = contextvars.Context().run(asyncio.create_task, self._loop())
        item = _Dispatch(job, listener=listener)
        if cached_tokens is not None:
            item.cached_tokens = dict(cached_tokens)
        elif prefix_affinity:
            item.cached_tokens = await self._cached_tokens(job.prompt_token_ids)
        self._pending.append(item)
        self._place()  # NOTE: at once: the job leaves in this turn of the loop, not the loop task's next one
        return item

    async def place(self, ticket: PrefillTicket, placement: Placement) -> bool:
        if not isinstance(ticket, _Dispatch):
            raise TypeError("not a ticket of this queue")
        if ticket.done or ticket.cancelled:
            return False
        # NOTE: the job carries it from now on: a re-dispatch (its worker lost) goes out placed
        ticket.job = sign_job(self._client.secret, ticket.job.with_placement(placement))
        worker = ticket.worker
        if worker is None:  # still here: it leaves placed
            return True
        await ticket.accepted.wait()  # NOTE: the worker must know the attempt before it hears where it goes
        if ticket.done or ticket.cancelled:
            return False
        if ticket.worker is not worker or ticket.pushed_placed:
            return True  # re-queued meanwhile: it goes (went) out placed
        placed = placement.model_copy(update={"transfer_id": ticket.job.transfer_id})
        if await reach(worker, self._client.place(worker.url, sign_placement(self._client.secret, placed))):
            return True
        # NOTE: the worker is gone, or no longer runs the attempt: a re-dispatch goes out placed
        return not ticket.done and not ticket.cancelled

    async def refresh(self) -> None:
        self._wakeup.set()

    async def cancel(self, ticket: PrefillTicket) -> None:
        if not isinstance(ticket, _Dispatch):
            raise TypeError("not a ticket of this queue")
        ticket.cancelled = True
        if ticket in self._pending:
            self._pending.remove(ticket)
            ticket.done = True
        elif ticket.worker is not None and not ticket.done:
            await reach(ticket.worker, self._client.abort(ticket.worker.url, ticket.job.transfer_id))

    async def close(self) -> None:
        for task in [self._task, *self._running]:
            if task is not None:
                task.cancel()

    async def _loop(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            self._place()

    def _place(self) -> None:
        """Push every pending job, in order, that fits a ready worker now."""
        for item in list(self._pending):
            worker = self._pick(item)
            if worker is None:
                continue
            self._pending.remove(item)
            item.worker = worker
            item.trace.mark_left_router()
            worker.in_flight += 1
            # NOTE: what is added is taken off again, though a placement may change `num_tokens` meanwhile
            item.charged_tokens = item.num_tokens
            worker.in_flight_tokens += item.charged_tokens
            self._spawn(self._push(item, worker))

    async def _cached_tokens(self, prompt_token_ids: list[int]) -> dict[str, int]:
        """Prompt tokens each ready prefill worker caches (none asked when fewer than two are ready)."""
        workers = self._pool.ready("prefill")
        if len(workers) < 2:
            return {}
        answers = await asyncio.gather(*(self._ask_prefix(w, prompt_token_ids) for w in workers))
        return {w.url: n for w, n in zip(workers, answers, strict=True)}

    async def _ask_prefix(self, worker: Worker, prompt_token_ids: list[int]) -> int:
        try:
            cached = await asyncio.wait_for(reach(worker, self._client.prefix(worker.url, prompt_token_ids)),
                                            _PREFIX_QUERY_TIMEOUT_S)
        except (TimeoutError, WorkerError):
            return 0
        return cached or 0

    def _pick(self, item: _Dispatch) -> Worker | None:
        """Among the ready workers the job fits: the one caching most of its prompt, then the least loaded."""
        num_tokens = item.num_tokens
        fits = [w for w in self._pool.ready("prefill") if w.in_flight_tokens == 0 or
                w.in_flight_tokens + num_tokens <= max(w.info.max_num_batched_tokens if w.info else 0, 1)]
        return min(fits, key=lambda w: (-item.cached_tokens.get(w.url, 0), w.in_flight_tokens, w.in_flight),
                   default=None)

    async def _push(self, item: _Dispatch, worker: Worker) -> None:
        bind_request_id(item.job.request_id)
        try:
            requeue = await self._send(item, worker)
        finally:
            worker.in_flight -= 1
            worker.in_flight_tokens -= item.charged_tokens
            self._wakeup.set()
        retry = next_attempt(item.job)
        if requeue and await self._retarget(item.job, retry):
            self._num_redispatched += 1
            item.job, item.worker = retry, None
            self._pending.appendleft(item)
            self._wakeup.set()
            return
        item.done = True

    async def _send(self, item: _Dispatch, worker: Worker) -> bool:
        """The job on `worker`; True when it must go to another one (this one is gone, with
        whatever KV it computed, or draining) and the request is still on."""
        item.accepted.clear()
        item.pushed_placed = item.job.placed
        try:
            listener = item.listener
            on_first_token = listener.first_token if listener is not None and listener.wants_first_token else None
            hand_off = await reach(worker, self._client.prefill(worker.url, item.job, on_first_token,
                                                                None if item.job.placed else item.accepted.set))
        except WorkerRefused as exc:
            if exc.status >= HTTPStatus.INTERNAL_SERVER_ERROR:
                # NOTE: the worker's failure, not the job's (its engine died under it): elsewhere, as
                # for a worker lost
                logger.warning("request %s: prefill failed the job (%d): %s; sending it elsewhere",
                               item.job.request_id, exc.status, exc.message)
                return not item.cancelled
            logger.warning("request %s: prefill refused the job: %s", item.job.request_id, exc.message)
            if item.listener is not None:
                item.listener.refused(Refusal(exc.status, exc.message))
            await self._fail(item.job, f"prefill refused the job: {exc.message}")
            return False
        finally:
            item.accepted.set()  # NOTE: a placement waiting for this push looks again
        if hand_off is None and worker.info is not None:  # NOTE: it answered 503: draining, the job not taken
            # NOTE: out of new work now: until its next poll it would be picked again at once, for as
            # long as it keeps answering (one job sent five times in 20 ms on `up`'s Ctrl-C)
            worker.mark_draining()
            return not item.cancelled
        if hand_off is None:  # NOTE: unreachable, or its answer cut short: it may still run the attempt
            self._abort_cut(worker, item.job)
            return not item.cancelled
        if hand_off.status == "handed_off" and item.listener is not None:
            item.listener.handed_off(hand_off.prefill_cached_tokens)
        if hand_off.status == "failed" and not item.cancelled:
            logger.warning("request %s: hand-off failed: %s", item.job.request_id, hand_off.reason)
            await self._fail(item.job, f"prefill failed: {hand_off.reason}")
        if hand_off.status == "timed_out" and not item.cancelled:
            await self._report_ended(item.job)
        return False

    def _abort_cut(self, worker: Worker, job: PrefillJob) -> None:
        """The job's answer was cut short (or never came): the worker may still run the attempt, which
        holds its blocks there until it ends by itself; abort it, in the background (the re-dispatch
        does not wait for a worker that may be gone), best effort."""
        async def abort() -> None:
            with contextlib.suppress(WorkerError, TimeoutError):
                await asyncio.wait_for(self._client.abort(worker.url, job.transfer_id), _ABORT_TIMEOUT_S)

        self._spawn(abort())

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """`work` as a task of this queue (cancelled by `close`).
        NOTE: in a fresh context, as the loop task's own pushes (put runs in a request's task)."""
        task = contextvars.Context().run(asyncio.create_task, work)
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _retarget(self, old: PrefillJob, new: PrefillJob) -> bool:
        """Tell the decode worker to expect `new` instead of `old`; False if it no longer waits."""
        decode = self._pool.find("decode", old.decode_url)
        return decode is not None and bool(
            await reach(decode, self._client.retarget(decode.url, old.request_id, new.transfer_id,
                                                      replaces=old.transfer_id)))

    async def _report_ended(self, job: PrefillJob) -> None:
        """The attempt timed out on its prefill worker, which tells decode itself, but only if it
        heard of the placement: one that reached this queue while the attempt was ending (prefill
        answered it 404) left decode waiting for KV that never comes, until its lease. Decode counts
        the report once, from whoever sends it first, and asks for a new attempt."""
        decode = self._pool.find("decode", job.decode_url) if job.decode_url else None
        if decode is not None:
            await reach(decode, self._client.alive(decode.url, [], ended=[job.transfer_id]))

    async def _fail(self, job: PrefillJob, reason: str) -> None:
        """End the request on its decode worker now, if it still waits for this attempt."""
        decode = self._pool.find("decode", job.decode_url)
        if decode is not None:
            await reach(decode, self._client.fail(decode.url, job.request_id, reason, job.transfer_id))


def make_queue(args: QueueArgs, pool: WorkerPool, client: WorkerClient) -> PrefillQueue:
    """The router's queue: its own FIFO pushed to `pool`'s prefill workers through `client`
    ('memory'), or a Redis Streams queue shared with other routers (`redis://host:port/db`)."""
    args.validate()
    if args.queue == "memory":
        return MemoryPrefillQueue(pool, client)
    # NOTE: imported here: a router on the memory queue never needs redis.
    from pdserve.disagg.queue.redis_streams import RedisPrefillQueue

    return RedisPrefillQueue(args.queue, args.queue_deployment, starting=lambda: pool.starting)
