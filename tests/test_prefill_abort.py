"""A prefill attempt aborted at any point of its life on the prefill worker (the router cancels a
job it sent unplaced once decode turns out to cache the prompt, or the client leaves): the worker's
streamed POST /pd/prefill answer still ends in full, saying the attempt was aborted, and nothing
stays held there (no engine request, no KV block, no attempt record). And the other way round: the
router's read of that answer cut short at any point: the request is still answered right, and the
attempt cut off is aborted on the prefill worker rather than left to time out there.

The abort's arrival is forced at each point of the attempt by a hook on the worker's own loop; the
one found by CI came between `submit` creating the attempt's task and that task's first step (an
asyncio task cancelled then never runs its body, its `finally` included)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import ClientPayloadError
from helpers import generate_texts, greedy, random_prompt
from pd_fixtures import Cluster, start_cluster, stop_cluster

from pdserve import LLM
from pdserve.disagg.client import WorkerClient, WorkerUnreachable
from pdserve.disagg.control import FirstToken, HandOff, PrefillJob, WireSamplingParams
from pdserve.disagg.request_ids import transfer_id
from pdserve.disagg.worker.decode_service import DecodeService
from pdserve.disagg.worker.prefill_service import PrefillService
from pdserve.engine.commands import AddPrefillOnly

pytestmark = pytest.mark.slow  # every test starts a cluster

PROMPT = random_prompt(260, seed=2)  # 17 blocks of 16 tokens on the prefill worker


def _job(request_id: str) -> PrefillJob:
    """An unplaced job, as the memory queue sends it before the decode reservation is made."""
    return PrefillJob(request_id=request_id, transfer_id=transfer_id(request_id, 0), prompt_token_ids=PROMPT,
                      params=WireSamplingParams.of(greedy(4)))


def _abort_while_submitting(prefill: PrefillService) -> None:
    """The abort comes once the engine took the job, before `submit` recorded the attempt."""
    send = prefill.client.send

    async def then_abort(command: Any, sink: Any = None) -> Any:
        result = await send(command, sink)
        if isinstance(command, AddPrefillOnly):
            await prefill.abort(command.request_id)
        return result

    prefill.client.send = then_abort  # type: ignore[method-assign]


def _abort_after_submit(prefill: PrefillService, num_yields: int) -> None:
    """The abort comes after `submit` returned the attempt's task, `num_yields` turns of the loop
    later (0: before the task took its first step)."""
    submit = prefill.submit

    async def then_abort(job: PrefillJob) -> asyncio.Task[HandOff]:
        task = await submit(job)
        for _ in range(num_yields):
            await asyncio.sleep(0)
        await prefill.abort(job.transfer_id)
        return task

    prefill.submit = then_abort  # type: ignore[method-assign]


async def _prefill(url: str, job: PrefillJob, when: str) -> tuple[HandOff | None, list[FirstToken]]:
    """POST /pd/prefill as the memory queue does (streamed answer). POST /pd/abort first when `when`
    is "before_the_job" (the two POSTs reached the worker the other way round), or as soon as the
    first token arrived when it is "awaiting_placement" (the attempt then waits for its placement)."""
    client, tokens, aborts = WorkerClient(timeout_s=30), [], []

    def on_first_token(token: FirstToken) -> None:
        tokens.append(token)
        if when == "awaiting_placement":
            aborts.append(asyncio.ensure_future(client.abort(url, job.transfer_id)))

    try:
        if when == "before_the_job":
            await client.abort(url, job.transfer_id)
        hand_off = await client.prefill(url, job, on_first_token, on_accepted=lambda: None)
        await asyncio.gather(*aborts)
        return hand_off, tokens
    finally:
        await client.close()


def _prefill_url(cluster: Cluster, prefill: PrefillService) -> str:
    return next(served.url for served, client in cluster.workers if client is prefill.client)


@pytest.mark.parametrize("when", ["before_the_job", "submitting", "before_first_step", "computing",
                                  "awaiting_placement"])
def test_an_attempt_aborted_at_any_point_answers_in_full_and_leaves_nothing(model_dirs: dict[str, Path],
                                                                            when: str) -> None:
    cluster = start_cluster(model_dirs["tiny"], "tcp", 1, 1)
    try:
        prefill: PrefillService = cluster.service(PrefillService)
        if when == "submitting":
            _abort_while_submitting(prefill)
        elif when in ("before_first_step", "computing"):
            _abort_after_submit(prefill, 0 if when == "before_first_step" else 1)
        job = _job(f"abort-{when}")
        hand_off, tokens = asyncio.run(_prefill(_prefill_url(cluster, prefill), job, when))
        assert hand_off is not None and hand_off.status == "aborted", hand_off
        assert hand_off.transfer_id == job.transfer_id
        assert len(tokens) == (1 if when == "awaiting_placement" else 0), tokens  # NOTE: computed to its end only there
        cluster.wait_until_idle()
        assert prefill.num_in_flight == 0
        assert prefill.stats().aborted == 1 and prefill.stats().handed_off == 0, prefill.stats()
    finally:
        stop_cluster(cluster)


def _cut_the_first_answer(client: WorkerClient, point: str) -> list[str]:
    """The router's read of its first POST /pd/prefill answer fails at `point` ("accepted": the
    answer started; "first_token": its first line came), as a connection lost there does. Returns
    the transfer ids of the jobs whose answer was cut."""
    prefill, cut = client.prefill, []

    async def cut_once(url: str, job: PrefillJob, on_first_token: Any = None, on_accepted: Any = None) -> Any:
        if cut:
            return await prefill(url, job, on_first_token, on_accepted)
        reached = asyncio.get_running_loop().create_future()

        def accepted() -> None:
            if on_accepted is not None:
                on_accepted()
            if point == "accepted" and not reached.done():
                reached.set_result(None)

        def first_token(token: FirstToken) -> None:
            if on_first_token is not None:
                on_first_token(token)
            if point == "first_token" and not reached.done():
                reached.set_result(None)

        call = asyncio.ensure_future(prefill(url, job, first_token, accepted))
        await asyncio.wait((call, reached), return_when=asyncio.FIRST_COMPLETED)
        if call.done() and not reached.done():
            return call.result()
        # NOTE: on a loaded machine the whole answer can arrive in one read, so the call may be done
        # too; the read is cut all the same (the worker already answered: it handed off or aborts)
        call.cancel()  # NOTE: closes the connection, as the worker sees a router that went away
        cut.append(job.transfer_id)
        raise WorkerUnreachable(url, ClientPayloadError("Response payload is not completed"))

    client.prefill = cut_once  # type: ignore[method-assign]
    return cut


@pytest.mark.parametrize("point", ["accepted", "first_token"])
def test_a_job_answer_cut_short_still_answers_the_request_and_aborts_the_attempt(model_dirs: dict[str, Path],
                                                                                 colocated: LLM, point: str) -> None:
    cluster = start_cluster(model_dirs["tiny"], "tcp", 1, 1)
    try:
        prefill: PrefillService = cluster.service(PrefillService)
        cut = _cut_the_first_answer(cluster.pd.client, point)
        body = {"prompt": PROMPT, "max_tokens": 6, "ignore_eos": True, "temperature": 0}
        reply = httpx.post(f"{cluster.router.url}/v1/completions", json=body, timeout=60)
        assert len(cut) == 1, cut
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == generate_texts(colocated, [PROMPT], greedy(6))[0]
        cluster.wait_until_idle()
        stats = prefill.stats()
        # NOTE: the attempt cut off is aborted there (superseded by a retry, or by decode prefilling it
        # when the cut left no prefill worker in the pool until its next poll, or after its KV had
        # reached decode: the abort came while it waited for decode's acknowledgement), or it handed
        # off itself; it never waits out its placement timeout (cut before its placement: 5 s), which
        # counts as failed
        assert stats.failed == 0 and stats.in_flight == 0 and stats.handed_off + stats.aborted >= 1, stats
    finally:
        stop_cluster(cluster)


def _start_late(prefill: PrefillService, nth: int) -> list[str]:
    """The task of the `nth` attempt (1 first) starts only once the router's abort of it came, as on
    a loaded worker where both POSTs are read in one turn of the loop. Returns the aborts heard."""
    finish, abort, aborts, starts = prefill._finish, prefill.abort, [], []
    came = asyncio.Event()

    async def noted(transfer_id: str) -> None:
        await abort(transfer_id)
        aborts.append(transfer_id)
        came.set()

    async def late(tid: str, stream: Any) -> HandOff:
        starts.append(tid)
        if len(starts) == nth:
            await asyncio.wait_for(came.wait(), 30)
        return await finish(tid, stream)

    prefill.abort = noted  # type: ignore[method-assign]
    prefill._finish = late  # type: ignore[method-assign]
    return aborts


def test_the_router_cancels_a_job_before_its_attempt_started_and_nothing_is_left(
        model_dirs: dict[str, Path], colocated: LLM, caplog: pytest.LogCaptureFixture) -> None:
    """CI's case (tests/test_router_admission.py::test_short_uncached_rest_is_prefilled_on_decode):
    the second long prompt's job goes out unplaced, decode then caches all but 4 tokens of it, so
    the router cancels the job and prefills on decode; its abort reaches prefill before the
    attempt's task started."""
    cluster = start_cluster(model_dirs["tiny"], "tcp", 1, 1, pd_threshold=64)
    short, long = random_prompt(40, seed=1), PROMPT
    try:
        prefill: PrefillService = cluster.service(PrefillService)
        aborts = _start_late(prefill, 2)
        with httpx.Client(base_url=cluster.router.url, timeout=60) as http:
            for prompt in (short, long, long):
                reply = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "ignore_eos": True,
                                                           "temperature": 0})
                assert reply.status_code == 200, reply.text
                assert reply.json()["choices"][0]["text"] == generate_texts(colocated, [prompt], greedy(6))[0]
        assert len(aborts) == 1, aborts
        assert cluster.pd.stats().events.prefilled_on_decode == 2
        assert cluster.service(DecodeService).stats().prefilled_locally == 2
        cluster.wait_until_idle()
        stats = prefill.stats()
        assert (stats.handed_off, stats.aborted, stats.failed, stats.in_flight) == (1, 1, 0, 0), stats
        assert "unreachable" not in caplog.text  # NOTE: its answer ended in full: the router kept the worker
    finally:
        stop_cluster(cluster)
