"""Decode: the frames of many requests on one stream per router (`GET /pd/frames/{mux_id}`).

One HTTP stream per request costs a socket write on decode and a read on the router for every
token of every request; a step's frames of 64 streams were 64 writes and 64 reads, each waking an
event loop for one chunk. A router instead opens one frame stream (its `mux_id` its own) and
attaches each request to it (`POST /pd/stream/{rid}/via/{mux_id}`); whatever frames are ready
when the stream is written go out in one write:

    cmpl-a-0 TAB {"frame_no":3,...} NL      a frame of request cmpl-a-0 (an OutputFrame)
    cmpl-b-0 TAB {"frame_no":0,...} NL
    cmpl-a-0 TAB NL                         cmpl-a-0's frames ended (as its own stream's end would)

Each request's frames come from `DecodeService.stream`, as on its own stream: a request whose
frames end unfinished (its router gone: the stream closed) is aborted there. Closing the frame
stream ends every request attached to it the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.disagg.control import OutputFrame

SEPARATOR = b"\t"


class FrameSource(Protocol):
    """What a frame stream asks of the decode side (`DecodeService`; the router benchmark's stand-in)."""

    def knows(self, rid: str) -> bool:
        """Whether request `rid` is here (its frames can be streamed)."""

    def stream(self, rid: str) -> AsyncIterator[OutputFrame]:
        """Its frames until it ends; leaving early aborts it. KeyError: not here."""


class UnknownMux(LookupError):
    """No frame stream of that id is open here (closed, or opened on another worker)."""


@dataclass(eq=False)
class _Mux:
    lines: asyncio.Queue[bytes] = field(default_factory=asyncio.Queue)
    pumps: set[asyncio.Task[None]] = field(default_factory=set)


class FrameMuxes:
    """The frame streams routers have open on this decode worker. Event-loop only."""

    def __init__(self, service: FrameSource) -> None:
        self.service = service
        self._muxes: dict[str, _Mux] = {}

    def open(self, mux_id: str) -> AsyncIterator[bytes]:
        """A new frame stream's body (registered now, before its answer starts: a router attaches
        requests as soon as it has the answer's headers). ValueError: that id is open already."""
        if mux_id in self._muxes:
            raise ValueError(f"frame stream {mux_id!r} is open already")
        mux = self._muxes[mux_id] = _Mux()
        return self._body(mux_id, mux)

    def attach(self, mux_id: str, rid: str) -> None:
        """Stream request `rid`'s frames on `mux_id`. KeyError: no such request; UnknownMux."""
        mux = self._muxes.get(mux_id)
        if mux is None:
            raise UnknownMux(mux_id)
        if not self.service.knows(rid) or SEPARATOR in rid.encode() or "\n" in rid:
            raise KeyError(rid)
        task = asyncio.create_task(self._pump(mux, rid))
        mux.pumps.add(task)
        task.add_done_callback(mux.pumps.discard)

    async def _body(self, mux_id: str, mux: _Mux) -> AsyncIterator[bytes]:
        try:
            while True:
                chunk = [await mux.lines.get()]
                while not mux.lines.empty():
                    chunk.append(mux.lines.get_nowait())
                yield b"".join(chunk)
        finally:
            if self._muxes.get(mux_id) is mux:
                del self._muxes[mux_id]
            for pump in list(mux.pumps):  # NOTE: each request's frames end unfinished: aborted
                pump.cancel()

    async def _pump(self, mux: _Mux, rid: str) -> None:
        prefix = rid.encode() + SEPARATOR
        try:
            with contextlib.suppress(KeyError):  # NOTE: ended between attach and now: its end says so
                async for frame in self.service.stream(rid):
                    mux.lines.put_nowait(prefix + frame.model_dump_json().encode() + b"\n")
        finally:
            mux.lines.put_nowait(prefix + b"\n")
