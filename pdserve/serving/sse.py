"""Server-sent events framing and the non-streaming disconnect watch."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from http import HTTPStatus
from typing import Any, TypeVar

from fastapi import Request

from pdserve.serving.errors import ClientDisconnected, OpenAIError, error_body

T = TypeVar("T")
_DISCONNECT_POLL_S = 0.1


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def sse_stream(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """Frame chunks as SSE and end with [DONE]. An error after the response has started cannot
    change the status code any more, so it goes in-band as an error object, then [DONE]."""
    try:
        async for chunk in chunks:
            yield sse(chunk)
    except OpenAIError as exc:
        yield sse(error_body(exc.message, exc.status, exc.param))
    except Exception as exc:  # noqa: BLE001 - the client must still get a terminated stream
        yield sse(error_body(f"internal error: {exc}", HTTPStatus.INTERNAL_SERVER_ERROR))
    yield "data: [DONE]\n\n"


async def started(request: Request, chunks: AsyncIterator[T]) -> AsyncIterator[T]:
    """`chunks` with its first item already produced (or its error raised), watching for a client
    that leaves meanwhile (a request may wait in a queue before its first token)."""

    async def first() -> list[T]:
        """[] when `chunks` is empty, else [its first item]."""
        try:
            return [await anext(chunks)]
        except StopAsyncIteration:
            return []

    head = await unless_disconnected(request, first())

    async def rest() -> AsyncIterator[T]:
        if head:
            yield head[0]
            async for chunk in chunks:
                yield chunk

    return rest()


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (which aborts its engine requests) if the client goes away.

    Raises ClientDisconnected then, not CancelledError: this task itself was not cancelled, and a
    CancelledError escaping the endpoint reaches uvicorn as "Exception in ASGI application"."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise ClientDisconnected()
    finally:
        if not task.done():
            task.cancel()
