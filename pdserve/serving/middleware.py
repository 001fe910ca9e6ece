"""The ASGI layers in front of every route (outermost first): any unhandled exception becomes a
500 in the OpenAI envelope; a client key is checked; the body is read up to its size cap.

    client -> CatchAll -> ApiKeyAuth -> BodyLimit -> FastAPI (routes, EXCEPTION_HANDLERS)
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Collection
from http import HTTPStatus

from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.logs import current_request_id
from pdserve.serving.errors import error_response

logger = logging.getLogger("pdserve.serving")

# NOTE: what a key guards. /health, /ready, /metrics and /version stay open for probes and
# Prometheus; /pd/* is the workers' plane (their registration), not the clients'.
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/workers", "/router/stats", "/dashboard")


def wrong_method(scope: Scope) -> bool:
    """A path some route serves, with a method none of them takes: the app answers it (405 with
    `Allow`) before any authentication, which has nothing to say about a request no route takes."""
    app = scope.get("app")
    routes = getattr(getattr(app, "router", None), "routes", ())
    matches = [route.matches(scope)[0] for route in routes]
    return Match.FULL not in matches and Match.PARTIAL in matches


class CatchAll:
    """No route answers a plain-text 500: an exception no handler took is logged (with its request
    id) and answered in the envelope, or, once a streamed response has begun, ends the stream."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception:  # noqa: BLE001 - this layer exists to answer for all of them
            request_id = current_request_id() or "-"
            logger.exception("unhandled error in %s %s (request %s)", scope.get("method"), scope.get("path"),
                             request_id)
            if not started:
                await error_response(f"internal server error (request {request_id})",
                                     HTTPStatus.INTERNAL_SERVER_ERROR)(scope, receive, send)


class ApiKeyAuth:
    """`Authorization: Bearer KEY` with one of `keys` on every path under PROTECTED_PREFIXES, else a
    401. Every key is compared, each in constant time, so timing tells nothing about which matched."""

    def __init__(self, app: ASGIApp, keys: Collection[str]) -> None:
        self.app = app
        self._keys = [key.encode() for key in keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and str(scope["path"]).startswith(PROTECTED_PREFIXES) \
                and not self._authorized(scope) and not wrong_method(scope):
            response = error_response("invalid or missing API key: send 'Authorization: Bearer <key>'",
                                      HTTPStatus.UNAUTHORIZED, headers={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        matches = [hmac.compare_digest(token.strip(), key) for key in self._keys]
        return any(matches)


class BodyLimit:
    """Reads a request's body before the app does, at most `max_bytes` of it: a larger declared
    Content-Length is refused unread, a longer chunked body once it passes the cap (413). The app
    then receives the body in one message, and after it whatever the client sends next (disconnect)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await self._too_large(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # NOTE: the client left before its body arrived: nothing to answer
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(f"request body larger than {self.max_bytes} bytes (--max-request-body-bytes)",
                                  HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
        await response(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if replayed:
            return await receive()
        replayed = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay
