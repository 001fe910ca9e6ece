"""The router's decisions before anything is queued, and their counts by reason.

- a request that can never run (prompt too long, token ids out of the vocabulary): 400;
- the queue's store unreachable, no ready prefill worker (or live consumer), no ready decode
  worker: 503 with Retry-After; but while a worker of the role that was ready is expected back
  (restarting: still listed in the pool, or a Redis queue that had consumers), or a role has had
  no ready worker yet in a fresh router's first `startup_window_s` (loading, registering), a new
  request waits up to `restart_window_s` for one first;
- more than `max_queued_requests` requests (or `max_queued_tokens` prompt tokens) admitted and
  still waiting for their first token: 429 with Retry-After.
Later refusals of an admitted request (no KV room before the deadline, the queue lost, no first
token before the first-token deadline) are counted here too (`reject`), so every refusal has one reason.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Literal, NoReturn

from pdserve.disagg.config import RouterConfig
from pdserve.disagg.queue import PrefillQueue
from pdserve.disagg.router.errors import Refused, RouterError
from pdserve.disagg.router.pool import WorkerPool
from pdserve.disagg.router.stats import Rejections
from pdserve.engine.llm_engine import check_request
from pdserve.engine.sampling_params import SamplingParams

_WINDOW_POLL_S = 0.05  # how often a request in the restart window looks at the pool again

RejectReason = Literal["invalid", "queue_full", "no_prefill_worker", "no_decode_worker", "no_kv_room",
                       "queue_unavailable", "first_token_timeout"]


class Admission:
    """Admits requests into the router's queue (admitted, first token not out yet) and counts
    refusals. Reads the pool's and the queue's readiness; owns only its counts."""

    def __init__(self, config: RouterConfig, pool: WorkerPool, queue: PrefillQueue, max_model_len: int,
                 vocab_size: int) -> None:
        self._max_queued_requests = config.max_queued_requests
        self._max_queued_tokens = config.max_queued_tokens
        self._pool = pool
        self._queue = queue
        self._max_model_len = max_model_len
        self._vocab_size = vocab_size
        self._restart_window_s = config.restart_window_s
        self._rejected: Counter[str] = Counter()  # by RejectReason: the fields of Rejections
        self.num_queued = 0
        self.num_queued_tokens = 0

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises ValueError (the handlers' 400) for a request that can never run."""
        try:
            check_request(prompt_token_ids, params, self._max_model_len, self._vocab_size)
        except ValueError:
            self._rejected["invalid"] += 1
            raise

    async def admit(self, num_tokens: int) -> None:
        """Into the queue, or a RouterError (the client's 503, 429). Pair with one `release`. A
        role with no ready worker while one is expected back (restarting) is waited for, up to
        `restart_window_s`."""
        await self._restart_window()
        self._admit_now(num_tokens)

    async def _restart_window(self) -> None:
        if self._restart_window_s <= 0 or not self._worth_waiting():
            return
        # NOTE: a request waiting here counts as waiting in the router (vllm:num_requests_waiting)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._restart_window_s
        while self._worth_waiting() and loop.time() < deadline:
            await asyncio.sleep(_WINDOW_POLL_S)

    def _worth_waiting(self) -> bool:
        """Some role has no ready worker, and each such role is expected back: a wait can end in
        an admission. The queue's store unreachable, or a role gone for good, is refused at once."""
        if self._queue.error:
            return False
        queue_down, decode_down = not self._queue.ready, not self._pool.any_ready("decode")
        return (queue_down or decode_down) and (not queue_down or self._queue.expected_back) and \
            (not decode_down or self._pool.expected_back("decode"))

    def _admit_now(self, num_tokens: int) -> None:
        if self._queue.error:
            self.reject("queue_unavailable", self._queue.error)
        if not self._queue.ready:
            self.reject("no_prefill_worker", "no prefill worker is ready")
        if not self._pool.any_ready("decode"):
            self.reject("no_decode_worker", "no decode worker is ready")
        if self.num_queued + 1 > self._max_queued_requests or \
                (self.num_queued and self.num_queued_tokens + num_tokens > self._max_queued_tokens):
            self.reject("queue_full", f"the router's queue is full ({self.num_queued} requests, "
                        f"{self.num_queued_tokens} prompt tokens waiting); retry later")
        self.num_queued += 1
        self.num_queued_tokens += num_tokens

    def release(self, num_tokens: int) -> None:
        """The request's first token is out, or it ended before that."""
        self.num_queued -= 1
        self.num_queued_tokens -= num_tokens

    def reject(self, reason: Refused, message: str) -> NoReturn:
        """Count the refusal and raise it (RouterError: the router's edge decides the status)."""
        self._rejected[reason] += 1
        raise RouterError(reason, message)

    def rejections(self) -> Rejections:
        return Rejections(**self._rejected)  # a reason never counted keeps its 0
