"""OpenAI error objects: `{"error": {"message", "type", "param", "code"}}` with the right status."""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from http import HTTPStatus
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

# on a worker's 503: it is draining, send it nothing new (a decode worker's 503 without it: no KV room now)
DRAINING_HEADER = "x-pdserve-draining"

_TYPES = {
    HTTPStatus.BAD_REQUEST: "invalid_request_error",
    HTTPStatus.UNAUTHORIZED: "authentication_error",
    HTTPStatus.NOT_FOUND: "not_found_error",
    HTTPStatus.METHOD_NOT_ALLOWED: "invalid_request_error",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "invalid_request_error",
    HTTPStatus.UNPROCESSABLE_ENTITY: "invalid_request_error",
    HTTPStatus.TOO_MANY_REQUESTS: "rate_limit_error",
    HTTPStatus.SERVICE_UNAVAILABLE: "service_unavailable",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorEnvelope(BaseModel):
    """What every error answers (the OpenAPI document's schema of each 4xx/5xx)."""

    error: ErrorDetail


def documented_errors(*statuses: HTTPStatus) -> dict[int | str, dict[str, Any]]:
    """A route's `responses=`: these statuses, each with the envelope's schema."""
    return {int(status): {"model": ErrorEnvelope, "description": status.phrase} for status in statuses}


class OpenAIError(Exception):
    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.headers = headers  # e.g. Retry-After on a 429


class ClientDisconnected(Exception):
    """The client went away before a non-streaming response was ready; its work was cancelled."""


# NOTE: nginx's "client closed request"; nobody receives it, but access logs show why the request ended.
_CLIENT_CLOSED_REQUEST = 499


def error_body(message: str, status: HTTPStatus, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param,
                      "code": int(status)}}


class _AsciiJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: an error quoting the client's input (a lone
    surrogate in a model name) still renders, where UTF-8 encoding would fail."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def error_response(message: str, status: HTTPStatus, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return _AsciiJSONResponse(error_body(message, status, param), status_code=int(status), headers=headers)


async def _openai_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, OpenAIError)
    return error_response(exc.message, exc.status, exc.param, exc.headers)


async def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    # NOTE: the deepest of the errors: in a union (a prompt of text, of ids or of lists of ids) the
    # member that got furthest says what is wrong ("prompt.0.1: expected an integer")
    first: dict[str, Any] = max(exc.errors(), key=lambda error: len(error.get("loc", ())), default={})
    # NOTE: without pydantic's union members ("constrained-str", "list[int]"): no field is named so
    location = [str(part) for part in first.get("loc", ()) if part != "body"
                and (isinstance(part, int) or not any(c in str(part) for c in "-["))]
    if first.get("type") == "json_invalid":
        return error_response(f"malformed JSON body: {first.get('msg', '')}", HTTPStatus.BAD_REQUEST)
    param = ".".join(location) or None
    message = f"{param}: {first.get('msg', 'invalid value')}" if param else str(first.get("msg", "invalid request"))
    return error_response(message, HTTPStatus.BAD_REQUEST, param)


async def _http_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    # NOTE: the headers too: a 405's `Allow` (RFC 9110 requires it)
    return error_response(str(exc.detail), HTTPStatus(exc.status_code), headers=dict(exc.headers or {}))


async def _client_disconnected(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, ClientDisconnected)
    return Response(status_code=_CLIENT_CLOSED_REQUEST)


# NOTE: typed as FastAPI's `exception_handlers` parameter, so apps take it as it is.
EXCEPTION_HANDLERS: dict[int | type[Exception], Callable[[Request, Any], Coroutine[Any, Any, Response]]] = {
    OpenAIError: _openai_error,
    ClientDisconnected: _client_disconnected,
    RequestValidationError: _validation_error,
    StarletteHTTPException: _http_error,
}
