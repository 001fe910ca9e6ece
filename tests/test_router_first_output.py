"""The router's wait for a request's first output: a client that goes away at the very moment the
first output arrives still cancels the request (asyncio.wait_for before 3.12 swallowed that cancel
and returned the output), and the deadline still turns into a TimeoutError."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest

from pdserve.disagg.router.outputs import next_within


async def _one_output(ready: asyncio.Future[str], cleaned: list[str]) -> AsyncGenerator[str, None]:
    try:
        yield await ready
        yield "second"
    finally:
        cleaned.append("closed")


@pytest.mark.parametrize("spins", range(4))
def test_a_cancel_that_lands_with_the_first_output_is_not_swallowed(spins: int) -> None:
    """The output and the cancel land in the same loop turn, after `spins` turns of the loop
    (the race at each interleaving): the waiting task must end cancelled, the generator closed."""

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[str] = loop.create_future()
        cleaned: list[str] = []
        outputs = _one_output(ready, cleaned)
        waiter = asyncio.ensure_future(next_within(outputs, 10.0))
        for _ in range(spins):
            await asyncio.sleep(0)
        ready.set_result("first")
        await asyncio.sleep(0)  # the generator's step completes; the waiter is woken, not yet run
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await outputs.aclose()  # as PDRouter.generate does: not "already running"
        assert cleaned == ["closed"]

    asyncio.run(scenario())


def test_the_deadline_raises_timeout_and_leaves_the_generator_closable() -> None:
    async def scenario() -> None:
        ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        cleaned: list[str] = []
        outputs = _one_output(ready, cleaned)
        with pytest.raises(TimeoutError):
            await next_within(outputs, 0.05)
        await outputs.aclose()
        assert cleaned == ["closed"]

    asyncio.run(scenario())


def test_an_output_in_time_is_returned() -> None:
    async def scenario() -> None:
        ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        ready.set_result("first")
        outputs = _one_output(ready, [])
        assert await next_within(outputs, 1.0) == "first"
        assert await anext(outputs) == "second"
        await outputs.aclose()

    asyncio.run(scenario())
