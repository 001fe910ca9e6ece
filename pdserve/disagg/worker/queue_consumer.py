"""A prefill worker's side of the Redis Streams queue (the stream, its group and keys:
queue/redis_streams.py): `RedisJobConsumer` pulls jobs, runs them on the worker's `PrefillService`
and acknowledges them (see that module's docstring for how it pulls, heartbeats and reclaims).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
from dataclasses import dataclass
from typing import cast

from redis.exceptions import RedisError
from redis.typing import EncodableT, FieldT

from pdserve.disagg.auth import verify_job
from pdserve.disagg.client import WorkerClient, WorkerUnreachable
from pdserve.disagg.control import PrefillJob
from pdserve.disagg.kv_layout import KVLayoutMismatch
from pdserve.disagg.queue.base import next_attempt
from pdserve.disagg.queue.redis_streams import ALIVE_TTL_S, GROUP, RedisKeys, connect, ensure_group
from pdserve.disagg.transport.errors import KVTransferError
from pdserve.disagg.worker.prefill_service import PrefillService
from pdserve.disagg.worker.stats import Counts

logger = logging.getLogger(__name__)

_StreamReply = list[tuple[str, list[tuple[str, dict[str, str]]]]]


@dataclass(frozen=True, slots=True)
class ConsumerStats(Counts):
    """What a consumer did since it started, plus `in_flight` (now)."""

    taken: int = 0  # entries pulled (XREADGROUP)
    reclaimed: int = 0  # entries of a silent consumer re-delivered here (XAUTOCLAIM)
    dead_lettered: int = 0  # entries delivered more than `max_deliveries` times
    skipped_aborted: int = 0  # entries whose request was aborted before they ran
    duplicates: int = 0  # entries of an attempt that runs or ran here already (dropped, acknowledged)
    in_flight: int = 0  # entries being worked on



@dataclass(slots=True)
class _Counts:
    taken: int = 0
    reclaimed: int = 0
    dead_lettered: int = 0
    skipped_aborted: int = 0
    duplicates: int = 0


@dataclass(frozen=True, slots=True)
class ConsumerOptions:
    """How a `RedisJobConsumer` pulls, reclaims and gives up on entries."""

    token_budget: int | None = None  # prompt tokens in flight; None: the engine's max_num_batched_tokens
    max_jobs: int = 64
    claim_idle_s: float = 5.0  # re-deliver an entry whose consumer went silent this long
    claim_interval_s: float = 1.0
    max_deliveries: int = 3  # then the entry is dead-lettered
    block_ms: int = 500


class RedisJobConsumer:
    """Prefill worker side: feeds `service` from the shared stream (see the module docstring)."""

    def __init__(self, service: PrefillService, url: str, deployment: str = "default",
                 options: ConsumerOptions | None = None) -> None:
        opts = options or ConsumerOptions()
        self.service = service
        self.keys = RedisKeys(deployment)
        self.name = f"{socket.gethostname()}-{os.getpid()}-{id(self):x}"
        self.token_budget = opts.token_budget or service.client.config.scheduler.max_num_batched_tokens
        self.max_jobs = opts.max_jobs
        self.claim_idle_ms = int(opts.claim_idle_s * 1000)
        self.claim_interval_s = opts.claim_interval_s
        self.max_deliveries = opts.max_deliveries
        self.block_ms = opts.block_ms
        self._counts = _Counts()
        self._redis = connect(url)
        self._workers = WorkerClient(timeout_s=10.0, secret=service.secret)
        self._jobs: dict[str, asyncio.Task[None]] = {}  # entry id -> task
        self._stopping = asyncio.Event()

    @property
    def num_in_flight(self) -> int:
        return len(self._jobs)

    def stats(self) -> ConsumerStats:
        return ConsumerStats(**dataclasses.asdict(self._counts), in_flight=self.num_in_flight)

    async def run(self) -> None:
        """Until `stop`: pull, reclaim, heartbeat. Then wait for the jobs in flight."""
        next_claim = 0.0
        loop = asyncio.get_running_loop()
        connected = False
        while not self._stopping.is_set():
            try:
                if not connected:
                    await ensure_group(self._redis, self.keys.stream)
                    connected = True
                    logger.info("prefill consumer %s pulling from %s", self.name, self.keys.stream)
                if loop.time() >= next_claim:
                    next_claim = loop.time() + self.claim_interval_s
                    await self._heartbeat()
                    await self._reclaim()
                if self._has_room():
                    await self._pull()
                else:
                    await asyncio.sleep(0.02)
            except (RedisError, OSError) as exc:
                if connected:
                    logger.warning("prefill queue (Redis) unreachable: %s; retrying", exc)
                connected = False
                await asyncio.sleep(1.0)
        if self._jobs:
            await asyncio.gather(*self._jobs.values(), return_exceptions=True)

    def stop(self) -> None:
        """Stop pulling (drain): jobs in flight still finish and are acknowledged."""
        self._stopping.set()

    async def close(self) -> None:
        self.stop()
        for task in list(self._jobs.values()):
            task.cancel()
        with contextlib.suppress(RedisError, OSError):
            await self._redis.delete(self.keys.alive_prefix + self.name)
        await self._workers.close()
        await self._redis.aclose()

    def _has_room(self) -> bool:
        return len(self._jobs) < self.max_jobs and self.service.num_in_flight_tokens < self.token_budget

    async def _pull(self) -> None:
        # NOTE: redis-py types replies loosely; with decode_responses=True this one is
        # [(stream, [(entry id, {field: value})])], or None when the block timed out.
        reply = cast(_StreamReply | None, await self._redis.xreadgroup(GROUP, self.name, {self.keys.stream: ">"},
                                                                        count=1, block=self.block_ms))
        for _, entries in reply or []:
            for entry_id, fields in entries:
                self._counts.taken += 1
                self._start(entry_id, fields, reclaimed=False)

    async def _heartbeat(self) -> None:
        """Say we are alive; reset the idle time of our entries, so no other consumer reclaims them
        while we work."""
        await self._redis.set(self.keys.alive_prefix + self.name, str(len(self._jobs)), ex=ALIVE_TTL_S)
        if self._jobs:
            await self._redis.xclaim(self.keys.stream, GROUP, self.name, min_idle_time=0,
                                     message_ids=list(self._jobs), justid=True)

    async def _reclaim(self) -> None:
        _, entries, _ = await self._redis.xautoclaim(self.keys.stream, GROUP, self.name,
                                                     min_idle_time=self.claim_idle_ms, start_id="0-0", count=16)
        for entry_id, fields in entries:
            if entry_id in self._jobs or fields is None:
                continue
            pending = await self._redis.xpending_range(self.keys.stream, GROUP, min=entry_id, max=entry_id, count=1)
            deliveries = int(pending[0]["times_delivered"]) if pending else 1
            if deliveries > self.max_deliveries:
                await self._dead_letter(entry_id, fields, deliveries)
                continue
            self._counts.reclaimed += 1
            logger.warning("re-delivering prefill job %s (delivery %d): its consumer went silent", entry_id, deliveries)
            self._start(entry_id, fields, reclaimed=True)

    def _start(self, entry_id: str, fields: dict[str, str], reclaimed: bool) -> None:
        self._jobs[entry_id] = asyncio.create_task(self._handle(entry_id, fields, reclaimed))

    async def _handle(self, entry_id: str, fields: dict[str, str], reclaimed: bool) -> None:
        try:
            job = self._job(fields)
        except (KeyError, ValueError) as exc:
            logger.error("dropping unreadable prefill job %s: %s", entry_id, exc)
            await self._ack(entry_id)
            self._jobs.pop(entry_id, None)
            return
        try:
            if await self._redis.exists(self.keys.aborted(job.transfer_id)):
                self._counts.skipped_aborted += 1
                logger.info("request %s was aborted; skipping its prefill job", job.request_id)
            else:
                attempt = await self._retarget(job) if reclaimed else job
                if attempt is not None:
                    await self._run(attempt)
            await self._ack(entry_id)
        except (RedisError, OSError) as exc:  # not acknowledged: it will be re-delivered
            logger.warning("prefill job %s not acknowledged: %s", entry_id, exc)
        finally:
            self._jobs.pop(entry_id, None)

    async def _run(self, job: PrefillJob) -> None:
        if self.service.holds(job.transfer_id):  # NOTE: a copy: the attempt's own delivery answers for it
            self._counts.duplicates += 1
            logger.info("request %s: attempt %s runs or ran here already; this copy is dropped", job.request_id,
                        job.transfer_id)
            return
        try:
            hand_off = await self.service.run(job)
        except (ValueError, KVLayoutMismatch) as exc:  # permanent: retrying cannot help
            await self._fail(job, f"prefill refused the job: {exc}")
            return
        except (KVTransferError, OSError) as exc:
            logger.warning("request %s: decode worker's KV receiver unreachable: %s", job.request_id, exc)
            await self._fail(job, f"prefill cannot reach the decode worker's KV receiver: {exc}")
            return
        if hand_off.status == "failed":
            logger.warning("request %s: hand-off failed: %s", job.request_id, hand_off.reason)
            await self._fail(job, f"prefill failed: {hand_off.reason}")

    async def _retarget(self, job: PrefillJob) -> PrefillJob | None:
        """A re-delivered job is a new attempt: the decode worker must expect it first."""
        job, replaced = next_attempt(job), job.transfer_id
        try:
            expecting = await self._workers.retarget(job.decode_url, job.request_id, job.transfer_id,
                                                     replaces=replaced)
        except WorkerUnreachable as exc:
            logger.warning("request %s: decode worker unreachable (%s); dropping the job", job.request_id, exc.cause)
            return None
        if not expecting:
            logger.info("request %s no longer waits for KV; dropping the re-delivered job", job.request_id)
            return None
        return job

    async def _dead_letter(self, entry_id: str, fields: dict[str, str], deliveries: int) -> None:
        self._counts.dead_lettered += 1
        reason = f"prefill job failed {deliveries - 1} deliveries; dead-lettered"
        logger.error("prefill job %s: %s", entry_id, reason)
        # NOTE: copied key by key: redis-py's field type is a union, and dict keys are invariant
        dead: dict[FieldT, EncodableT] = {key: value for key, value in fields.items()}
        dead.update({"entry_id": entry_id, "reason": reason})
        await self._redis.xadd(self.keys.dead, dead)
        await self._ack(entry_id)
        with contextlib.suppress(KeyError, ValueError):
            await self._fail(self._job(fields), reason, any_attempt=True)

    def _job(self, fields: dict[str, str]) -> PrefillJob:
        """The entry's job, once its signature checked (auth.py): before anything reaches an
        address it names (retarget, fail, the KV port). KeyError/ValueError otherwise."""
        job = PrefillJob.model_validate_json(fields["job"])
        verify_job(self.service.secret, job)
        return job

    async def _fail(self, job: PrefillJob, reason: str, *, any_attempt: bool = False) -> None:
        """End the request on its decode worker now, if it still waits for this attempt (or, for a
        dead-lettered entry, whose later attempts carry other ids: for any)."""
        if not job.decode_url:
            return
        with contextlib.suppress(WorkerUnreachable):
            await self._workers.fail(job.decode_url, job.request_id, reason, "" if any_attempt else job.transfer_id)

    async def _ack(self, entry_id: str) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.xack(self.keys.stream, GROUP, entry_id)
            pipe.xdel(self.keys.stream, entry_id)
            await pipe.execute()
