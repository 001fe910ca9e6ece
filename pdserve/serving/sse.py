"""Server-sent events framing (and chunks' JSON written without encoding what every chunk of a
stream repeats) and the non-streaming disconnect watch."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from http import HTTPStatus
from json.encoder import encode_basestring
from typing import Any, TypeVar

from fastapi import Request

from pdserve.serving.errors import ClientDisconnected, OpenAIError, error_body

T = TypeVar("T")
_DISCONNECT_POLL_S = 0.1


def to_json(value: Any) -> str:
    """`json.dumps(value, ensure_ascii=False)`, its two commonest cases (null, a string) short:
    `encode_basestring` is the (C) function json.dumps writes a string with then."""
    if value is None:
        return "null"
    if type(value) is str:
        return encode_basestring(value)
    return json.dumps(value, ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class ChunkJson:
    """One stream's chunks as JSON text, the same text `json.dumps(chunk, ensure_ascii=False)`
    writes for `{"id", "object", "created", "model", "choices"}`, with the four fields every
    chunk repeats encoded once (`head`: that text up to the choices' list)."""

    head: str

    @classmethod
    def of(cls, request_id: str, kind: str, created: int, model: str) -> ChunkJson:
        fields = json.dumps({"id": request_id, "object": kind, "created": created, "model": model},
                            ensure_ascii=False)
        return cls(fields[:-1] + ', "choices": ')

    def chunk(self, choices_json: str) -> str:
        """The chunk whose choices' list is `choices_json` (JSON text, written as json.dumps would)."""
        return f"{self.head}{choices_json}}}"

    def usage(self, usage: dict[str, Any]) -> str:
        """The last chunk (`stream_options.include_usage`): no choices, the request's `usage`."""
        return f'{self.head}[], "usage": {to_json(usage)}}}'


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def sse_stream(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """Frame chunks (each its JSON text, see `ChunkJson`) as SSE and end with [DONE]. An error
    after the response has started cannot change the status code any more, so it goes in-band as
    an error object, then [DONE]."""
    try:
        async for chunk in chunks:
            yield f"data: {chunk}\n\n"
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
