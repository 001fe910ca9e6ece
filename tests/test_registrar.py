"""The worker's registration heartbeat (disagg/worker/registrar.py): a router that took the
registration and then stops answering (a restart, or `pdserve up` stopping the router before the
decode workers) is logged as INFO at first and warned of only once it stays gone; a router that
never answered is warned of at once."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

from pdserve.disagg.worker import registrar as registrar_module
from pdserve.disagg.worker.registrar import Registrar

_ROUTER = "http://router.test"


def _records(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == registrar_module.__name__ and r.levelno == level]


def _announce_all(registrar: Registrar, answers: list[bool]) -> None:
    """One announcement per answer (True: the router takes it; False: nothing listens)."""
    async def main() -> None:
        replies = iter(answers)

        def handler(request: httpx.Request) -> httpx.Response:
            if next(replies):
                return httpx.Response(200, json={})
            raise httpx.ConnectError("All connection attempts failed", request=request)

        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            for _ in answers:
                await registrar._announce(http, _ROUTER)
                await asyncio.sleep(0.02)
    asyncio.run(main())


def test_a_router_that_stops_answering_is_warned_of_only_once_it_stays_gone(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    caplog.set_level(logging.INFO, logger=registrar_module.__name__)
    registrar = Registrar((_ROUTER,), "decode", "http://127.0.0.1:1", lambda: False)
    monkeypatch.setattr(registrar_module, "WARN_GONE_AFTER_S", 3600.0)
    _announce_all(registrar, [True, False, False, False])
    assert _records(caplog, logging.WARNING) == []
    assert any("stopped answering" in m for m in _records(caplog, logging.INFO))

    caplog.clear()
    monkeypatch.setattr(registrar_module, "WARN_GONE_AFTER_S", 0.03)
    _announce_all(registrar, [True, False, False, False, False, True, False])
    warnings = _records(caplog, logging.WARNING)
    assert len(warnings) == 1 and "has not taken the registration for" in warnings[0], warnings  # once an outage
    assert sum("registered with router" in m for m in _records(caplog, logging.INFO)) == 2


def test_a_router_that_never_answered_is_warned_of_at_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=registrar_module.__name__)
    registrar = Registrar((_ROUTER,), "prefill", "http://127.0.0.1:1", lambda: False)
    _announce_all(registrar, [False, False, False])
    warnings = _records(caplog, logging.WARNING)
    assert len(warnings) == 1 and "did not take the registration" in warnings[0]
