"""Scheduled pre-warm: `--prewarm "HH:MM-HH:MM=prefill:2,decode:3"` raises the minimum pool size
of the roles it names while the local time of day is in [start, end) (minutes; seconds do not
count). An interval whose end comes before its start wraps midnight (`22:00-02:00`); `24:00` may
end an interval. Several intervals may be active at once: the highest minimum wins.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from pdserve.ops.signals import ROLES, Role

_SYNTAX = "HH:MM-HH:MM=ROLE:N[,ROLE:N] (ROLE: prefill or decode), e.g. 08:00-10:00=prefill:2,decode:3"
_MINUTES_PER_DAY = 24 * 60


@dataclass(frozen=True, slots=True)
class PrewarmRule:
    """One parsed `--prewarm` value."""

    spec: str  # as given, for log lines
    start_minute: int  # minutes after local midnight, inclusive
    end_minute: int  # exclusive; <= start_minute: the interval wraps midnight
    minimum: dict[Role, int]  # the roles it names -> their minimum inside the interval

    def active(self, at: datetime) -> bool:
        minute = at.hour * 60 + at.minute
        if self.start_minute < self.end_minute:
            return self.start_minute <= minute < self.end_minute
        return minute >= self.start_minute or minute < self.end_minute


def parse_prewarm(spec: str) -> PrewarmRule:
    """Raises ValueError saying what is wrong with `spec`."""
    interval, equals, sizes = spec.partition("=")
    start, dash, end = interval.partition("-")
    if not equals or not dash:
        raise ValueError(f"prewarm {spec!r}: expected {_SYNTAX}")
    start_minute = _minute_of_day(start, spec, may_be_midnight_end=False)
    end_minute = _minute_of_day(end, spec, may_be_midnight_end=True)
    if start_minute == end_minute:
        raise ValueError(f"prewarm {spec!r}: the interval is empty (start == end); all day is 00:00-24:00")
    return PrewarmRule(spec, start_minute, end_minute, _minimum(sizes, spec))


def _minute_of_day(text: str, spec: str, *, may_be_midnight_end: bool) -> int:
    match = re.fullmatch(r"(\d{1,2}):(\d{2})", text.strip())
    if match is None:
        raise ValueError(f"prewarm {spec!r}: {text.strip()!r} is not HH:MM; expected {_SYNTAX}")
    hours, minutes = int(match[1]), int(match[2])
    if (hours, minutes) == (24, 0) and may_be_midnight_end:
        return _MINUTES_PER_DAY
    if hours > 23 or minutes > 59:
        raise ValueError(f"prewarm {spec!r}: {text.strip()!r} is not a time of day (00:00 to 23:59"
                         f"{', or 24:00 as an end' if may_be_midnight_end else ''})")
    return hours * 60 + minutes


def _minimum(sizes: str, spec: str) -> dict[Role, int]:
    minimum: dict[Role, int] = {}
    for part in sizes.split(","):
        name, colon, count = (piece.strip() for piece in part.partition(":"))
        role = next((r for r in ROLES if r == name), None)
        if role is None or not colon:
            raise ValueError(f"prewarm {spec!r}: {part.strip()!r} is not ROLE:N with ROLE prefill or decode")
        if role in minimum:
            raise ValueError(f"prewarm {spec!r}: {role} is named twice")
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"prewarm {spec!r}: the {role} minimum must be a whole number >= 1, got {count!r}")
        minimum[role] = int(count)
    return minimum


def prewarm_minimum(rules: Iterable[PrewarmRule], role: Role, at: datetime) -> tuple[int, PrewarmRule | None]:
    """The highest minimum the rules active at `at` set for `role` (0 if none) and the rule setting it."""
    best: tuple[int, PrewarmRule | None] = (0, None)
    for rule in rules:
        if rule.active(at) and rule.minimum.get(role, 0) > best[0]:
            best = (rule.minimum[role], rule)
    return best
