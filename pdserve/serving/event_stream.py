"""Writing a streamed response: the events its iterator has ready together go out in one write.

A router relaying decode's frames gets them in bursts (one socket read holds several frames of a
stream); each becomes an SSE event, and one `send` per event (the ASGI `send` chain, then a write
to the client's socket) was a quarter of the router's CPU per streamed chunk. Here the events an
iterator produces without waiting are joined into one body message, and the batch is sent the
moment the iterator would wait: no event is ever held back for a later one.

"Produced without waiting" is found out by running the iterator's next step by hand
(`step.send(None)`): it either finishes (the item was ready) or suspends on a future. A suspended
step is then run on by `_finish` exactly as the task would have (wait for that future, resume the
step, throw into it what interrupted the wait, a client that left for one), so the generators
below see the same waits, cancellations and clean-ups as when the task drives them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar, cast

from starlette.responses import StreamingResponse
from starlette.types import Send

T = TypeVar("T")
_MAX_BATCH = 64  # events per write at most: an iterator that never waits still gets its events out


class EventStreamResponse(StreamingResponse):
    """`text/event-stream` of `events` (each a complete SSE event), the events ready together in
    one body message. Disconnects are watched as by `StreamingResponse` (its `__call__`)."""

    def __init__(self, events: AsyncIterator[str]) -> None:
        super().__init__(events, media_type="text/event-stream")
        self.events = events

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})

        async def write(events: list[str]) -> None:
            await send({"type": "http.response.body", "body": "".join(events).encode(), "more_body": True})

        await write_batches(self.events, write)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def write_batches(items: AsyncIterator[T], write: Callable[[list[T]], Awaitable[None]]) -> None:
    """`write` each run of `items` that were ready together (at most _MAX_BATCH), in order, until
    `items` ends. An exception from `items` propagates (after what was ready before it); one from
    `write` while the next step is suspended is thrown into that step first (so `items` is cleaned
    up, as a cancelled task's is)."""
    batch: list[T] = []
    while True:
        step = _coroutine(items.__anext__())
        try:
            waits_on = step.send(None)
        except StopIteration as produced:  # ready without waiting
            batch.append(produced.value)
            if len(batch) >= _MAX_BATCH:
                batch = await _written(write, batch)
            continue
        except StopAsyncIteration:
            break
        except BaseException:
            await _written(write, batch)  # NOTE: as one event at a time would have sent them
            raise
        batch = await _written(write, batch, step)  # NOTE: the step waits: what is ready goes out now
        try:
            batch.append(await _finish(step, waits_on))
        except StopAsyncIteration:
            break
    await _written(write, batch)


async def _written(write: Callable[[list[T]], Awaitable[None]], batch: list[T],
                   suspended: Coroutine[Any, Any, T] | None = None) -> list[T]:
    """`write(batch)` unless it is empty; a new batch. Should the write fail, `suspended` (the
    iterator's next step, begun) gets the exception first."""
    if batch:
        try:
            await write(batch)
        except BaseException as exc:
            if suspended is not None:
                await _abandon(suspended, exc)
            raise
    return []


def _coroutine(step: Awaitable[T]) -> Coroutine[Any, Any, T]:
    """An async generator's step is a coroutine (`send`, `throw`); any other awaitable is made one."""
    if isinstance(step, Coroutine):
        return step

    async def awaited() -> T:
        return await step

    return awaited()


async def _finish(step: Coroutine[Any, Any, T], waits_on: Any, thrown: BaseException | None = None) -> T:
    """Run `step`, suspended on `waits_on` (a future, or None: it only let others run), to its end
    as its task would: await what it waits on, then resume it with the outcome; an exception that
    interrupts the wait (this task cancelled) is thrown into it. `thrown`: throw this first."""
    while True:
        if thrown is None:
            try:
                if waits_on is None:
                    await asyncio.sleep(0)
                else:
                    # NOTE: as a task takes a yielded future (the step marked it "blocking"; awaiting
                    # a pending future so marked is an error); its result is read by the step
                    waits_on._asyncio_future_blocking = False
                    await waits_on
            except BaseException as exc:  # noqa: BLE001 - the step's to handle, as under its task
                thrown = exc
        try:
            waits_on = step.send(None) if thrown is None else step.throw(thrown)
        except StopIteration as done:
            return cast(T, done.value)
        thrown = None


async def _abandon(step: Coroutine[Any, Any, Any], exc: BaseException) -> None:
    """End a suspended `step` whose consumer stopped with `exc`: throw `exc` into it and let it
    clean up (the engine requests under it are aborted there); what it raises then is `exc`'s."""
    with contextlib.suppress(Exception, asyncio.CancelledError):
        await _finish(step, None, exc)
