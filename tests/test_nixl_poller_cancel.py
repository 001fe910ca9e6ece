"""The NIXL I/O thread's poll loop must end when cancelled, whatever its pause is doing. Its quiet
pause used `asyncio.wait_for`, which before Python 3.12 swallows a cancel that comes just as the
wait ends (woken, or timed out): the loop then polled on, and a sender's close waited forever for
its cancelled poll task (`IoThread.stop`; CI once hung 600 s in a NIXL test's teardown)."""

from __future__ import annotations

import asyncio

from pdserve.disagg.transport.nixl.agent import Poller


async def _poll_loop(poller: Poller) -> None:
    while True:
        await poller.pause(0, False, None, expecting=False)


def test_a_quiet_pause_cancelled_as_it_is_woken_ends_the_loop() -> None:
    async def main() -> list[int]:
        swallowed = []
        for turns in range(8):  # NOTE: the cancel lands 0-7 loop turns after the wake, one of them as it ends
            poller = Poller()
            poller._quiet_after = 0.0  # past its warm-up: the quiet pause
            task = asyncio.create_task(_poll_loop(poller))
            await asyncio.sleep(0.005)  # in the quiet pause now
            poller.wake()
            for _ in range(turns):
                await asyncio.sleep(0)
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if not done:
                swallowed.append(turns)
                task.cancel()
                await asyncio.wait({task}, timeout=0.5)
        return swallowed

    assert asyncio.run(main()) == [], "the poll loop went on after its cancel"
