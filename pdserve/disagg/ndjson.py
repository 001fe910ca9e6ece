"""NDJSON, the workers' streamed answers (one JSON document a line: a decode stream's OutputFrames,
a frame stream's tagged frames, POST /pd/prefill's PrefillEvents), read with aiohttp on the router's side."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp

NDJSON = "application/x-ndjson"
# `read_to_the_end`: what is left of an answer after its last line, at most this long (a caller waits
# for it; missing it costs one new connection)
_READ_TO_THE_END_S = 0.2


async def lines(response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The lines of an NDJSON answer, however long (aiohttp's own line reader stops at 64 KiB)."""
    pending = b""
    async for chunk in response.content.iter_any():
        pending += chunk
        *complete, pending = pending.split(b"\n")
        for line in complete:
            yield line
    if pending:
        yield pending


async def read_to_the_end(response: aiohttp.ClientResponse) -> None:
    """Read what is left of an answer whose last line was read (its chunked end follows at once),
    so aiohttp keeps the connection for the next call: left unread, aiohttp closes it, and every
    prefill job opened a new connection (112 connects for 128 jobs). A worker that sends more, or
    late, is given up on (its connection then closed, as before); nothing here fails the call.
    NOTE: the caller's line reader (`lines`) is paused at a yield, not in a read, when this runs."""
    with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
        async with asyncio.timeout(_READ_TO_THE_END_S):
            await response.content.read()
