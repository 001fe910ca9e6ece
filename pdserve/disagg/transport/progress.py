"""Cross-thread progress bookkeeping, awaitable from any event loop.

`EventBox` (receiver side) queues KVProgress/KVDone/KVRejected per request for `receiver.wait`;
`AckTracker` (sender side) counts what was sent and acknowledged per request for `sender.flush`.
Transport threads update them; callers await them on their own loop. Both hand results across
threads with `concurrent.futures.Future`, which any asyncio loop can wrap.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from pdserve.disagg.transport.cadence import FIRST_CONTACT_S, STEP_HALF_LIFE_S, Cadence
from pdserve.disagg.transport.errors import KVTransferError, KVTransferTimeout
from pdserve.disagg.transport.messages import KVDone, KVEvent, KVRejected

TIMEOUT_MESSAGE = "KV cache transfer timed out"
_LATE_KEPT = 256  # timed-out requests whose late acknowledgement still teaches the cadence


async def _await_future(fut: concurrent.futures.Future[Any], timeout_s: float) -> bool:
    """True when `fut` completed within `timeout_s`. A timeout leaves `fut` alone, so a result set
    at the same moment is not lost; a cancel of the awaiting task always raises CancelledError.
    NOTE: not `asyncio.wait_for`: before Python 3.12 it returns the result instead when the cancel
    comes just after `fut` completed. A decode watcher cancelled for a superseded attempt then went
    on with that attempt's KVDone while the new attempt still wrote into the blocks."""
    wrapped = asyncio.wrap_future(fut)
    try:
        await asyncio.wait((wrapped,), timeout=timeout_s)
    finally:
        # NOTE: the outcome is read from `fut`; this copy's exception (a close after the waiting
        # task was cancelled, or timed out) is no "exception never retrieved" then
        wrapped.add_done_callback(_retrieved)
    return fut.done()


def _retrieved(wrapped: asyncio.Future[Any]) -> None:
    if not wrapped.cancelled():
        wrapped.exception()


class EventBox:
    """Per-request FIFO of receiver events. A request's box opens at `expect` and closes after its
    terminal event (KVDone or KVRejected) was taken, or at `cancel`; events put to a closed box are
    dropped (they may race with a cancel). One waiter per request at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: dict[str, deque[KVEvent]] = {}
        self._waiters: dict[str, concurrent.futures.Future[KVEvent]] = {}
        self._touched: dict[str, float] = {}  # request id -> when the sender last said it is alive
        self._last: dict[str, float] = {}  # request id -> its last event or keepalive (none before the first)
        # request id -> the step time its sender's last keepalive announced (Keepalive.step_s): the
        # deadline's scale from the first keepalive on, before any slow gap was seen (cadence.py)
        self._announced: dict[str, float] = {}
        # the step times announced lately by any sender: a request none of whose keepalives came yet
        # (just placed, its sender's API process not scheduled since) is judged by them meanwhile
        self.announced = Cadence(half_life_s=STEP_HALF_LIFE_S)
        self.cadence = Cadence()  # how long the senders go between those: the timeouts' scale (cadence.py)

    def open(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._queues:
                raise ValueError(f"request {request_id} already has a transfer with undelivered events")
            self._queues[request_id] = deque()

    def touch(self, request_id: str, step_s: float | None = None) -> None:
        """The sender says the request is still being worked on (a keepalive): a `get` waiting on
        it counts its timeout from now, and scales it to the sender's step time `step_s` when the
        keepalive announced one (None: an older sender). No-op for a request with no open box."""
        with self._lock:
            if request_id in self._queues:
                self._touched[request_id] = now = time.monotonic()
                self._saw(request_id, now)
                if step_s is not None:
                    self._announced[request_id] = step_s
                    self.announced.saw(step_s)

    def timeout_s(self, request_id: str, floor_s: float) -> float:
        """How long a wait for the request's next sign of progress may take now (cadence.py)."""
        with self._lock:
            return self.cadence.timeout_s(floor_s, self._announced_s(request_id))

    def close(self, request_id: str, reason: str) -> None:
        with self._lock:
            self._queues.pop(request_id, None)
            self._touched.pop(request_id, None)
            self._last.pop(request_id, None)
            self._announced.pop(request_id, None)
            waiter = self._waiters.pop(request_id, None)
        if waiter is not None:
            waiter.set_exception(KVTransferError(f"request {request_id}: {reason}"))

    def put(self, event: KVEvent) -> None:
        rid = event.request_id
        with self._lock:
            if rid not in self._queues:
                return
            self._saw(rid, time.monotonic())
            waiter = self._waiters.pop(rid, None)
            if waiter is None:
                self._queues[rid].append(event)
                return
            if isinstance(event, KVDone | KVRejected):
                del self._queues[rid]
                self._touched.pop(rid, None)
                self._last.pop(rid, None)
                self._announced.pop(rid, None)
        waiter.set_result(event)

    def _announced_s(self, request_id: str) -> float:
        """The step time its sender announced (under the lock), else what senders announced lately."""
        step_s = self._announced.get(request_id)
        return self.announced.longest_gap_s() if step_s is None else step_s

    def _saw(self, request_id: str, now: float) -> None:
        """A sign of progress of the request: the gap since its previous one feeds the cadence
        (not the wait for its first: that is the prefill's queueing, which the lease bounds)."""
        last = self._last.get(request_id)
        if last is not None:
            self.cadence.saw(now - last)
        self._last[request_id] = now

    async def get(self, request_id: str, timeout_s: float) -> KVEvent:
        with self._lock:
            queue = self._queues.get(request_id)
            if queue is None:
                raise KVTransferError(f"request {request_id}: no transfer expected (never, cancelled or finished)")
            if request_id in self._waiters:
                raise KVTransferError(f"request {request_id}: another task is already waiting for its events")
            if queue:
                return self._pop(request_id, queue)
            waiter: concurrent.futures.Future[KVEvent] = concurrent.futures.Future()
            self._waiters[request_id] = waiter
        started_s = time.monotonic()
        while True:
            with self._lock:
                limit_s = self.cadence.timeout_s(timeout_s, self._announced_s(request_id))
                remaining_s = max(started_s, self._touched.get(request_id, 0.0)) + limit_s - time.monotonic()
            if remaining_s > 0 and await _await_future(waiter, remaining_s):
                return waiter.result()
            with self._lock:
                limit_s = self.cadence.timeout_s(timeout_s, self._announced_s(request_id))
                remaining_s = max(started_s, self._touched.get(request_id, 0.0)) + limit_s - time.monotonic()
                if remaining_s > 0 and not waiter.done():
                    continue  # touched meanwhile: wait on
                if self._waiters.get(request_id) is waiter:
                    del self._waiters[request_id]
            if not waiter.done():
                self.cadence.timed_out(limit_s)
                raise KVTransferTimeout(f"{TIMEOUT_MESSAGE}: no event for request {request_id} in {limit_s:g} s",
                                        limit_s)
            return waiter.result()

    def request_ids(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._queues)

    def _pop(self, request_id: str, queue: deque[KVEvent]) -> KVEvent:
        event = queue.popleft()
        if isinstance(event, KVDone | KVRejected):
            del self._queues[request_id]
            self._touched.pop(request_id, None)
            self._last.pop(request_id, None)
            self._announced.pop(request_id, None)
        return event


@dataclass(slots=True)
class _Outstanding:
    num_sent: int = 0
    num_acked: int = 0
    num_layers_sent: int = 0
    done_sent: bool = False
    error: str = ""
    last_progress_s: float = field(default_factory=time.monotonic)
    # Resolved when the request catches up (everything sent so far acknowledged) or fails; then
    # replaced. NOTE: not on every ack: a flush waiting on a 40-layer request wakes once, not 40 times.
    caught_up: concurrent.futures.Future[None] = field(default_factory=concurrent.futures.Future)

    def settle_if_caught_up(self) -> None:
        if self.error or self.num_acked >= self.num_sent:
            self.caught_up.set_result(None)
            self.caught_up = concurrent.futures.Future()


def _waiting_from_now(entry: _Outstanding) -> None:
    """Something is sent to an entry with nothing outstanding: the wait for its acknowledgement
    (and the gap the cadence measures) starts now, not at the last acknowledgement."""
    if entry.num_acked >= entry.num_sent:
        entry.last_progress_s = time.monotonic()


class AckTracker:
    """What a sender still waits to hear about, per request. An entry lives from the first send of
    a request until `flush` returned or raised after its final message."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: dict[str, _Outstanding] = {}
        # how long the receiver takes to acknowledge: the flush timeout's scale (a new one: FIRST_CONTACT_S)
        self.cadence = Cadence(first_contact_s=FIRST_CONTACT_S)
        self._late: OrderedDict[str, float] = OrderedDict()  # timed-out requests -> their last progress

    def sent_layer(self, request_id: str) -> None:
        with self._lock:
            entry = self._requests.setdefault(request_id, _Outstanding())
            _waiting_from_now(entry)
            entry.num_sent += 1
            entry.num_layers_sent += 1

    def sent_done(self, request_id: str) -> int:
        """Record the final message; returns how many layer payloads preceded it."""
        with self._lock:
            entry = self._requests.setdefault(request_id, _Outstanding())
            _waiting_from_now(entry)
            entry.num_sent += 1
            entry.done_sent = True
            return entry.num_layers_sent

    def acked(self, request_id: str) -> None:
        with self._lock:
            entry = self._requests.get(request_id)
            if entry is None and (last_s := self._late.pop(request_id, None)) is not None:
                self.cadence.saw(time.monotonic() - last_s)  # NOTE: it was slow, not gone: learn how slow
            if entry is not None:  # NOTE: late acks after a timeout or failure are ignored
                entry.num_acked += 1
                now = time.monotonic()
                self.cadence.saw(now - entry.last_progress_s)
                entry.last_progress_s = now
                entry.settle_if_caught_up()

    def failed(self, request_id: str, reason: str) -> None:
        with self._lock:
            entry = self._requests.get(request_id)
            if entry is not None and not entry.error:
                entry.error = reason
                entry.settle_if_caught_up()

    def fail_all(self, reason: str) -> None:
        with self._lock:
            request_ids = list(self._requests)
        for request_id in request_ids:
            self.failed(request_id, reason)

    def forget(self, request_id: str) -> None:
        """Stop tracking the request (nobody will flush it)."""
        with self._lock:
            self._requests.pop(request_id, None)

    def request_ids(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._requests)

    async def flush(self, request_id: str, timeout_s: float) -> None:
        """See KVSender.flush. The timeout counts from the later of the call and the last ack; it is
        `timeout_s` at least, more when the receiver has been slow to acknowledge lately (cadence.py)."""
        started_s = time.monotonic()
        while True:
            with self._lock:
                entry = self._requests.get(request_id)
                if entry is None:
                    return
                if entry.error:
                    del self._requests[request_id]
                    raise KVTransferError(f"request {request_id}: {entry.error}")
                if entry.num_acked >= entry.num_sent:
                    if entry.done_sent:
                        del self._requests[request_id]
                    return
                caught_up = entry.caught_up
                limit_s = self.cadence.timeout_s(timeout_s)
                remaining_s = max(started_s, entry.last_progress_s) + limit_s - time.monotonic()
                if remaining_s <= 0:
                    del self._requests[request_id]
                    self.cadence.timed_out(limit_s)
                    self._late[request_id] = entry.last_progress_s
                    while len(self._late) > _LATE_KEPT:
                        self._late.popitem(last=False)
                    raise KVTransferTimeout(f"{TIMEOUT_MESSAGE}: no progress on request {request_id} for "
                                            f"{limit_s:g} s", limit_s)
            await _await_future(caught_up, remaining_s)
