"""Log records name their request (context or `extra`), as text or as one JSON object per line."""

from __future__ import annotations

import contextvars
import json
import logging
from collections.abc import Iterator

import pytest

from pdserve.cli import build_parser
from pdserve.logs import JsonFormatter, RequestIdFilter, bind_request_id, configure_logging


@pytest.fixture
def root_logging() -> Iterator[None]:
    """configure_logging replaces the root handlers: put pytest's back afterwards."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)


def _record(message: str, **extra: str) -> logging.LogRecord:
    record = logging.LogRecord("pdserve.test", logging.WARNING, __file__, 1, message, (), None)
    record.__dict__.update(extra)
    RequestIdFilter().filter(record)
    return record


def _rid(record: logging.LogRecord) -> str:
    return str(record.__dict__.get("request_id"))


def test_request_id_comes_from_the_task_context_or_extra() -> None:
    assert _rid(_record("no request")) == "-"

    def in_request() -> tuple[str, str]:
        bind_request_id("cmpl-abc")
        return _rid(_record("inside")), _rid(_record("engine", request_id="cmpl-xyz"))

    assert contextvars.copy_context().run(in_request) == ("cmpl-abc", "cmpl-xyz")
    assert _rid(_record("after")) == "-"  # the binding stayed in that context


def test_json_lines(root_logging: None, capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("INFO", "json")

    def in_request() -> None:
        bind_request_id("cmpl-42")
        logging.getLogger("pdserve.disagg").warning("KV cache transfer timed out: request %s", "cmpl-42")
        logging.getLogger("pdserve.disagg").debug("below the level")

    contextvars.copy_context().run(in_request)
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert len(lines) == 1
    assert lines[0]["request_id"] == "cmpl-42" and lines[0]["level"] == "WARNING"
    assert lines[0]["message"] == "KV cache transfer timed out: request cmpl-42"
    assert lines[0]["logger"] == "pdserve.disagg" and lines[0]["time"].endswith("Z")


def test_text_lines_carry_the_request_id(root_logging: None, capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("WARNING", "text")
    logging.getLogger("pdserve.engine").warning("No available block for request r1", extra={"request_id": "r1"})
    assert "[r1]: No available block for request r1" in capsys.readouterr().err


def test_cli_flags() -> None:
    ns = build_parser().parse_args(["--log-format", "json", "--log-level", "DEBUG", "router", "--prefill", "x",
                                    "--decode", "y"])
    assert (ns.log_format, ns.log_level) == ("json", "DEBUG")
    assert build_parser().parse_args(["serve"]).log_format == "text"
    assert isinstance(JsonFormatter().format(_record("x")), str)
