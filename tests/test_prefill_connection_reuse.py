"""The router's POST /pd/prefill keeps its connection (disagg/client.py `WorkerClient.prefill`,
disagg/ndjson.py `read_to_the_end`): the answer's last line (the hand-off) is followed by its
chunked end, which is read, so aiohttp returns the connection to its pool instead of closing it.
Before, every prefill job opened a new TCP connection to its prefill worker."""

from __future__ import annotations

import asyncio

from aiohttp import web

from pdserve.disagg.client import WorkerClient
from pdserve.disagg.control import FirstToken, HandOff, PrefillEvent, PrefillJob, WireSamplingParams
from pdserve.disagg.ndjson import NDJSON


async def _serve(peers: list[object], trailing: bytes = b"") -> tuple[web.AppRunner, str]:
    async def prefill(request: web.Request) -> web.StreamResponse:
        job = PrefillJob.model_validate_json(await request.read())
        peers.append(request.transport.get_extra_info("peername"))  # type: ignore[union-attr]
        response = web.StreamResponse(headers={"content-type": NDJSON})
        await response.prepare(request)
        await response.write(PrefillEvent(first_token=FirstToken(transfer_id=job.transfer_id, token_id=7))
                             .model_dump_json().encode() + b"\n")
        await response.write(PrefillEvent(hand_off=HandOff(transfer_id=job.transfer_id, status="handed_off"))
                             .model_dump_json().encode() + b"\n")
        # NOTE: the end comes in a write of its own a moment later, as uvicorn's does once the events'
        # generator returns: a client that returns on the hand-off line has not read it yet
        await asyncio.sleep(0.05)
        if trailing:  # a worker that keeps talking after its last line: given up on, the call still succeeds
            await asyncio.sleep(3.0)
            await response.write(trailing)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/pd/prefill", prefill)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


def _job(i: int) -> PrefillJob:
    return PrefillJob(request_id=f"r{i}", transfer_id=f"r{i}@1", prompt_token_ids=[1, 2, 3],
                      params=WireSamplingParams(fields={}))


def test_prefill_jobs_one_after_another_share_one_connection() -> None:
    async def main() -> list[object]:
        peers: list[object] = []
        runner, url = await _serve(peers)
        client = WorkerClient()
        try:
            for i in range(5):
                firsts: list[FirstToken] = []
                hand_off = await client.prefill(url, _job(i), on_first_token=firsts.append)
                assert hand_off is not None and hand_off.transfer_id == f"r{i}@1" and firsts[0].token_id == 7
        finally:
            await client.close()
            await runner.cleanup()
        return peers

    peers = asyncio.run(main())
    assert len(peers) == 5 and len(set(peers)) == 1, peers  # one client port: one connection


def test_a_worker_that_talks_past_its_hand_off_is_left_and_the_call_succeeds() -> None:
    async def main() -> float:
        runner, url = await _serve([], trailing=b'{"more": true}\n')
        client = WorkerClient()
        try:
            started = asyncio.get_running_loop().time()
            hand_off = await client.prefill(url, _job(0), on_first_token=lambda token: None)
            assert hand_off is not None and hand_off.status == "handed_off"
            return asyncio.get_running_loop().time() - started
        finally:
            await client.close()
            await runner.cleanup()

    assert asyncio.run(main()) < 2.0  # given up on after 0.2 s, not waited for (3 s)
