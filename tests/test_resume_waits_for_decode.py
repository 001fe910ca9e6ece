"""A resumed run waits for a decode worker until the reservation deadline, whatever ended the run
before (a lost decode worker, or a failed attempt, which excludes none); a new run gets a 503 at
once when no decode worker is ready. CI once saw a stream end with "no decode worker is ready"
in-band: its attempt failed (excluding no worker) while the only decode worker was restarting."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from pdserve.disagg.config import RouterConfig
from pdserve.disagg.router.errors import RouterError
from pdserve.disagg.router.request_run import RequestRun, RouterParts
from pdserve.engine.sampling_params import SamplingParams


def _parts(ready: list[Any], deadline_s: float, expected_back: bool = False) -> RouterParts:
    def reject(reason: str, message: str) -> None:
        raise RouterError(reason, message)

    async def order(candidates: list[Any], prompt: list[int], root: bytes = b"") -> list[Any]:
        return candidates

    async def reserve(url: str, request: Any) -> str:
        return f"reserved on {url}"

    pool = SimpleNamespace(ready=lambda role: list(ready), expected_back=lambda role: expected_back and not ready)
    return RouterParts(RouterConfig(reserve_deadline_s=deadline_s, restart_window_s=2.0), None, 64,  # type: ignore[arg-type]
                       100, pool, SimpleNamespace(order=order), None,
                       SimpleNamespace(reserve=reserve), SimpleNamespace(reject=reject), None, None)


def test_a_resume_with_no_decode_worker_excluded_waits_for_one_to_come_back() -> None:
    async def main() -> tuple[Any, Any]:
        ready: list[Any] = []
        run = RequestRun(_parts(ready, 5.0), "r", [1, 2, 3], SamplingParams(max_tokens=4), resume=1)
        worker = SimpleNamespace(url="http://decode", info=None, in_flight=0)
        asyncio.get_running_loop().call_later(0.3, ready.append, worker)
        return worker, await asyncio.wait_for(run._reserve(set()), 3.0)

    worker, (got, reply) = asyncio.run(main())
    assert got is worker and reply == "reserved on http://decode" and worker.in_flight == 1


def test_a_new_run_with_no_decode_worker_is_refused_at_once() -> None:
    async def main() -> None:
        run = RequestRun(_parts([], 5.0), "r", [1, 2, 3], SamplingParams(max_tokens=4))
        await asyncio.wait_for(run._reserve(set()), 1.0)

    with pytest.raises(RouterError, match="no decode worker is ready"):
        asyncio.run(main())


def test_a_resume_gives_up_at_the_deadline() -> None:
    async def main() -> None:
        run = RequestRun(_parts([], 0.2), "r", [1, 2, 3], SamplingParams(max_tokens=4), resume=1)
        await asyncio.wait_for(run._reserve(set()), 2.0)

    with pytest.raises(RouterError, match="no decode worker is ready"):
        asyncio.run(main())


def test_a_new_run_waits_for_a_decode_worker_expected_back_within_the_restart_window() -> None:
    async def main() -> tuple[Any, Any]:
        ready: list[Any] = []
        run = RequestRun(_parts(ready, 5.0, expected_back=True), "r", [1, 2, 3], SamplingParams(max_tokens=4))
        worker = SimpleNamespace(url="http://decode", info=None, in_flight=0)
        asyncio.get_running_loop().call_later(0.3, ready.append, worker)
        return worker, await asyncio.wait_for(run._reserve(set()), 3.0)

    worker, (got, _) = asyncio.run(main())
    assert got is worker


def test_a_new_run_gives_up_at_the_end_of_the_restart_window() -> None:
    async def main() -> float:
        run = RequestRun(_parts([], 30.0, expected_back=True), "r", [1, 2, 3], SamplingParams(max_tokens=4))
        start = asyncio.get_running_loop().time()
        with pytest.raises(RouterError, match="no decode worker is ready"):
            await asyncio.wait_for(run._reserve(set()), 5.0)
        return asyncio.get_running_loop().time() - start

    assert 1.9 < asyncio.run(main()) < 4.0  # the 2 s window, not the 30 s reserve deadline
