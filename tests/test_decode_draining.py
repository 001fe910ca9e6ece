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
from tests.helpers import mark_ready
from tests.pd_fixtures import serve


class NoRoom:
    """A decode service with no KV room: `reserve` answers None, draining or not."""

    def __init__(self) -> None:
        self.draining = False

    async def reserve(self, body: ReserveRequest) -> None:
        return None


@pytest.fixture
def decode_routes() -> Iterator[tuple[str, NoRoom]]:
    service = NoRoom()
    app = FastAPI()
    add_decode_routes(app, service)  # type: ignore[arg-type]
    served = serve(app)
    try:
        yield served.url, service
    finally:
        served.stop()


def _request() -> ReserveRequest:
    return ReserveRequest(request_id="r", transfer_id="r@0", prompt_token_ids=[1, 2, 3],
                          params=WireSamplingParams.of(SamplingParams(max_tokens=4)))


def test_the_client_tells_no_room_from_draining(decode_routes: tuple[str, NoRoom]) -> None:
    url, service = decode_routes

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


def _parts(client: Any) -> RouterParts:
    def reject(reason: str, message: str) -> None:
        raise RouterError(reason, message)

    async def order(candidates: list[Any], prompt: list[int], root: bytes = b"") -> list[Any]:
        return candidates

    return RouterParts(RouterConfig(reserve_deadline_s=0.5, restart_window_s=0.0), None, 64,  # type: ignore[arg-type]
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
