"""The router sends a prefill job before the decode reservation is made, and places it once it is
(POST /pd/place): prefill computes meanwhile and sends what it computed when it learns where. The
output must not depend on when the placement comes, and a request that never gets its reservation
must leave nothing behind on the prefill worker."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import generate_texts, random_prompt
from pd_fixtures import start_cluster, stop_cluster

from pdserve import LLM, SamplingParams
from pdserve.disagg.control import Placement
from pdserve.disagg.transport import nixl_available
from pdserve.disagg.worker.decode_service import DecodeService
from pdserve.disagg.worker.prefill_service import PrefillService
from pdserve.engine.commands import PlaceKV

pytestmark = pytest.mark.slow  # every test starts a cluster

PROMPTS = [random_prompt(n, seed=7000 + n) for n in (3, 130)]
MAX_TOKENS = 8
_NO_NIXL = pytest.mark.skipif(not nixl_available(), reason="nixl_cu12 is not installed")


def _delay_reservations(service: DecodeService, delay_s: float) -> None:
    reserve = service.reserve

    async def slow(body: Any) -> Any:
        await asyncio.sleep(delay_s)
        return await reserve(body)

    service.reserve = slow  # type: ignore[method-assign]


def _note_placements(service: PrefillService, computed: list[tuple[int, int]]) -> None:
    """Each placement: (prompt tokens the prefill engine had computed when it came, prompt tokens)."""
    place = service.place

    async def noted(placement: Placement) -> None:
        request = service.client.engine.prefill_request(placement.transfer_id)
        if request is not None:
            computed.append((request.num_computed_tokens, request.num_prompt_tokens))
        await place(placement)

    service.place = noted  # type: ignore[method-assign]


@pytest.mark.parametrize("transport", ["tcp", pytest.param("nixl", marks=_NO_NIXL)])
def test_a_job_placed_after_prefill_computed_it_hands_off_the_same_kv(model_dirs: dict[str, Path], colocated: LLM,
                                                                      transport: str) -> None:
    cluster = start_cluster(model_dirs["tiny"], transport, 1, 1)
    computed: list[tuple[int, int]] = []
    try:
        [decode] = [s for s in cluster.services if isinstance(s, DecodeService)]
        [prefill] = [s for s in cluster.services if isinstance(s, PrefillService)]
        _delay_reservations(decode, 0.5)  # far longer than the prefill of either prompt here
        _note_placements(prefill, computed)
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        want = generate_texts(colocated, PROMPTS, params)
        with httpx.Client(base_url=cluster.router.url, timeout=60) as http:
            for prompt, text in zip(PROMPTS, want, strict=True):
                for stream in (False, True):
                    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
                    if not stream:
                        reply = http.post("/v1/completions", json=body)
                        assert reply.status_code == 200, reply.text
                        assert reply.json()["choices"][0]["text"] == text
                        continue
                    with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as response:
                        assert response.status_code == 200
                        chunks = [line for line in response.iter_lines() if line.startswith("data: {")]
                    assert "".join(httpx.Response(200, content=c[6:]).json()["choices"][0]["text"]
                                   for c in chunks) == text
        # every placement came once the whole prompt was computed: its KV went at the placement
        assert len(computed) == 2 * len(PROMPTS) and all(done == total for done, total in computed), computed
        cluster.wait_until_idle()
    finally:
        stop_cluster(cluster)


@pytest.mark.parametrize("delay_s", [0.4, 2.5])
def test_a_slow_reservation_is_waited_for_not_retried(model_dirs: dict[str, Path], colocated: LLM,
                                                      delay_s: float) -> None:
    """The placement has a deadline of its own (`placement_timeout_s`, 1 s), not the 100-ms transfer
    timeout: a decode reservation that takes 0.4 s under load is waited for. One that takes longer
    than the placement timeout too (2.5 s; the first placement has no history to scale it by) is
    waited for while the router that pushed the job still holds its stream open. Either way the
    first attempt hands off (before: a timeout on prefill, counted, and the prompt computed again)."""
    cluster = start_cluster(model_dirs["tiny"], "tcp", 1, 1, timeout_s=0.1)
    try:
        [decode] = [s for s in cluster.services if isinstance(s, DecodeService)]
        [prefill] = [s for s in cluster.services if isinstance(s, PrefillService)]
        assert prefill.placement_timeout_s == 1.0
        _delay_reservations(decode, delay_s)
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        [want] = generate_texts(colocated, [PROMPTS[1]], params)
        with httpx.Client(base_url=cluster.router.url, timeout=60) as http:
            reply = http.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": MAX_TOKENS,
                                                       "temperature": 0, "ignore_eos": True})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == want
        stats = prefill.stats()
        assert (stats.handed_off, stats.failed, stats.timed_out) == (1, 0, 0), stats
        cluster.wait_until_idle()
    finally:
        stop_cluster(cluster)


def test_an_unplaced_job_whose_router_left_times_out_at_the_placement_timeout(model_dirs: dict[str, Path]) -> None:
    """The router's stream of an unplaced job closes (the router is gone) and no placement comes:
    prefill does not wait the held-open bound for it, it ends the attempt at the placement timeout."""
    from pdserve.disagg.run_parts import prefill_job

    cluster = start_cluster(model_dirs["tiny"], "tcp", 1, 1, timeout_s=0.1)
    try:
        [prefill] = [s for s in cluster.services if isinstance(s, PrefillService)]
        [(served, _)] = [(w, e) for (w, e), s in zip(cluster.workers, cluster.services, strict=True)
                         if isinstance(s, PrefillService)]
        job = prefill_job(cluster.pd.client.secret, "gone-router", random_prompt(40, seed=5),
                          SamplingParams(max_tokens=4), None)
        headers = {"content-type": "application/json", "accept": "application/x-ndjson"}
        with httpx.Client(base_url=served.url, timeout=10) as http, \
                http.stream("POST", "/pd/prefill", content=job.model_dump_json(), headers=headers) as r:
            assert r.status_code == 200
            next(r.iter_lines())  # the first token: prefill computed it; then the router "goes"
        start = time.monotonic()
        while prefill.num_in_flight and time.monotonic() - start < 10:
            time.sleep(0.05)
        assert prefill.num_in_flight == 0 and time.monotonic() - start < 5
        assert prefill.stats().timed_out == 1
    finally:
        stop_cluster(cluster)


def test_a_request_that_gets_no_reservation_leaves_nothing_on_the_prefill_worker(model_dirs: dict[str, Path]
                                                                                 ) -> None:
    """Decode has room for no prompt this long (its pool is 4 blocks): the client gets the error, and
    the prefill job sent before the reservation was tried is cancelled, its blocks freed."""
    cluster = start_cluster(model_dirs["tiny"], "tcp", 1, 1, decode_kv_blocks=4, reserve_deadline_s=0.5)
    try:
        [decode] = [s for s in cluster.services if isinstance(s, DecodeService)]
        _delay_reservations(decode, 0.3)  # NOTE: prefill has the job by the time the reservation fails
        with httpx.Client(base_url=cluster.router.url, timeout=60) as http:
            reply = http.post("/v1/completions", json={"prompt": random_prompt(200, seed=3), "max_tokens": 4})
        assert reply.status_code in (400, 503), reply.text
        assert reply.json()["error"]["message"]
        cluster.wait_until_idle()
        [prefill] = [s for s in cluster.services if isinstance(s, PrefillService)]
        assert prefill.num_in_flight == 0
    finally:
        stop_cluster(cluster)


def test_an_attempt_that_ends_while_it_is_placed_is_a_404_and_the_request_goes_on(model_dirs: dict[str, Path],
                                                                                  colocated: LLM) -> None:
    """The attempt ends (an abort) after the engine took its placement, before POST /pd/place
    answered: prefill answers 404 (the attempt is not running here), never a 500; the router
    retries the request, which gets the colocated answer; nothing is left behind."""
    cluster = start_cluster(model_dirs["tiny"], "tcp", 1, 1)
    try:
        [decode] = [s for s in cluster.services if isinstance(s, DecodeService)]
        [prefill] = [s for s in cluster.services if isinstance(s, PrefillService)]
        _delay_reservations(decode, 0.3)  # NOTE: the job is sent unplaced, placed after prefill computed it
        send, aborted, answers = prefill.client.send, [], []

        async def abort_once_placed(command: Any, sink: Any = None) -> Any:
            result = await send(command, sink)
            if isinstance(command, PlaceKV) and not aborted:
                aborted.append(command.request_id)
                await prefill.abort(command.request_id)
                await asyncio.sleep(0.2)  # the attempt's task ends (its blocks released) meanwhile
            return result

        place = prefill.place

        async def noted(placement: Placement) -> None:
            try:
                await place(placement)
            except Exception as exc:
                answers.append(type(exc).__name__)
                raise

        prefill.client.send = abort_once_placed  # type: ignore[method-assign]
        prefill.place = noted  # type: ignore[method-assign]
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        [want] = generate_texts(colocated, PROMPTS[1:], params)
        body = {"prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        reply = httpx.post(f"{cluster.router.url}/v1/completions", json=body, timeout=60)
        assert aborted and answers[:1] == ["KeyError"], (aborted, answers)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == want
        cluster.wait_until_idle()
        assert prefill.num_in_flight == 0
    finally:
        stop_cluster(cluster)


def test_a_placement_that_fails_on_the_prefill_worker_is_retried_not_a_500(model_dirs: dict[str, Path],
                                                                          colocated: LLM) -> None:
    """POST /pd/place answers 500 (a bug on the prefill worker): the router resumes the request
    (the job is lost there) instead of handing the client the worker's 500."""
    cluster = start_cluster(model_dirs["tiny"], "tcp", 1, 1)
    try:
        [decode] = [s for s in cluster.services if isinstance(s, DecodeService)]
        [prefill] = [s for s in cluster.services if isinstance(s, PrefillService)]
        _delay_reservations(decode, 0.3)
        place, failed = prefill.place, []

        async def broken_once(placement: Placement) -> None:
            if not failed:
                failed.append(placement.transfer_id)
                raise RuntimeError("a bug")
            await place(placement)

        prefill.place = broken_once  # type: ignore[method-assign]
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        [want] = generate_texts(colocated, PROMPTS[1:], params)
        body = {"prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        reply = httpx.post(f"{cluster.router.url}/v1/completions", json=body, timeout=60)
        assert failed and reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == want
        cluster.wait_until_idle()
    finally:
        stop_cluster(cluster)
