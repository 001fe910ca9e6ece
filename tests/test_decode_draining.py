"""A decode worker's 503 to a reservation meant either "no room now" or "draining", and the router
could not tell which: a draining worker stayed a candidate for every new request until the next
/pd/info poll. Now the draining 503 carries DRAINING_HEADER; the router's client raises
WorkerDraining for it, and the run takes that worker out of new work (`Worker.mark_draining`) and
reserves on the next one."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi import FastAPI

from pdserve.disagg.client import WorkerClient, WorkerDraining
from pdserve.disagg.config import RouterConfig
from pdserve.disagg.control import ReserveRequest, WireSamplingParams
from pdserve.disagg.router.errors import RouterError
from pdserve.disagg.router.pool import Worker
from pdserve.disagg.router.request_run import RequestRun, RouterParts
from pdserve.disagg.worker.routes import add_decode_routes
from pdserve.engine.sampling_params import SamplingParams
from pdserve.serving.metrics import ServerMetrics, install_metrics
from tests.helpers import mark_ready
from tests.pd_fixtures import serve


class NoRoom:
    """A decode service with no KV room: `reserve` answers None, draining or not."""

    def __init__(self) -> None:
        self.draining = False

    async def reserve(self, body: ReserveRequest) -> None:
        return None


@pytest.fixture
def decode_routes() -> Iterator[tuple[str, NoRoom, ServerMetrics]]:
    service = NoRoom()
    app = FastAPI()
    add_decode_routes(app, service)  # type: ignore[arg-type]
    metrics = ServerMetrics("m", "decode")
    install_metrics(app, metrics)
    served = serve(app)
    try:
        yield served.url, service, metrics
    finally:
        served.stop()


def _request() -> ReserveRequest:
    return ReserveRequest(request_id="r", transfer_id="r@0", prompt_token_ids=[1, 2, 3],
                          params=WireSamplingParams.of(SamplingParams(max_tokens=4)))


def test_the_client_tells_no_room_from_draining(decode_routes: tuple[str, NoRoom, ServerMetrics]) -> None:
    url, service, metrics = decode_routes

    async def reserve() -> Any:
        client = WorkerClient(timeout_s=5.0)
        try:
            return await client.reserve(url, _request())
        finally:
            await client.close()

    assert asyncio.run(reserve()) is None, "no room: try again later, the worker stays a candidate"
    service.draining = True
    with pytest.raises(WorkerDraining):
        asyncio.run(reserve())

    def rejections(reason: str) -> float | None:
        return metrics.registry.get_sample_value("pdserve:rejections_total", metrics.labels | {"code": "503",
                                                                                               "reason": reason})

    assert (rejections("no_available_block"), rejections("draining")) == (1.0, 1.0)


def test_candidates_all_draining_at_the_deadline_are_no_decode_worker_not_no_room() -> None:
    decodes = TwoDecodes()

    async def draining(url: str, request: ReserveRequest) -> str:
        raise WorkerDraining(url)

    decodes.reserve = draining  # type: ignore[method-assign]
    run = RequestRun(_parts(decodes, deadline_s=0.0), "r", [1, 2, 3], SamplingParams(max_tokens=4))
    with pytest.raises(RouterError, match="no decode worker is ready"):
        asyncio.run(run._reserve(set()))


def _parts(client: Any, deadline_s: float = 0.5) -> RouterParts:
    def reject(reason: str, message: str) -> None:
        raise RouterError(reason, message)

    async def order(candidates: list[Any], prompt: list[int], root: bytes = b"") -> list[Any]:
        return candidates

    return RouterParts(RouterConfig(reserve_deadline_s=deadline_s, restart_window_s=0.0), None, 64,  # type: ignore[arg-type]
                       100, client.pool, SimpleNamespace(order=order), None, client,
                       SimpleNamespace(reject=reject), None, None)


class TwoDecodes:
    """The first decode worker answers every reservation draining, the second reserves."""

    def __init__(self) -> None:
        self.first, self.second = Worker("http://decode-1", "decode"), Worker("http://decode-2", "decode")
        for worker in (self.first, self.second):
            mark_ready(worker)
        self.pool = SimpleNamespace(ready=lambda role: [w for w in (self.first, self.second) if w.ready],
                                    expected_back=lambda role: False)
        self.asked: list[str] = []

    async def reserve(self, url: str, request: ReserveRequest) -> str:
        self.asked.append(url)
        if url == self.first.url:
            raise WorkerDraining(f"decode worker {url} is draining")
        return f"reserved on {url}"


def test_a_draining_decode_worker_gets_no_more_reservations() -> None:
    decodes = TwoDecodes()

    async def reserve_twice() -> list[tuple[Worker, Any]]:
        parts = _parts(decodes)
        return [await RequestRun(parts, rid, [1, 2, 3], SamplingParams(max_tokens=4))._reserve(set())
                for rid in ("r", "s")]

    got = asyncio.run(reserve_twice())
    assert [(w.url, reply) for w, reply in got] == [(decodes.second.url, "reserved on http://decode-2")] * 2
    assert decodes.asked == [decodes.first.url, decodes.second.url, decodes.second.url], \
        "the draining worker was asked again"
    assert not decodes.first.ready and decodes.first.going


def test_a_decode_worker_with_no_room_stays_a_candidate() -> None:
    """A 503 without the header (None from the client: no room now) is asked again next round."""
    decodes = TwoDecodes()
    rounds = 0

    async def no_room_once(url: str, request: ReserveRequest) -> str | None:
        nonlocal rounds
        decodes.asked.append(url)
        rounds += url == decodes.second.url
        return None if rounds < 2 else f"reserved on {url}"

    decodes.reserve = no_room_once  # type: ignore[method-assign]
    run = RequestRun(_parts(decodes), "r", [1, 2, 3], SamplingParams(max_tokens=4))
    worker, reply = asyncio.run(run._reserve(set()))
    assert (worker.url, reply) == (decodes.second.url, "reserved on http://decode-2")
    assert decodes.asked == [decodes.first.url, decodes.second.url, decodes.first.url, decodes.second.url]
    assert decodes.first.ready and not decodes.first.going
