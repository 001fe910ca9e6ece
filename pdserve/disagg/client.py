"""The one client of the workers' `/pd/*` control API (routes: worker/app.py's docstring; bodies:
control.py's models). The router, the in-memory queue, the Redis queue consumer and prefill
keepalives all talk to workers through it, so a route's URL and status codes are spelled once.

Every method raises `WorkerUnreachable` when the worker does not answer (connection refused or
reset, timeout, a stream cut short); what each status means is mapped per method to a result or
to `WorkerRefused` (an error whose status and message must reach the client) or `UnknownRequest`.
No aiohttp type leaves this module. With a cluster secret every call is signed (auth.py); a worker
that refuses the signature answers 401, which maps like any other refusal.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import aiohttp
from pydantic import BaseModel, ValidationError
from yarl import URL

from pdserve.disagg.auth import ClusterSecret, signature_headers
from pdserve.disagg.control import (
    FailJob,
    FirstToken,
    HandOff,
    Keepalive,
    KeepaliveReply,
    OutputFrame,
    Placement,
    PrefillEvent,
    PrefillJob,
    PrefixQuery,
    PrefixReply,
    ReserveReply,
    ReserveRequest,
    Retarget,
    WorkerInfo,
)
from pdserve.disagg.ndjson import NDJSON, lines, read_to_the_end
from pdserve.serving.errors import DRAINING_HEADER

_INFO_TIMEOUT_S = 2.0
_MUX_IDLE_S = 1.0  # a frame stream with no request on it this long is closed (opened again when needed)


class WorkerError(Exception):
    """A control call to a worker that did not do what was asked."""


class WorkerUnreachable(WorkerError):
    """The worker did not answer (or, for GET /pd/info, answered nothing usable)."""

    def __init__(self, url: str, cause: Exception) -> None:
        super().__init__(f"{url}: {cause!r}")
        self.url = url
        self.cause = cause

    @property
    def reason(self) -> str:
        return str(self.cause) or type(self.cause).__name__


class WorkerDraining(WorkerError):
    """The worker answered 503 and said it is draining (`DRAINING_HEADER`): nothing new for it."""


class WorkerRefused(WorkerError):
    """The worker refused the call for a reason the client must see (its status and message)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class UnknownRequest(WorkerError):
    """The worker does not know this request (finished, aborted, or never there)."""


class WorkerClient:
    """Typed calls to one worker at a time, by base URL. `timeout_s` bounds every call (None: a
    call may take as long as the work does, e.g. POST /pd/prefill answers once the hand-off
    ended); `connect_timeout_s` bounds connecting (default: `timeout_s`); `secret` signs every call.

    Over aiohttp, whose client costs a third of httpx's per call (0.6 against 1.7 ms a round trip
    on loopback here): two or three calls lie on every PD request's path to its first token. Its
    session (a pool of kept-alive connections, no limit: every decode stream holds one) is made on
    the first call, on the loop that makes it, and made again should a later call come from another."""

    def __init__(self, timeout_s: float | None = None, connect_timeout_s: float | None = None,
                 secret: ClusterSecret | None = None, frame_mux: bool = False) -> None:
        connect = timeout_s if connect_timeout_s is None else connect_timeout_s
        self.secret = secret
        self.frame_mux = frame_mux  # `stream` through one frame stream per worker (_FrameMux)
        self._muxes: dict[str, _FrameMux] = {}
        self._without_mux: set[str] = set()  # workers that answered no frame stream: one stream a request
        # NOTE: httpx's read timeout was per read, as sock_read is: a stream may last, a silence may not
        self._timeout = aiohttp.ClientTimeout(total=None, connect=connect, sock_read=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _http(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._loop is not loop or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self._timeout, connector=aiohttp.TCPConnector(limit=0),
                                                  auto_decompress=False)
            self._loop = loop
            self._muxes.clear()  # NOTE: each lived on the old session's loop
        return self._session

    async def close(self) -> None:
        if self._session is not None and self._loop is asyncio.get_running_loop():
            for mux in self._muxes.values():
                mux.close()
            await self._session.close()
        self._session = None
        self._muxes.clear()

    async def info(self, url: str, timeout_s: float = _INFO_TIMEOUT_S) -> WorkerInfo:
        """GET /pd/info. A worker that answers an error or an unreadable body is unreachable too."""
        try:
            reply = await self._call("GET", url, "/pd/info", timeout=aiohttp.ClientTimeout(total=timeout_s))
            if reply.status != HTTPStatus.OK:
                raise ValueError(f"HTTP {reply.status}")
            return WorkerInfo.model_validate_json(reply.body)
        except ValueError as exc:
            raise WorkerUnreachable(url, exc) from exc

    async def reserve(self, url: str, request: ReserveRequest) -> ReserveReply | None:
        """Decode: hold blocks for the prompt. None: not now (no room: try another one or later);
        raises WorkerDraining for a worker that takes nothing new, WorkerRefused (400) for a request
        no worker can take."""
        reply = await self._post(url, "/pd/reserve", request)
        if reply.status == HTTPStatus.OK:
            return ReserveReply.model_validate_json(reply.body)
        if reply.status == HTTPStatus.BAD_REQUEST:
            raise WorkerRefused(reply.status, _error_message(reply))
        if reply.draining:
            raise WorkerDraining(f"decode worker {url} is draining")
        return None

    async def prefix(self, url: str, prompt_token_ids: list[int]) -> int | None:
        """Decode or prefill: leading prompt tokens its prefix cache (pool, disk tier) holds now; None
        if it would not say."""
        reply = await self._post(url, "/pd/prefix", PrefixQuery(prompt_token_ids=prompt_token_ids))
        if not 200 <= reply.status < 300:
            return None
        return PrefixReply.model_validate_json(reply.body).num_cached_tokens

    async def prefill_here(self, url: str, request_id: str) -> bool:
        """Decode: compute the uncached rest itself. False: the request no longer waits for KV."""
        reply = await self._post(url, f"/pd/prefill_here/{request_id}")
        return reply.status == HTTPStatus.OK

    async def retarget(self, url: str, request_id: str, transfer_id: str, replaces: str = "") -> bool:
        """Decode: expect this attempt instead (of `replaces`, if it still expects that one). False:
        the request no longer waits for KV, or (with `replaces`) another attempt replaced that one."""
        reply = await self._post(url, f"/pd/retarget/{request_id}",
                                 Retarget(transfer_id=transfer_id, replaces=replaces))
        return reply.status == HTTPStatus.OK

    async def fail(self, url: str, request_id: str, reason: str, transfer_id: str = "") -> bool:
        """Decode: end a request still waiting for KV (for attempt `transfer_id`; "": any) with this
        error. False: it no longer waits (for that attempt)."""
        reply = await self._post(url, f"/pd/fail/{request_id}", FailJob(reason=reason, transfer_id=transfer_id))
        return reply.status == HTTPStatus.OK

    async def alive(self, url: str, transfer_ids: list[str], ended: list[str] | None = None,
                    timeout_s: float | None = None, step_s: float | None = None) -> KeepaliveReply:
        """Decode: these attempts are still being computed (prefill keepalive); `ended` ones will
        never hand off; `step_s`: the prefill engine's recent step time (see Keepalive). Answers
        decode's own step time (KeepaliveReply; an unreadable answer: none said).
        `timeout_s`: instead of the client's."""
        timeout = None if timeout_s is None else aiohttp.ClientTimeout(total=timeout_s)
        reply = await self._call("POST", url, "/pd/alive",
                                 Keepalive(transfer_ids=transfer_ids, ended=ended or [], step_s=step_s),
                                 timeout=timeout)
        try:
            return KeepaliveReply.model_validate_json(reply.body)
        except ValidationError:  # NOTE: best effort, as the keepalive itself: an error answer says nothing
            return KeepaliveReply()

    async def abort(self, url: str, request_id: str) -> None:
        """Decode (request id) or prefill (transfer id): stop it and free its blocks, if still there."""
        await self._post(url, f"/pd/abort/{request_id}")

    async def place(self, url: str, placement: Placement) -> bool:
        """Prefill: the decode reservation of a job sent unplaced. False: the attempt is not
        running there (any more); raises WorkerRefused for a placement it cannot use."""
        reply = await self._post(url, f"/pd/place/{placement.transfer_id}", placement)
        if reply.status == HTTPStatus.OK:
            return True
        if reply.status == HTTPStatus.NOT_FOUND:
            return False
        raise WorkerRefused(reply.status, _error_message(reply))

    async def prefill(self, url: str, job: PrefillJob, on_first_token: Callable[[FirstToken], None] | None = None,
                      on_accepted: Callable[[], None] | None = None) -> HandOff | None:
        """Prefill: compute the job and hand its KV off; answers once the hand-off ended. None:
        draining (503), try another worker; raises WorkerRefused for any other error (bad job,
        KV layout mismatch, decode's receiver unreachable). `on_first_token`: called with the
        job's first token as soon as prefill sampled it, before the hand-off ends (a worker that
        answers in one piece, an older one, never calls it). `on_accepted`: called once prefill took
        the job (its answer started), which an unplaced job's placement must wait for."""
        if on_first_token is None and on_accepted is None:
            return _hand_off(await self._post(url, "/pd/prefill", job))
        try:
            async with self._open("POST", url, "/pd/prefill", job, accept=NDJSON) as response:
                if response.status != HTTPStatus.OK or not response.content_type.startswith(NDJSON):
                    return _hand_off(_Reply(response.status, await response.read()))
                if on_accepted is not None:
                    on_accepted()
                async for line in lines(response):
                    event = PrefillEvent.model_validate_json(line) if line else PrefillEvent()
                    if event.first_token is not None and on_first_token is not None:
                        on_first_token(event.first_token)
                    if event.hand_off is not None:
                        await read_to_the_end(response)
                        return event.hand_off
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            raise WorkerUnreachable(url, exc) from exc
        raise WorkerUnreachable(url, EOFError("the prefill answer ended before the hand-off did"))

    async def stream(self, url: str, request_id: str) -> AsyncGenerator[OutputFrame, None]:
        """Decode: the request's output frames until it finishes (or the stream breaks: then
        WorkerUnreachable). Raises UnknownRequest if the worker does not know it. With `frame_mux`,
        on the worker's frame stream (worker/frame_mux.py), else on a stream of its own."""
        mux = await self._frame_mux(url)
        frames = self._own_stream(url, request_id) if mux is None else mux.frames(request_id)
        async with aclosing(frames):
            async for frame in frames:
                yield frame

    async def stream_merged(self, url: str, request_id: str, inbox: asyncio.Queue[Any]) -> AsyncGenerator[Any, None]:
        """`stream`, merged with what others put in `inbox` (prefill's early first token, an error),
        in the order they arrive (an exception raised). On an open frame stream the frames land in
        `inbox` directly (one task wake a frame); else a task pumps them there, so nothing in
        `inbox` waits for a stream to open."""
        mux = self._muxes.get(url) if self.frame_mux else None
        items = mux.frames(request_id, inbox) if mux is not None and mux.is_open else \
            merged(self.stream(url, request_id), inbox)
        async with aclosing(items):
            async for item in items:
                yield item

    async def _own_stream(self, url: str, request_id: str) -> AsyncGenerator[OutputFrame, None]:
        """The request's frames on a stream of its own (GET /pd/stream/{request_id})."""
        try:
            async with self._open("GET", url, f"/pd/stream/{request_id}") as response:
                if response.status != HTTPStatus.OK:
                    raise UnknownRequest(f"decode worker {url} lost request {request_id}")
                async for line in lines(response):
                    if line:
                        yield OutputFrame.model_validate_json(line)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise WorkerUnreachable(url, exc) from exc

    async def _frame_mux(self, url: str) -> _FrameMux | None:
        """The open frame stream to `url` (opened on first use, again once broken); None without one."""
        if not self.frame_mux or url in self._without_mux:
            return None
        self._http()  # NOTE: a session (and its muxes) of this loop
        mux = self._muxes.get(url)
        if mux is None or mux.broken is not None:
            mux = self._muxes[url] = _FrameMux(self, url)
        try:
            await asyncio.shield(mux.opened)
        except _NoFrameStream:
            self._without_mux.add(url)
            return None
        return mux

    async def _post(self, url: str, path: str, body: BaseModel | None = None) -> _Reply:
        return await self._call("POST", url, path, body)

    async def _call(self, method: str, url: str, path: str, body: BaseModel | None = None,
                    timeout: aiohttp.ClientTimeout | None = None) -> _Reply:
        """One call answered in one piece. Raises WorkerUnreachable when the worker does not answer."""
        try:
            async with self._open(method, url, path, body, timeout=timeout) as response:
                return _Reply(response.status, await response.read(),
                              response.status == HTTPStatus.SERVICE_UNAVAILABLE and DRAINING_HEADER in response.headers)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise WorkerUnreachable(url, exc) from exc

    @asynccontextmanager
    async def _open(self, method: str, url: str, path: str, body: BaseModel | None = None, accept: str = "",
                    timeout: aiohttp.ClientTimeout | None = None) -> AsyncIterator[aiohttp.ClientResponse]:
        """The response to a signed request (a POST's body: `body` as JSON, {} when None)."""
        target = URL(f"{url}{path}", encoded=True)
        data = b"" if method == "GET" else (b"{}" if body is None else body.model_dump_json().encode())
        headers = signature_headers(self.secret, method, target.raw_path_qs, data)
        if method != "GET":
            headers["content-type"] = "application/json"
        if accept:
            headers["accept"] = accept
        async with self._http().request(method, target, data=data or None, headers=headers,
                                        timeout=timeout or self._timeout) as response:
            yield response


class _NoFrameStream(Exception):
    """The worker opened no frame stream (an older one, or a stand-in): one stream per request."""


class _FrameMux:
    """The router's end of one decode worker's frame stream (worker/frame_mux.py): one reader
    task hands each request's frames to the queue of whoever streams it; the stream breaking
    (or ending) ends every one of them with WorkerUnreachable, as their own streams breaking would."""

    def __init__(self, client: WorkerClient, url: str) -> None:
        self.client, self.url = client, url
        self.mux_id = uuid.uuid4().hex
        self.opened: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.broken: WorkerUnreachable | None = None
        self._queues: dict[str, asyncio.Queue[Any]] = {}  # a request's frames (b"": its end), or its inbox
        self._reader = asyncio.create_task(self._read())

    async def frames(self, request_id: str, queue: asyncio.Queue[Any] | None = None) -> AsyncGenerator[Any, None]:
        """The request's frames; with `queue` (`WorkerClient.stream_merged`'s inbox) they land there,
        and whatever else lands there is yielded as it is (an exception raised)."""
        queue = self._queues[request_id] = asyncio.Queue() if queue is None else queue  # before its frames come
        # NOTE: attached beside the reading: an item already in the queue (a first token) does not wait for it
        attach = asyncio.create_task(self._attach(request_id, queue))
        try:
            while True:
                item = await queue.get()
                if type(item) is bytes:
                    if not item:  # its frames ended: the attach has its answer too, read (the connection kept)
                        await asyncio.gather(attach, return_exceptions=True)
                        return
                    yield OutputFrame.model_validate_json(item)
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            if not attach.done():
                attach.cancel()
            self._queues.pop(request_id, None)
            if not self._queues:  # NOTE: not held open while idle (a worker counts it as a request)
                asyncio.get_running_loop().call_later(_MUX_IDLE_S, self._close_if_idle)

    async def _attach(self, request_id: str, queue: asyncio.Queue[Any]) -> None:
        """Ask decode to stream `request_id` here; what fails is raised where the queue is read."""
        try:
            reply = await self.client._post(self.url, f"/pd/stream/{request_id}/via/{self.mux_id}")
        except Exception as exc:  # noqa: BLE001 - WorkerUnreachable, or whatever else: the reader's to raise
            queue.put_nowait(exc)
            return
        if reply.status == HTTPStatus.NOT_FOUND:
            queue.put_nowait(UnknownRequest(f"decode worker {self.url} lost request {request_id}"))
        elif reply.status != HTTPStatus.OK:  # NOTE: 410: the frame stream closed meanwhile
            queue.put_nowait(WorkerUnreachable(self.url, ConnectionError(_error_message(reply))))

    @property
    def is_open(self) -> bool:
        """Open and not broken: a request attached now streams on it without waiting for it to open."""
        opened = self.opened
        return self.broken is None and opened.done() and not opened.cancelled() and opened.exception() is None

    def _close_if_idle(self) -> None:
        if not self._queues and self.broken is None:
            self.close()

    def close(self) -> None:
        if self.broken is None:  # NOTE: at once: no new request may attach to a stream being closed
            self.broken = WorkerUnreachable(self.url, EOFError("the frame stream was closed"))
        self._reader.cancel()
        if not self.opened.done():
            self.opened.cancel()

    async def _read(self) -> None:
        cause: Exception = EOFError("the frame stream ended")
        try:
            async with self.client._open("GET", self.url, f"/pd/frames/{self.mux_id}", accept=NDJSON) as response:
                if response.status != HTTPStatus.OK:
                    cause = _NoFrameStream(response.status)
                    return
                self.opened.set_result(None)
                async for line in lines(response):
                    request_id, _, payload = line.partition(b"\t")
                    if (queue := self._queues.get(request_id.decode())) is not None:
                        queue.put_nowait(payload)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            cause = exc
        finally:
            self.broken = self.broken or WorkerUnreachable(self.url, cause)
            if not self.opened.done():
                self.opened.set_exception(cause if isinstance(cause, _NoFrameStream) else self.broken)
            for queue in self._queues.values():
                queue.put_nowait(self.broken)


@dataclass(frozen=True, slots=True)
class _Reply:
    """An answer read in one piece."""

    status: int
    body: bytes
    draining: bool = False  # a 503 that says the worker is draining (DRAINING_HEADER)


def _hand_off(reply: _Reply) -> HandOff | None:
    """POST /pd/prefill's answer in one piece (see `WorkerClient.prefill`)."""
    if reply.status == HTTPStatus.OK:
        return HandOff.model_validate_json(reply.body)
    if reply.status == HTTPStatus.SERVICE_UNAVAILABLE:
        return None
    raise WorkerRefused(reply.status, _error_message(reply))


def _error_message(reply: _Reply) -> str:
    """The message of the OpenAI-style error body the workers answer with."""
    try:
        return str(json.loads(reply.body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {reply.status}"


async def merged(frames: AsyncIterator[Any], inbox: asyncio.Queue[Any]) -> AsyncGenerator[Any, None]:
    """`frames`, and whatever else lands in `inbox` meanwhile, in the order they arrive (an
    exception raised); what ends `frames` ends this."""

    async def pump() -> None:
        try:
            async for frame in frames:
                inbox.put_nowait(frame)
        except Exception as exc:  # noqa: BLE001 - raised where the inbox is read
            inbox.put_nowait(exc)
        else:
            inbox.put_nowait(None)

    task = asyncio.create_task(pump())
    try:
        while (item := await inbox.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
