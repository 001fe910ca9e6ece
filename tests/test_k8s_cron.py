"""Pre-warm on Kubernetes (pdserve/ops/k8s_cron.py): each `--prewarm` interval raises the minimum
two minutes before it starts and restores it when it ends, across midnight too; overlapping
intervals give the highest minimum, as the local autoscaler's. Checked by replaying the rendered
schedules minute by minute the way each controller reads them."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import pytest

from pdserve.ops.autoscale import AutoscaleConfig
from pdserve.ops.k8s_autoscale import RenderOptions, cron_hpa, keda_prewarm_triggers
from pdserve.ops.k8s_cron import (
    MINUTES_PER_DAY,
    CronStep,
    cronhpa_schedule,
    keda_schedule,
    minimum_at,
    prewarm_steps,
)
from pdserve.ops.prewarm import parse_prewarm, prewarm_minimum
from pdserve.ops.signals import Role

MIDNIGHT = datetime(2025, 3, 3)
SPECS = [
    ("08:00-10:00=prefill:2,decode:3",),  # the example
    ("23:00-01:30=decode:4",),  # wraps midnight
    ("00:01-02:00=prefill:2",),  # starts early on the day before
    ("08:00-10:00=decode:3", "09:00-12:00=decode:5"),  # overlapping, the later one higher
    ("08:00-12:00=decode:5", "09:00-10:00=decode:3"),  # a lower one inside a higher one
    ("22:00-24:00=prefill:3", "00:00-00:30=prefill:3"),  # back to back across midnight
]


def local_minimum(specs: tuple[str, ...], role: Role, base: int, minute: int) -> int:
    """What `pdserve up --autoscale` keeps at `minute` of the day (ops/prewarm.py)."""
    at = MIDNIGHT + timedelta(minutes=minute % MINUTES_PER_DAY)
    return max(base, prewarm_minimum([parse_prewarm(s) for s in specs], role, at)[0])


def cron_minute(schedule: str, fields: int) -> int:
    """A daily schedule back to its minute of the day: 'M H * * *' (KEDA), '0 M H * * *' (CronHPA)."""
    parts = schedule.split()
    assert len(parts) == fields and parts[fields - 3:] == ["*", "*", "*"], schedule
    if fields == 6:
        assert parts[0] == "0", "CronHPA jobs fire at second 0"
        parts = parts[1:]
    minute, hour = int(parts[0]), int(parts[1])
    assert 0 <= minute < 60 and 0 <= hour < 24, schedule
    return hour * 60 + minute


def replay_cronhpa(jobs: list[dict[str, Any]], base: int) -> list[int]:
    """The minimum each minute of a day of jobs that set it (the last job before midnight holds
    at midnight)."""
    sets = {cron_minute(job["schedule"], 6): job["targetSize"] for job in jobs}
    assert len(sets) == len(jobs), "two jobs at one minute"
    level = sets[max(sets)] if sets else base
    day = []
    for minute in range(MINUTES_PER_DAY):
        level = sets.get(minute, level)
        day.append(level)
    return day


def keda_active(start: int, end: int, now: float) -> bool:
    """KEDA's cronScaler.IsActive: compares the next start with the next end."""
    next_start = start if start > now else start + MINUTES_PER_DAY
    next_end = end if end > now else end + MINUTES_PER_DAY
    return not (next_start < next_end and now < next_start) and now <= next_end


def replay_keda(triggers: list[dict[str, Any]], base: int) -> list[int]:
    """The HPA's minimum from KEDA's cron triggers each minute: the max of the active triggers'
    desiredReplicas (an inactive trigger asks for 1) and minReplicaCount."""
    day = []
    for minute in range(MINUTES_PER_DAY):
        level = base
        for trigger in triggers:
            meta = trigger["metadata"]
            if keda_active(cron_minute(meta["start"], 5), cron_minute(meta["end"], 5), minute + 0.5):
                level = max(level, int(meta["desiredReplicas"]))
        day.append(level)
    return day


def test_the_example_starts_two_minutes_early_and_restores_at_the_end() -> None:
    options = RenderOptions()
    assert options.example_prewarm
    prefill, decode = cron_hpa(options, "prefill"), cron_hpa(options, "decode")
    assert prefill is not None and decode is not None
    assert [(j["schedule"], j["targetSize"]) for j in prefill["spec"]["jobs"]] == [("0 58 7 * * *", 2),
                                                                                  ("0 0 10 * * *", 1)]
    assert [(j["schedule"], j["targetSize"]) for j in decode["spec"]["jobs"]] == [("0 58 7 * * *", 3),
                                                                                 ("0 0 10 * * *", 1)]
    assert decode["spec"]["scaleTargetRef"] == {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
                                                "name": "pdserve-decode"}
    (trigger,) = keda_prewarm_triggers(options, "decode")
    assert trigger["type"] == "cron" and trigger["metadata"] == {
        "timezone": "UTC", "start": "58 7 * * *", "end": "0 10 * * *", "desiredReplicas": "3"}


def test_wrapping_midnight() -> None:
    rules = [parse_prewarm("23:00-01:30=decode:4")]
    assert prewarm_steps(rules, "decode", 1) == [CronStep(90, 1), CronStep(22 * 60 + 58, 4)]
    early = [parse_prewarm("00:01-02:00=prefill:2")]
    assert prewarm_steps(early, "prefill", 1) == [CronStep(120, 1), CronStep(23 * 60 + 59, 2)]
    (trigger,) = keda_prewarm_triggers(RenderOptions(AutoscaleConfig(prewarm=("00:01-02:00=prefill:2",))), "prefill")
    assert (trigger["metadata"]["start"], trigger["metadata"]["end"]) == ("59 23 * * *", "0 2 * * *")
    assert prewarm_steps(rules, "prefill", 1) == [], "a rule raises only the roles it names"


def test_a_whole_day_has_one_step_at_midnight_and_none_without_a_raise() -> None:
    assert prewarm_steps([parse_prewarm("00:00-24:00=decode:2")], "decode", 1) == [CronStep(0, 2)]
    assert prewarm_steps([parse_prewarm("08:00-10:00=decode:2")], "decode", 2) == []


@pytest.mark.parametrize("specs", SPECS)
def test_minimum_is_the_local_one_started_two_minutes_early(specs: tuple[str, ...]) -> None:
    rules = [parse_prewarm(s) for s in specs]
    for role in ("prefill", "decode"):
        for minute in range(MINUTES_PER_DAY):
            assert minimum_at(rules, role, 1, minute, lead_minutes=0) == local_minimum(specs, role, 1, minute)
            ahead = max(local_minimum(specs, role, 1, minute + k) for k in range(3))
            assert minimum_at(rules, role, 1, minute) == ahead, (specs, role, minute)


@pytest.mark.parametrize("specs", SPECS)
def test_both_controllers_replay_to_that_minimum(specs: tuple[str, ...]) -> None:
    options = RenderOptions(AutoscaleConfig(prewarm=specs), {"prefill": (1, 6), "decode": (2, 8)})
    options.validate()
    rules = options.prewarm
    for role in ("prefill", "decode"):
        base = options.bounds[role][0]
        want = [minimum_at(rules, role, base, minute) for minute in range(MINUTES_PER_DAY)]
        cron = cron_hpa(options, role)
        assert replay_cronhpa(cron["spec"]["jobs"] if cron else [], base) == want, (specs, role)
        assert replay_keda(keda_prewarm_triggers(options, role), base) == want, (specs, role)


def test_schedule_forms() -> None:
    assert cronhpa_schedule(7 * 60 + 58) == "0 58 7 * * *" and keda_schedule(7 * 60 + 58) == "58 7 * * *"
    assert cronhpa_schedule(0) == "0 0 0 * * *" and keda_schedule(23 * 60 + 59) == "59 23 * * *"
