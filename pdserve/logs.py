"""Logging setup: the request id on every record that concerns a request, text or JSON lines.

A request id reaches a record in one of two ways:
  - `bind_request_id(rid)` in the asyncio task that handles the request (HTTP handler, prefill job,
    decode reservation); tasks it creates inherit it, since asyncio copies the context;
  - `extra={"request_id": rid}` on the call, for code that runs for many requests at once (the
    engine thread's scheduler).
Records that concern no request carry `request_id = "-"`.

Alert rules match stable message prefixes, so keep these texts as they are:
`KV cache transfer timed out`, `No available block`, `Cannot allocate for request`.
"""

from __future__ import annotations

import contextvars
import json
import logging
import time
from typing import Literal

LogFormat = Literal["text", "json"]

_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("pdserve_request_id", default=None)
_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"


def bind_request_id(request_id: str) -> None:
    """Every record logged from this task (and the tasks it creates from now on) names `request_id`."""
    _request_id.set(request_id)


def current_request_id() -> str | None:
    return _request_id.get()


class RequestIdFilter(logging.Filter):
    """Sets `record.request_id`, unless the call passed one in `extra`."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = _request_id.get() or "-"
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (RFC 3339, UTC), level, logger, request_id, message[, exc]."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "request_id": getattr(record, "request_id", "-"),
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


class ProbeAccessFilter(logging.Filter):
    """Drops uvicorn's access line for a successful GET of a probe route (/health, /ready,
    /metrics): balancers, routers, Kubernetes and Prometheus call them several times a second,
    which would bury the requests. A failed probe is still logged."""

    PATHS = frozenset({"/health", "/ready", "/metrics"})

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) == 5:  # uvicorn: client, method, path, http version, status
            _, method, path, _, status = args
            return not (method == "GET" and path in self.PATHS and status == 200)
        return True


# NOTE: what `pdserve up`'s own readiness completion carries in its query: its access line is the
# supervisor's, not a client's (QuietAccessFilter drops it)
UP_PROBE_QUERY = "pdserve-up-probe=1"


class QuietAccessFilter(ProbeAccessFilter):
    """`--access-log quiet` (what `pdserve up` runs its processes with): beside the successful
    probes, the deployment's own traffic is not logged either: any probe of /health and /ready
    (up waits on them, and expects 503s until the workers join), the supervisor's GET /workers
    poll, the workers' POST /pd/register heartbeats (and /pd/deregister), and up's own readiness
    completion (UP_PROBE_QUERY). A client's request, and any other failure, still is."""

    ROUTINE = frozenset({("GET", "/workers"), ("POST", "/pd/register"), ("POST", "/pd/deregister")})

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) == 5:
            _, method, path, _, status = args
            route, _, query = str(path).partition("?")
            if (method == "GET" and route in ("/health", "/ready")) or query == UP_PROBE_QUERY \
                    or ((method, route) in self.ROUTINE and status == 200):
                return False
        return super().filter(record)


class _WarningsOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING


AccessLog = Literal["requests", "quiet", "all"]
_ACCESS_FILTERS: dict[AccessLog, type[logging.Filter] | None] = {
    "requests": ProbeAccessFilter, "quiet": QuietAccessFilter, "all": None}


def configure_logging(level: str = "INFO", log_format: LogFormat = "text", access_log: AccessLog = "requests") -> None:
    """Root handler for the process (CLI entry points call this once). `access_log`: which of
    uvicorn's access lines are written: every one ("all"), all but successful probes ("requests"),
    or a client's requests only (QuietAccessFilter)."""
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(_TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # the router polls workers twice a second
    access = logging.getLogger("uvicorn.access")
    for old_filter in [f for f in access.filters if isinstance(f, ProbeAccessFilter)]:
        access.removeFilter(old_filter)
    if (kind := _ACCESS_FILTERS[access_log]) is not None:
        access.addFilter(kind())
    # NOTE: quiet (the processes of `pdserve up`, one terminal): not uvicorn's four start-up lines
    # per process either; each server says where it listens in its own start-up line. A filter,
    # not the logger's level, which uvicorn sets from --log-level when it starts.
    server = logging.getLogger("uvicorn.error")
    for stale in [f for f in server.filters if isinstance(f, _WarningsOnly)]:
        server.removeFilter(stale)
    if access_log == "quiet":
        server.addFilter(_WarningsOnly())
