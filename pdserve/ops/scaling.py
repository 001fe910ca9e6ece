"""`pdserve up --autoscale`: once a second the router's metrics go to the `Autoscaler` (ops/autoscale.py)
and its decisions to the supervisor, which adds slots or drains the least busy ones."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from pdserve.ops.autoscale import Autoscaler, Decision, Role
from pdserve.ops.signals import Signals, scrape
from pdserve.ops.supervisor import Supervisor

logger = logging.getLogger(__name__)

WORKER_ROLES: tuple[Role, ...] = ("prefill", "decode")


class AutoscaleLoop:
    """Scrape, observe, decide, apply: one `tick` a second (up.py's monitor loop calls it)."""

    def __init__(self, autoscaler: Autoscaler, supervisor: Supervisor, router_url: str, *,
                 read: Callable[[str, float], Signals | None] = scrape, clock: Callable[[], float] = time.monotonic,
                 timeout_s: float = 1.0) -> None:
        self._autoscaler = autoscaler
        self._supervisor = supervisor
        self._router_url = router_url
        self._read = read
        self._clock = clock
        self._timeout_s = timeout_s

    def tick(self) -> list[Decision]:
        """One round; returns the decisions it applied. With no answer from the router it observes
        nothing but still decides (a scheduled pre-warm does not need the router)."""
        signals = self._read(self._router_url, self._timeout_s)
        if signals is not None:
            self._autoscaler.observe(signals)
        # NOTE: live = not failed and not draining; slots still starting count, or every tick until
        # a new worker is ready would add another one
        current = {role: len(self._supervisor.live(role)) for role in WORKER_ROLES}
        decisions = self._autoscaler.decide(current, self._clock())
        for decision in decisions:
            logger.info("%s", decision.log_line())
            self._supervisor.scale(decision.role, decision.desired)
        return decisions
