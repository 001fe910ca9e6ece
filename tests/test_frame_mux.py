"""Decode's frames of many requests on one stream per router (worker/frame_mux.py, the router's
end in client.py): the same answers as one stream per request, one connection whatever the
concurrency, closed once idle, and a request whose frames end unfinished aborted on decode."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from helpers import generate_texts, random_prompt
from pd_fixtures import start_cluster, stop_cluster
from server_fixtures import parse_sse

from pdserve import LLM, SamplingParams
from pdserve.bench.frame_delivery import router_end
from pdserve.disagg.client import UnknownRequest, WorkerClient, _Reply
from pdserve.disagg.control import FirstToken, OutputFrame
from pdserve.disagg.worker.frame_mux import FrameMuxes, UnknownMux

PROMPTS = [random_prompt(n, seed=7100 + n) for n in (5, 33, 70, 140, 9, 60)]
MAX_TOKENS = 12


@pytest.mark.slow
@pytest.mark.parametrize("frame_mux", [True, False], ids=["one_stream", "a_stream_per_request"])
def test_concurrent_streams_through_the_frame_stream_equal_colocated(model_dirs: dict[str, Path], colocated: LLM,
                                                                     frame_mux: bool) -> None:
    cluster = start_cluster(model_dirs["tiny"], "tcp", 1, 1, frame_mux=frame_mux)
    try:
        want = generate_texts(colocated, PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))

        async def one(http: httpx.AsyncClient, prompt: list[int], stream: bool) -> str:
            body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": stream}
            reply = await http.post("/v1/completions", json=body)
            assert reply.status_code == 200, reply.text
            if not stream:
                return str(reply.json()["choices"][0]["text"])
            return "".join(e["choices"][0]["text"] for e in parse_sse(reply.text) if isinstance(e, dict))

        async def all_at_once() -> list[str]:
            async with httpx.AsyncClient(base_url=cluster.router.url, timeout=60) as http:
                return await asyncio.gather(*(one(http, p, i % 2 == 0) for i, p in enumerate(PROMPTS)))

        assert asyncio.run(all_at_once()) == want
        muxes = cluster.pd.parts.client._muxes
        assert len(muxes) == (1 if frame_mux else 0)  # one frame stream for all six, or none
        cluster.wait_until_idle()  # the frame stream too: closed once nothing streams on it
    finally:
        stop_cluster(cluster)


class _Service:
    """A decode service's `knows`/`stream`, each request three frames unless `hang`."""

    def __init__(self, hang: bool = False) -> None:
        self.hang = hang
        self.aborted: list[str] = []

    def knows(self, rid: str) -> bool:
        return rid.startswith("r")

    async def stream(self, rid: str) -> AsyncIterator[OutputFrame]:
        finished = False
        try:
            for n in range(3):
                await asyncio.sleep(0)
                finished = n == 2 and not self.hang
                yield OutputFrame(frame_no=n, token_ids=[n], finish_reason="length" if finished else None)
            if self.hang:
                await asyncio.Event().wait()
        finally:
            if not finished:
                self.aborted.append(rid)


def test_the_decode_side_interleaves_requests_and_ends_each_then_aborts_all_when_closed() -> None:
    async def scenario() -> tuple[dict[str, list[int]], list[str], list[str]]:
        service = _Service()
        muxes = FrameMuxes(service)  # type: ignore[arg-type]
        body = muxes.open("m")
        with pytest.raises(ValueError):
            muxes.open("m")  # one id, one stream
        muxes.attach("m", "ra")
        muxes.attach("m", "rb")
        with pytest.raises(KeyError):
            muxes.attach("m", "unknown")
        with pytest.raises(UnknownMux):
            muxes.attach("other", "ra")
        frames: dict[str, list[int]] = {}
        ended: list[str] = []
        while len(ended) < 2:
            for line in (await anext(body)).splitlines():
                rid, _, payload = line.partition(b"\t")
                if payload:
                    frames.setdefault(rid.decode(), []).append(OutputFrame.model_validate_json(payload).frame_no)
                else:
                    ended.append(rid.decode())
        hanging = _Service(hang=True)
        muxes.service = hanging  # type: ignore[assignment]
        muxes.attach("m", "rc")
        await anext(body)
        await body.aclose()  # the router went away: what still streams on it is aborted
        await asyncio.sleep(0.01)
        return frames, sorted(ended), hanging.aborted

    frames, ended, aborted = asyncio.run(scenario())
    assert frames == {"ra": [0, 1, 2], "rb": [0, 1, 2]}
    assert ended == ["ra", "rb"]
    assert aborted == ["rc"]


class _AttachingClient:
    """The router's client as `_FrameMux` calls it to attach a request: answers `status` once released."""

    def __init__(self, status: int) -> None:
        self.status = status
        self.release = asyncio.Event()
        self.answered = False

    async def _post(self, url: str, path: str) -> _Reply:
        await self.release.wait()
        self.answered = True
        return _Reply(self.status, b'{"error": {"message": "unknown request"}}' if self.status != 200 else b"{}")


def test_the_router_end_merges_the_inbox_without_waiting_for_the_attach_and_frames_land_in_it() -> None:
    async def scenario() -> None:
        client = _AttachingClient(200)
        mux = router_end(client)
        inbox: asyncio.Queue[object] = asyncio.Queue()
        items = mux.frames("r1", inbox)
        first = FirstToken(transfer_id="r1@0", token_id=5)
        inbox.put_nowait(first)
        assert await asyncio.wait_for(anext(items), 5) is first  # NOTE: the attach has not answered yet
        assert mux._queues["r1"] is inbox  # decode's frames land in the inbox itself: no task between
        client.release.set()
        for n in range(2):
            inbox.put_nowait(OutputFrame(frame_no=n, token_ids=[n]).model_dump_json().encode())
        inbox.put_nowait(b"")  # its frames ended
        assert [frame.frame_no for frame in [item async for item in items]] == [0, 1]
        assert "r1" not in mux._queues

        lost = router_end(_AttachingClient(404))
        items = lost.frames("r2", asyncio.Queue())
        lost.client.release.set()  # type: ignore[attr-defined]
        with pytest.raises(UnknownRequest):
            await asyncio.wait_for(anext(items), 5)
        assert "r2" not in lost._queues

    asyncio.run(scenario())


def test_frames_that_end_before_the_attach_answered_wait_for_its_answer_not_cut_it() -> None:
    """A short request's end can come before the attach's reply is read: the reply is still read
    (cutting it mid-read would close a kept-alive connection to decode)."""

    async def scenario() -> None:
        client = _AttachingClient(200)
        mux = router_end(client)
        queue: asyncio.Queue[object] = asyncio.Queue()
        items = mux.frames("r1", queue)
        queue.put_nowait(OutputFrame(frame_no=0, token_ids=[1], finish_reason="length").model_dump_json().encode())
        queue.put_nowait(b"")
        assert (await anext(items)).frame_no == 0
        rest = asyncio.ensure_future(anext(items))
        await asyncio.sleep(0.05)
        assert not rest.done()  # waits for the attach's answer
        client.release.set()
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(rest, 5)
        assert client.answered

    asyncio.run(scenario())


def test_a_first_token_does_not_wait_for_the_frame_stream_to_open() -> None:
    """The first request to a decode worker opens the router's frame stream: prefill's first token,
    already in the inbox, goes out while that is under way (here: a decode that never answers)."""

    async def scenario() -> None:
        silent = await asyncio.start_server(lambda reader, writer: None, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{silent.sockets[0].getsockname()[1]}"
        client = WorkerClient(timeout_s=30, frame_mux=True)
        try:
            inbox: asyncio.Queue[object] = asyncio.Queue()
            first = FirstToken(transfer_id="r1@0", token_id=5)
            inbox.put_nowait(first)
            items = client.stream_merged(url, "r1", inbox)
            assert await asyncio.wait_for(anext(items), 5) is first
            assert not client._muxes[url].opened.done()  # the frame stream is still opening
            await items.aclose()
        finally:
            await client.close()
            silent.close()

    asyncio.run(scenario())
