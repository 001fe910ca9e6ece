"""The one client of the workers' `/pd/*` control API (routes: worker_app.py's docstring; bodies:
control.py's models). The router, the in-memory queue, the Redis queue consumer and prefill
keepalives all talk to workers through it, so a route's URL and status codes are spelled once.

Every method raises `WorkerUnreachable` when the worker does not answer (connection refused or
reset, timeout, a stream cut short); what each status means is mapped per method to a result or
to `WorkerRefused` (an error whose status and message must reach the client) or `UnknownRequest`.
No httpx type leaves this module. With a cluster secret every call is signed (auth.py); a worker
that refuses the signature answers 401, which maps like any other refusal.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from http import HTTPStatus

import httpx
from pydantic import BaseModel

from pdserve.disagg.auth import ClusterSecret, SignedRequests
from pdserve.disagg.control import (
    FailJob,
    FirstToken,
    HandOff,
    Keepalive,
    OutputFrame,
    PrefillEvent,
    PrefillJob,
    PrefixQuery,
    PrefixReply,
    ReserveReply,
    ReserveRequest,
    Retarget,
    WorkerInfo,
)

_INFO_TIMEOUT_S = 2.0
NDJSON = "application/x-ndjson"  # streamed answers: one JSON document a line


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
    ended); `connect_timeout_s` bounds connecting (default: `timeout_s`); `secret` signs every call."""

    def __init__(self, timeout_s: float | None = None, connect_timeout_s: float | None = None,
                 secret: ClusterSecret | None = None) -> None:
        connect = timeout_s if connect_timeout_s is None else connect_timeout_s
        self.secret = secret
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=connect), auth=SignedRequests(secret))

    async def close(self) -> None:
        await self._http.aclose()

    async def info(self, url: str, timeout_s: float = _INFO_TIMEOUT_S) -> WorkerInfo:
        """GET /pd/info. A worker that answers an error or an unreadable body is unreachable too."""
        try:
            reply = await self._http.get(f"{url}/pd/info", timeout=timeout_s)
            reply.raise_for_status()
            return WorkerInfo.model_validate(reply.json())
        except (httpx.HTTPError, ValueError) as exc:
            raise WorkerUnreachable(url, exc) from exc

    async def reserve(self, url: str, request: ReserveRequest) -> ReserveReply | None:
        """Decode: hold blocks for the prompt. None: not now (no room, draining: try another one
        or later); raises WorkerRefused (400) for a request no worker can take."""
        reply = await self._post(url, "/pd/reserve", request)
        if reply.status_code == HTTPStatus.OK:
            return ReserveReply.model_validate(reply.json())
        if reply.status_code == HTTPStatus.BAD_REQUEST:
            raise WorkerRefused(reply.status_code, _error_message(reply))
        return None

    async def prefix(self, url: str, prompt_token_ids: list[int]) -> int | None:
        """Decode or prefill: leading prompt tokens its prefix cache (pool, disk tier) holds now; None
        if it would not say."""
        reply = await self._post(url, "/pd/prefix", PrefixQuery(prompt_token_ids=prompt_token_ids))
        if not reply.is_success:
            return None
        return PrefixReply.model_validate(reply.json()).num_cached_tokens

    async def prefill_here(self, url: str, request_id: str) -> bool:
        """Decode: compute the uncached rest itself. False: the request no longer waits for KV."""
        reply = await self._post(url, f"/pd/prefill_here/{request_id}")
        return reply.status_code == HTTPStatus.OK

    async def retarget(self, url: str, request_id: str, transfer_id: str) -> bool:
        """Decode: expect this attempt instead. False: the request no longer waits for KV."""
        reply = await self._post(url, f"/pd/retarget/{request_id}", Retarget(transfer_id=transfer_id))
        return reply.status_code == HTTPStatus.OK

    async def fail(self, url: str, request_id: str, reason: str, transfer_id: str = "") -> bool:
        """Decode: end a request still waiting for KV (for attempt `transfer_id`; "": any) with this
        error. False: it no longer waits (for that attempt)."""
        reply = await self._post(url, f"/pd/fail/{request_id}", FailJob(reason=reason, transfer_id=transfer_id))
        return reply.status_code == HTTPStatus.OK

    async def alive(self, url: str, transfer_ids: list[str]) -> None:
        """Decode: these attempts are still being computed (prefill keepalive)."""
        await self._post(url, "/pd/alive", Keepalive(transfer_ids=transfer_ids))

    async def abort(self, url: str, request_id: str) -> None:
        """Decode (request id) or prefill (transfer id): stop it and free its blocks, if still there."""
        await self._post(url, f"/pd/abort/{request_id}")

    async def prefill(self, url: str, job: PrefillJob,
                      on_first_token: Callable[[FirstToken], None] | None = None) -> HandOff | None:
        """Prefill: compute the job and hand its KV off; answers once the hand-off ended. None:
        draining (503), try another worker; raises WorkerRefused for any other error (bad job,
        KV layout mismatch, decode's receiver unreachable). `on_first_token`: called with the
        job's first token as soon as prefill sampled it, before the hand-off ends (a worker that
        answers in one piece, an older one, never calls it)."""
        if on_first_token is None:
            reply = await self._post(url, "/pd/prefill", job)
            return _hand_off(reply)
        try:
            async with self._http.stream("POST", f"{url}/pd/prefill", json=job.model_dump(),
                                         headers={"accept": NDJSON}) as response:
                if response.status_code != HTTPStatus.OK or not response.headers.get(
                        "content-type", "").startswith(NDJSON):
                    await response.aread()
                    return _hand_off(response)
                async for line in response.aiter_lines():
                    event = PrefillEvent.model_validate_json(line) if line else PrefillEvent()
                    if event.first_token is not None:
                        on_first_token(event.first_token)
                    if event.hand_off is not None:
                        return event.hand_off
        except (httpx.HTTPError, ValueError) as exc:
            raise WorkerUnreachable(url, exc) from exc
        raise WorkerUnreachable(url, EOFError("the prefill answer ended before the hand-off did"))

    async def stream(self, url: str, request_id: str) -> AsyncGenerator[OutputFrame, None]:
        """Decode: the request's output frames until it finishes (or the stream breaks: then
        WorkerUnreachable). Raises UnknownRequest if the worker does not know it."""
        try:
            async with self._http.stream("GET", f"{url}/pd/stream/{request_id}") as response:
                if response.status_code != HTTPStatus.OK:
                    raise UnknownRequest(f"decode worker {url} lost request {request_id}")
                async for line in response.aiter_lines():
                    if line:
                        yield OutputFrame.model_validate_json(line)
        except httpx.HTTPError as exc:
            raise WorkerUnreachable(url, exc) from exc

    async def _post(self, url: str, path: str, body: BaseModel | None = None) -> httpx.Response:
        try:
            return await self._http.post(f"{url}{path}", json={} if body is None else body.model_dump())
        except httpx.HTTPError as exc:
            raise WorkerUnreachable(url, exc) from exc


def _hand_off(reply: httpx.Response) -> HandOff | None:
    """POST /pd/prefill's answer in one piece (see `WorkerClient.prefill`)."""
    if reply.status_code == HTTPStatus.OK:
        return HandOff.model_validate(reply.json())
    if reply.status_code == HTTPStatus.SERVICE_UNAVAILABLE:
        return None
    raise WorkerRefused(reply.status_code, _error_message(reply))


def _error_message(reply: httpx.Response) -> str:
    """The message of the OpenAI-style error body the workers answer with."""
    try:
        return str(reply.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {reply.status_code}"
