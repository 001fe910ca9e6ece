"""Scheduled pre-warm on Kubernetes: `--prewarm "HH:MM-HH:MM=prefill:2,decode:3"` (ops/prewarm.py)
as cron schedules that start `LEAD_MINUTES` before the interval and end when it ends.

Locally the minimum rises at HH:MM sharp; on Kubernetes a new pod needs time to be scheduled, pull
and load, so the raise comes two minutes early (the seed's field guide: "pre-warm 2 minutes before known
peaks"). Two forms, one per controller:

    KEDA `cron` trigger       one per rule and role: start "58 7 * * *", end "0 10 * * *" (5 fields,
                              minute first), desiredReplicas N; active in [start, end), wrapping
                              midnight when the end comes first. The HPA takes the max over
                              triggers, so overlapping intervals give the highest minimum, as locally.
    CronHorizontalPodAutoscaler  jobs that *set* a size at an instant ("0 58 7 * * *": 6 fields,
                              seconds first). Overlaps cannot be left to the controller, so the
                              jobs are the steps of the day's minimum: at every minute where the
                              highest active minimum changes, one job sets it (the role's MIN when
                              no interval is active: the restore after the end).

Minutes are minutes of the day (0..1439); 24:00 as an end is midnight.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.ops.prewarm import PrewarmRule
from pdserve.ops.signals import Role

LEAD_MINUTES = 2
MINUTES_PER_DAY = 24 * 60


@dataclass(frozen=True, slots=True)
class CronStep:
    """From `minute` on (daily), the role's minimum is `replicas`."""

    minute: int
    replicas: int


def shifted_window(rule: PrewarmRule, lead_minutes: int = LEAD_MINUTES) -> tuple[int, int]:
    """(start, length) in minutes of `rule`'s interval started `lead_minutes` early; the length is
    at most a whole day (then the interval covers every minute)."""
    length = (rule.end_minute - rule.start_minute) % MINUTES_PER_DAY or MINUTES_PER_DAY
    start = (rule.start_minute - lead_minutes) % MINUTES_PER_DAY
    return start, min(MINUTES_PER_DAY, length + lead_minutes)


def minimum_at(rules: Sequence[PrewarmRule], role: Role, base: int, minute: int,
               lead_minutes: int = LEAD_MINUTES) -> int:
    """The role's minimum at `minute` of the day: `base`, raised by every rule (started early) that
    is active then and names the role."""
    level = base
    for rule in rules:
        start, length = shifted_window(rule, lead_minutes)
        if role in rule.minimum and (minute - start) % MINUTES_PER_DAY < length:
            level = max(level, rule.minimum[role])
    return level


def prewarm_steps(rules: Sequence[PrewarmRule], role: Role, base: int,
                  lead_minutes: int = LEAD_MINUTES) -> list[CronStep]:
    """The minute-by-minute minimum of a day as its steps, in order of the day. A day whose minimum
    never changes but is raised all day has one step at midnight; one never raised has none."""
    day = [minimum_at(rules, role, base, minute, lead_minutes) for minute in range(MINUTES_PER_DAY)]
    steps = [CronStep(minute, day[minute]) for minute in range(MINUTES_PER_DAY) if day[minute] != day[minute - 1]]
    if not steps and day[0] > base:
        steps = [CronStep(0, day[0])]
    return steps


def cronhpa_schedule(minute: int) -> str:
    """Daily at `minute`, in kubernetes-cronhpa-controller's 6-field form (seconds first)."""
    return f"0 {minute % 60} {minute // 60} * * *"


def keda_schedule(minute: int) -> str:
    """Daily at `minute`, in KEDA's cron-trigger form (standard 5 fields, minute first)."""
    return f"{minute % 60} {minute // 60} * * *"


def clock(minute: int) -> str:
    """742 -> '12:22' (for names and comments)."""
    return f"{minute // 60:02d}:{minute % 60:02d}"
