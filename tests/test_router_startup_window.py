"""The router's startup window (`--startup-window-s`) and restart window, piece by piece: which
roles a fresh pool expects, the Redis queue's first consumer, and when admission waits at all (only
while every role without a ready worker is expected: an unreachable store, or a role gone for good,
is refused at once). The end-to-end checks are in tests/test_router_admission.py."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest

from pdserve.disagg.config import RouterConfig
from pdserve.disagg.control import WorkerInfo
from pdserve.disagg.queue.redis_streams import RedisPrefillQueue
from pdserve.disagg.router.admission import Admission
from pdserve.disagg.router.errors import RouterError
from pdserve.disagg.router.pool import WorkerPool


class _Client:
    """Answers every /pd/info as a worker of the URL's role, ready as `self.ready` says."""

    def __init__(self) -> None:
        self.ready = False

    async def info(self, url: str) -> WorkerInfo:
        return WorkerInfo(role="decode" if "decode" in url else "prefill", model="m", kv_layout={},
                          kv_transport="tcp", kv_address=None, ready=self.ready, num_running=0, num_waiting=0,
                          num_free_kv_blocks=1, num_kv_blocks=1)


def test_a_fresh_pool_expects_each_role_until_its_first_ready_worker_or_the_window_ends() -> None:
    client = _Client()
    pool = WorkerPool(client, decode=["http://decode"])  # type: ignore[arg-type]
    asyncio.run(pool.refresh())
    assert not pool.expected_back("decode")  # no window opened: a worker never ready is not awaited
    pool.expect_first_workers(30.0)
    assert pool.starting and pool.expected_back("decode") and pool.expected_back("prefill")  # none listed yet
    client.ready = True
    asyncio.run(pool.refresh())
    assert not pool.expected_back("decode")  # ready
    pool.set_members("decode", [])  # deregistered on purpose, within the window
    assert not pool.expected_back("decode")  # the role had its first worker: not awaited any more
    assert pool.expected_back("prefill")  # still none
    pool.expect_first_workers(0.0)
    assert not pool.starting and not pool.expected_back("prefill")


def test_the_redis_queue_expects_its_first_consumer_only_while_the_router_starts() -> None:
    starting = [True]
    queue = RedisPrefillQueue("redis://127.0.0.1:1", starting=lambda: starting[0])
    assert not queue.ready and queue.expected_back
    starting[0] = False
    assert not queue.expected_back
    queue._error = "Redis unreachable"  # an unreachable store is never waited for
    starting[0] = True
    assert not queue.expected_back


def _admission(queue_ready: bool, queue_back: bool, decode_ready: bool, decode_back: bool,
               error: str = "") -> Admission:
    queue = SimpleNamespace(ready=queue_ready, expected_back=queue_back, error=error)
    pool = SimpleNamespace(any_ready=lambda role: decode_ready, expected_back=lambda role: decode_back)
    return Admission(RouterConfig(restart_window_s=0.6), pool, queue, 1024, 100)  # type: ignore[arg-type]


@pytest.mark.parametrize(("case", "waits", "reason"), [
    (dict(queue_ready=True, queue_back=False, decode_ready=False, decode_back=True), True, "no_decode_worker"),
    (dict(queue_ready=False, queue_back=True, decode_ready=True, decode_back=False), True, "no_prefill_worker"),
    (dict(queue_ready=False, queue_back=True, decode_ready=False, decode_back=True), True, "no_prefill_worker"),
    # one role expected, the other gone for good: no wait can end in an admission
    (dict(queue_ready=False, queue_back=False, decode_ready=False, decode_back=True), False, "no_prefill_worker"),
    (dict(queue_ready=False, queue_back=True, decode_ready=False, decode_back=False), False, "no_prefill_worker"),
    (dict(queue_ready=False, queue_back=False, decode_ready=False, decode_back=True, error="Redis unreachable"),
     False, "queue_unavailable"),
], ids=["decode-expected", "prefill-expected", "both-expected", "prefill-gone", "decode-gone", "store-down"])
def test_admission_waits_only_while_every_missing_role_is_expected(case: dict[str, Any], waits: bool,
                                                                    reason: str) -> None:
    admission = _admission(**case)
    start = time.monotonic()
    with pytest.raises(RouterError) as refused:
        asyncio.run(admission.admit(10))
    elapsed = time.monotonic() - start
    assert refused.value.reason == reason
    assert (elapsed >= 0.5) == waits, elapsed  # the 0.6 s window, or at once
