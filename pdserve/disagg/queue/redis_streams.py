"""The prefill queue on Redis Streams: routers produce, prefill workers consume.

    stream   pdserve:{deployment}:prefill         one entry per prefill attempt: {"job": PrefillJob JSON}
    group    prefill                              every prefill worker is one consumer of it
    dead     pdserve:{deployment}:prefill:dead    jobs that failed `max_deliveries` times
    aborted  pdserve:{deployment}:aborted:{tid}   set by a router when the client left (expires)
    alive    pdserve:{deployment}:consumer:{name} each consumer's heartbeat (expires after 3 s)

A consumer (`RedisJobConsumer`, in each prefill worker):
- pulls one entry (XREADGROUP) only while its jobs in flight hold fewer prompt tokens than its
  token budget, so one giant prompt occupies one worker and the others keep pulling;
- runs it (`PrefillService.run`) and acknowledges it (XACK + XDEL) once the hand-off ended;
- heartbeats every second: its `alive` key (routers count live consumers by these keys, the
  prefill pool's readiness) and the entries it is working on (XCLAIM to itself, which resets
  their idle time), so only entries of a dead or hung consumer go idle;
- every `claim_interval_s`, XAUTOCLAIMs entries idle for longer than `claim_idle_s`. A reclaimed
  job is prefilled again from scratch as a new attempt (its KV died with its worker): the decode
  worker is told to expect the new attempt first. An entry delivered more than `max_deliveries`
  times goes to the dead-letter stream and its decode worker ends the request with an error;
- skips an aborted attempt without computing it.
Redis unreachable: the consumer logs it, retries every second and carries on when it is back;
routers answer 503 meanwhile (`put` raises QueueUnavailable).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from pdserve.disagg.control import PrefillJob
from pdserve.disagg.queue.base import (
    AttemptListener,
    PrefillQueue,
    PrefillTicket,
    QueueStats,
    QueueUnavailable,
)

logger = logging.getLogger(__name__)

GROUP = "prefill"
_ABORTED_TTL_S = 600
ALIVE_TTL_S = 3


class RedisKeys:
    def __init__(self, deployment: str) -> None:
        self.stream = f"pdserve:{deployment}:prefill"
        self.dead = f"{self.stream}:dead"
        self.aborted_prefix = f"pdserve:{deployment}:aborted:"
        self.alive_prefix = f"pdserve:{deployment}:consumer:"

    def aborted(self, transfer_id: str) -> str:
        return self.aborted_prefix + transfer_id


def connect(url: str) -> aioredis.Redis:
    return aioredis.Redis.from_url(url, socket_connect_timeout=2.0, socket_timeout=5.0, decode_responses=True)


async def ensure_group(client: aioredis.Redis, stream: str) -> None:
    try:
        await client.xgroup_create(stream, GROUP, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


class RedisPrefillQueue(PrefillQueue):
    """Router side: XADD each attempt; readiness is the count of live consumers (their `alive`
    keys), taken at each `refresh`."""

    def __init__(self, url: str, deployment: str = "default", starting: Callable[[], bool] = lambda: False) -> None:
        """`starting`: whether the router is still within its startup window (`WorkerPool.starting`),
        when a queue that has had no consumer yet is expected to get one."""
        self.url = url
        self._starting = starting
        self.keys = RedisKeys(deployment)
        self._redis = connect(url)
        self._group_ready = False
        self._num_live_consumers = 0
        self._num_backlog = 0
        self._error = ""
        self._had_consumers = False  # some consumer was live since this router started

    @property
    def ready(self) -> bool:
        return not self._error and self._num_live_consumers > 0

    @property
    def expected_back(self) -> bool:
        """No live consumer now (a restarting prefill worker's key expired) but there were some, or
        none yet in a fresh router's startup window."""
        return not self._error and self._num_live_consumers == 0 and (self._had_consumers or self._starting())

    @property
    def error(self) -> str:
        return self._error

    def stats(self) -> QueueStats:
        return QueueStats("redis", 0, self._num_backlog, self._num_live_consumers, 0, self._error)

    async def put(self, job: PrefillJob, *, prefix_affinity: bool = False,
                  cached_tokens: Mapping[str, int] | None = None,
                  listener: AttemptListener | None = None) -> PrefillTicket:
        # NOTE: neither applies: the consumers pull jobs as their budget allows, and report to the stream
        ticket = PrefillTicket(job)
        try:
            if not self._group_ready:
                await ensure_group(self._redis, self.keys.stream)
                self._group_ready = True
            await self._redis.xadd(self.keys.stream, {"job": job.model_dump_json()})
        except (RedisError, OSError) as exc:
            self._error = f"the prefill queue (Redis) is unreachable: {exc}"
            raise QueueUnavailable(self._error) from exc
        ticket.trace.mark_left_router()
        return ticket

    async def cancel(self, ticket: PrefillTicket) -> None:
        with contextlib.suppress(RedisError, OSError):
            await self._redis.set(self.keys.aborted(ticket.job.transfer_id), "1", ex=_ABORTED_TTL_S)

    async def refresh(self) -> None:
        """Count live consumers and the jobs none has taken yet; the error clears only here, once
        Redis answers again."""
        try:
            keys = self._redis.scan_iter(match=self.keys.alive_prefix + "*", count=100)
            self._num_live_consumers = len([key async for key in keys])
            self._had_consumers = self._had_consumers or self._num_live_consumers > 0
            self._num_backlog = await self._backlog()
            self._error = ""
        except (RedisError, OSError) as exc:
            self._error = f"the prefill queue (Redis) is unreachable: {exc}"

    async def _backlog(self) -> int:
        """Entries no consumer has taken yet: the group's `lag` (XINFO GROUPS, Redis >= 7). Redis
        cannot tell the lag (nil) once entries were deleted out of order while others wait, which
        is normal here (a short job is acknowledged before a long one); then, since every
        acknowledged entry is deleted with its XACK, it is the stream's length less the entries
        delivered and not acknowledged. 0 before the first job (no stream, no group)."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.xinfo_groups(self.keys.stream)
            pipe.xlen(self.keys.stream)
            try:
                groups, length = await pipe.execute()
            except ResponseError:  # no such key: nothing was ever queued
                return 0
        group = next((g for g in groups if g["name"] == GROUP), None)
        if group is None:
            return 0
        lag = group.get("lag")
        return int(lag) if lag is not None else max(0, int(length) - int(group["pending"]))

    async def close(self) -> None:
        await self._redis.aclose()
