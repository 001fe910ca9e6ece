"""The autoscaling policy with synthetic router readings (one a second) and an injected wall clock:
each rule fires only once its window is covered, a decision restarts its role's window, scale-in
waits for the cooldown and goes one step at a time, bounds and pre-warm hold, and every decision
is a log line and a metric."""

from __future__ import annotations

import argparse
import bisect
import re
from dataclasses import dataclass, field, replace
from datetime import datetime

import pytest
from prometheus_client import CollectorRegistry

from pdserve.config_flags import add_config_args, config_from_args, to_argv
from pdserve.ops.autoscale import AutoscaleConfig, Autoscaler, Decision, HistogramSnapshot, Role, Signals

BOUNDS: dict[Role, tuple[int, int]] = {"prefill": (1, 3), "decode": (1, 4)}
CONFIG = AutoscaleConfig(autoscale_window_s=10, scale_in_cooldown_s=30)
NOON = datetime(2026, 3, 2, 12, 0)
# Both histograms' bucket bounds (the router's include the default targets the same way).
BOUNDS_S = (0.01, 0.05, 0.06, 0.075, 0.1, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0)


def snapshot(observations: list[float]) -> HistogramSnapshot:
    ordered = sorted(observations)
    buckets = {bound: float(bisect.bisect_right(ordered, bound)) for bound in BOUNDS_S}
    return HistogramSnapshot(buckets | {float("inf"): float(len(ordered))}, sum(ordered), float(len(ordered)))


@dataclass
class FakeRouter:
    """What a router would report, a reading a second; the histograms accumulate."""

    time: float = 0.0
    queue_latencies: list[float] = field(default_factory=list)
    tpots: list[float] = field(default_factory=list)

    def reading(self, depth: float, running: float, ready: tuple[int, int]) -> Signals:
        return Signals(self.time, depth, running, {"prefill": ready[0], "decode": ready[1]},
                       snapshot(self.queue_latencies), snapshot(self.tpots))


@dataclass
class Run:
    """An autoscaler fed by a fake router; the supervisor applies every decision at once."""

    scaler: Autoscaler
    current: dict[Role, int]
    registry: CollectorRegistry
    router: FakeRouter = field(default_factory=FakeRouter)
    decisions: list[tuple[float, Decision]] = field(default_factory=list)

    def seconds(self, n: int, depth: float = 0, running: float = 0, ready: tuple[int, int] | None = None,
                queue_latency_s: float | None = None, tpot_s: float | None = None) -> list[Decision]:
        """`n` readings, a second apart, deciding after each; `ready` defaults to `current`. Returns
        the decisions of these seconds."""
        made = []
        for _ in range(n):
            self.router.time += 1
            if queue_latency_s is not None:
                self.router.queue_latencies.append(queue_latency_s)
            if tpot_s is not None:
                self.router.tpots.append(tpot_s)
            now_ready = ready or (self.current["prefill"], self.current["decode"])
            self.scaler.observe(self.router.reading(depth, running, now_ready))
            for decision in self.scaler.decide(self.current, self.router.time):
                made.append(decision)
                self.decisions.append((self.router.time, decision))
                self.current[decision.role] = decision.desired
        return made

    def metric(self, name: str, **labels: str) -> float | None:
        return self.registry.get_sample_value(name, labels)


def start(prefill: int = 1, decode: int = 1, config: AutoscaleConfig = CONFIG,
          bounds: dict[Role, tuple[int, int]] = BOUNDS, clock: list[datetime] | None = None) -> Run:
    registry = CollectorRegistry()
    wall = clock or [NOON]
    scaler = Autoscaler(config, bounds, registry=registry, wall_clock=lambda: wall[0])
    return Run(scaler, {"prefill": prefill, "decode": decode}, registry)


def test_prefill_scales_out_on_queue_depth_only_once_the_whole_window_held_it() -> None:
    run = start()
    assert run.seconds(10, depth=12) == []  # 10 readings span only 9 s
    [decision] = run.seconds(1, depth=12)
    assert (decision.role, decision.current, decision.desired, decision.direction, decision.reason) == \
        ("prefill", 1, 2, "out", "queue_depth")
    assert decision.log_line() == "autoscale: prefill 1 -> 2: queue depth 12 > 10 for 10 s"
    # the window starts again after the decision: the next step needs 10 s of readings after it
    assert run.seconds(10, depth=12) == []
    assert [d.desired for d in run.seconds(1, depth=12)] == [3]
    # one reading at the target (not above) breaks the window
    run = start()
    assert run.seconds(6, depth=12) + run.seconds(1, depth=10) + run.seconds(10, depth=12) == []
    assert [d.reason for d in run.seconds(1, depth=12)] == ["queue_depth"]


def test_prefill_scales_out_on_queue_latency_p90_over_the_window() -> None:
    run = start()
    assert run.seconds(10, depth=2, queue_latency_s=2.0) == []
    [decision] = run.seconds(1, depth=2, queue_latency_s=2.0)
    assert (decision.reason, decision.desired) == ("queue_latency", 2)
    # every observation in (1.5, 2.0]: P90 interpolated inside that bucket, like Prometheus
    assert decision.detail == "queue latency P90 1.95 s > 1.5 s over 10 s"
    # the slow requests are behind the new window: fast ones now, no second step
    assert run.seconds(30, depth=2, queue_latency_s=0.1) == []
    run = start()
    for _ in range(3):  # one slow request in ten: P90 stays in the fast bucket
        run.seconds(9, depth=2, queue_latency_s=0.1)
        run.seconds(1, depth=2, queue_latency_s=5.0)
    assert run.decisions == []


def test_an_empty_window_is_no_latency_signal() -> None:
    run = start(prefill=2, decode=2)
    assert run.scaler.decide(run.current, 0.0) == []  # no reading at all
    # slow requests long ago, then none: no P90 / P99 / mean in the window, so no scale-out on
    # latency, and with the depth and concurrency between their watermarks no scale-in either
    run.router.queue_latencies += [9.0] * 50
    run.router.tpots += [0.5] * 50
    assert run.seconds(40, depth=5, running=2 * 8) == []
    # idle (depth at the low watermark, nothing running) and no request: that is a scale-in
    [prefill, decode] = run.seconds(11, depth=1, running=0)
    assert prefill.log_line() == "autoscale: prefill 2 -> 1: queue depth <= 1 for 10 s, no request"
    assert decode.detail == "running/instance 0 < 4 for 10 s, no request finished"
    assert decode.log_line() == "autoscale: decode 2 -> 1: running/instance 0 < 4 for 10 s, no request finished"


def test_readings_must_be_fresh_and_a_router_restart_restarts_the_window() -> None:
    stale = start()
    stale.seconds(10, depth=12)
    assert stale.scaler.decide(stale.current, stale.router.time + 1) != []  # a second later: still fresh
    stale = start()
    stale.seconds(10, depth=12)
    assert stale.scaler.decide(stale.current, stale.router.time + 6) == []  # covered, but the newest is 6 s old
    restarted = start()
    restarted.seconds(8, depth=12, queue_latency_s=0.1)
    restarted.router.queue_latencies.clear()  # the router restarted: its counters start from 0
    assert restarted.seconds(10, depth=12) == []
    assert [d.reason for d in restarted.seconds(1, depth=12)] == ["queue_depth"]


def test_decode_scales_out_to_ceil_of_running_over_target() -> None:
    run = start(decode=2)
    assert run.seconds(10, running=35) == []
    [decision] = run.seconds(1, running=35)  # 17.5 per worker > 15: ceil(35 / 10) = 4 workers
    assert (decision.current, decision.desired, decision.reason) == (2, 4, "running_per_worker")
    assert decision.detail == "running/instance 17.5 > 15 for 10 s"
    run = start(decode=1)
    [decision] = run.seconds(11, running=16)  # ceil(1.6) = 2: at least one more anyway
    assert decision.desired == 2
    # per *ready* worker: two live, one still loading, 20 running -> 20 per ready worker
    run = start(decode=2)
    [decision] = run.seconds(11, running=20, ready=(1, 1))
    assert decision.desired == 2 + 1  # max(current + 1, ceil(20 / 10))


def test_decode_scales_out_on_tpot_p99_and_average() -> None:
    run = start(decode=2)
    [decision] = run.seconds(11, running=20, tpot_s=0.07)  # 10 per worker: within the band
    assert (decision.reason, decision.desired) == ("tpot_p99", 3)
    assert decision.detail == "TPOT P99 74.85 ms > 60 ms over 10 s"  # in (60, 75] ms, interpolated
    run = start(decode=2)
    [decision] = run.seconds(11, running=20, tpot_s=0.055)  # P99 59.9 ms (in (50, 60]), mean 55 ms
    assert (decision.reason, decision.detail) == ("tpot_avg", "TPOT avg 55 ms > 50 ms over 10 s")
    run = start(decode=2)
    assert run.seconds(30, running=20, tpot_s=0.04) == []


def test_the_real_example_log_line() -> None:
    config = replace(CONFIG, autoscale_window_s=60)
    run = start(decode=2, config=config, bounds={"prefill": (1, 3), "decode": (1, 3)})
    made = run.seconds(61, running=35)
    assert [d.log_line() for d in made] == ["autoscale: decode 2 -> 3: running/instance 17.5 > 15 for 60 s"]
    assert Decision("decode", 2, 3, "out", "running_per_worker", "running/instance 17.5 > 15 for 60 s").log_line() \
        == "autoscale: decode 2 -> 3: running/instance 17.5 > 15 for 60 s"


def test_scale_in_waits_for_the_cooldown_and_goes_one_step_at_a_time() -> None:
    run = start(prefill=1, decode=4)
    # decode: idle from the start (no earlier decision): one step once the window is covered...
    made = run.seconds(11, depth=0, running=0)
    assert [(d.role, d.current, d.desired, d.reason) for d in made] == [("decode", 4, 3, "idle")]
    # ...then one more only every cooldown (30 s), never two at once
    assert run.seconds(29, running=0) == []
    assert [(d.current, d.desired) for d in run.seconds(1, running=0)] == [(3, 2)]
    assert run.seconds(29, running=0) == []
    assert [(d.current, d.desired) for d in run.seconds(1, running=0)] == [(2, 1)]
    assert run.seconds(100, running=0) == []  # the minimum
    # prefill: out on depth, then idle: in only 30 s after the out, though the window held at 11 s
    run = start(prefill=1)
    [out] = run.seconds(11, depth=12)
    assert run.seconds(29, depth=0) == []
    [back] = run.seconds(1, depth=0)
    assert (out.desired, back.current, back.desired, back.direction) == (2, 2, 1, "in")
    assert back.detail == "queue depth <= 1 for 10 s, no request"
    # a busy decode pool does not shrink while TPOT is over its targets
    run = start(decode=3)
    assert [d.reason for d in run.seconds(11, running=3, tpot_s=0.2)] == ["tpot_p99"]


def test_never_below_the_minimum_or_above_the_maximum() -> None:
    run = start(prefill=5, decode=0)
    made = run.scaler.decide(run.current, 0.0)  # no reading needed: bounds act at once
    assert [(d.role, d.current, d.desired, d.direction, d.reason) for d in made] == \
        [("prefill", 5, 3, "in", "bounds"), ("decode", 0, 1, "out", "bounds")]
    assert made[0].detail == "above the maximum 3" and made[1].detail == "below the minimum 1"
    run = start(prefill=3, decode=4)
    assert run.seconds(60, depth=50, running=4 * 40, queue_latency_s=9.0, tpot_s=1.0) == []  # at the maximum
    assert run.metric("pdserve:autoscaler_desired_replicas", role="decode") == 4
    run = start(prefill=1, decode=1)
    assert run.seconds(120, depth=0, running=0) == []  # at the minimum
    with pytest.raises(ValueError, match="decode bounds 0:2: need 1 <= MIN <= MAX"):
        start(bounds={"prefill": (1, 1), "decode": (0, 2)})
    with pytest.raises(ValueError, match="prefill bounds 3:2"):
        start(bounds={"prefill": (3, 2), "decode": (1, 2)})
    with pytest.raises(ValueError, match="decode is missing"):
        start(bounds={"prefill": (1, 2)})


def test_prewarm_raises_the_minimum_inside_its_interval_only() -> None:
    config = replace(CONFIG, prewarm=("08:00-10:00=prefill:2,decode:3", "22:00-02:00=decode:2"))
    clock = [datetime(2026, 3, 2, 7, 59)]
    run = start(config=config, clock=clock)
    assert run.seconds(3) == []  # not yet
    clock[0] = datetime(2026, 3, 2, 8, 0)
    made = run.seconds(1)
    assert [(d.role, d.desired, d.reason) for d in made] == [("prefill", 2, "prewarm"), ("decode", 3, "prewarm")]
    assert made[1].log_line() == "autoscale: decode 1 -> 3: prewarm 08:00-10:00=prefill:2,decode:3 raises the " \
                                 "minimum to 3"
    assert run.seconds(100) == []  # idle, but the interval holds the minimum
    clock[0] = datetime(2026, 3, 2, 10, 0)  # over: no drop at once, the idle rule shrinks it step by step
    assert [(d.role, d.desired, d.reason) for d in run.seconds(1)] == [("prefill", 1, "idle"), ("decode", 2, "idle")]
    # the interval that wraps midnight
    for hour, minute, inside in ((21, 59, False), (22, 0, True), (23, 30, True), (1, 59, True), (2, 0, False)):
        clock[0] = datetime(2026, 3, 2, hour, minute)
        run = start(config=config, clock=clock)
        made = run.scaler.decide(run.current, 0.0)
        assert [(d.role, d.desired) for d in made] == ([("decode", 2)] if inside else []), (hour, minute)


@pytest.mark.parametrize(("changes", "message"), [
    ({"autoscale_window_s": 0}, "autoscale_window_s must be > 0"),
    ({"prefill_queue_low": 10}, "need 0 <= prefill_queue_low < prefill_queue_target, got 10 and 10"),
    ({"prefill_queue_low": -1}, "prefill_queue_low"),
    ({"prefill_queue_latency_target_s": 0}, "prefill_queue_latency_target_s must be > 0"),
    ({"decode_running_low": 12}, "decode_running_low < decode_running_target <= decode_running_high, got 12"),
    ({"decode_running_target": 16}, "got 4.0, 16 and 15.0"),
    ({"decode_tpot_target_ms": -5}, "decode_tpot_target_ms must be > 0"),
    ({"decode_tpot_avg_target_ms": 0}, "decode_tpot_avg_target_ms must be > 0"),
    ({"scale_in_cooldown_s": -1}, "scale_in_cooldown_s must be >= 0"),
    ({"prewarm": ("08:00-10:00",)}, "expected HH:MM-HH:MM=ROLE:N"),
    ({"prewarm": ("8h-10:00=decode:2",)}, "'8h' is not HH:MM"),
    ({"prewarm": ("25:00-10:00=decode:2",)}, "'25:00' is not a time of day"),
    ({"prewarm": ("24:00-10:00=decode:2",)}, "'24:00' is not a time of day"),
    ({"prewarm": ("08:00-08:00=decode:2",)}, "the interval is empty"),
    ({"prewarm": ("08:00-10:00=gpu:2",)}, "'gpu:2' is not ROLE:N"),
    ({"prewarm": ("08:00-10:00=decode:0",)}, "the decode minimum must be a whole number >= 1, got '0'"),
    ({"prewarm": ("08:00-10:00=decode:2,decode:3",)}, "decode is named twice"),
])
def test_validate_says_what_is_wrong(changes: dict[str, object], message: str) -> None:
    config = replace(CONFIG, **changes)
    with pytest.raises(ValueError, match=re.escape(message)):
        config.validate()
    with pytest.raises(ValueError):
        start(config=config)


def test_valid_configs_pass() -> None:
    AutoscaleConfig().validate()
    replace(CONFIG, prewarm=("00:00-24:00=prefill:1", "23:00-01:30=decode:2,prefill:2")).validate()
    with pytest.raises(ValueError, match="asks for 5 decode workers, above the maximum 4"):
        start(config=replace(CONFIG, prewarm=("08:00-10:00=decode:5",)))


def test_metrics_count_every_decision_and_show_the_desired_size() -> None:
    run = start(prefill=1, decode=2)
    run.seconds(11, depth=12, running=35)
    assert run.metric("pdserve:autoscaler_desired_replicas", role="prefill") == 2
    assert run.metric("pdserve:autoscaler_desired_replicas", role="decode") == 4
    assert run.metric("pdserve:autoscaler_decisions_total", role="prefill", direction="out",
                      reason="queue_depth") == 1
    assert run.metric("pdserve:autoscaler_decisions_total", role="decode", direction="out",
                      reason="running_per_worker") == 1
    run.seconds(1, depth=12, running=35)
    assert run.metric("pdserve:autoscaler_desired_replicas", role="decode") == 4  # no decision: the current size
    run.seconds(40, depth=0, running=0)
    assert run.metric("pdserve:autoscaler_decisions_total", role="decode", direction="in", reason="idle") == 1
    assert run.metric("pdserve:autoscaler_decisions_total", role="prefill", direction="in", reason="idle") == 1
    assert run.metric("pdserve:autoscaler_desired_replicas", role="decode") == 3
    assert run.metric("pdserve:autoscaler_decisions_total", role="decode", direction="out",
                      reason="tpot_p99") is None
    assert len(run.decisions) == 4


def test_every_knob_is_a_flag_and_survives_the_command_line() -> None:
    parser = argparse.ArgumentParser()
    add_config_args(parser, AutoscaleConfig)
    config = config_from_args(AutoscaleConfig, parser.parse_args(
        ["--autoscale-window-s", "5", "--decode-tpot-target-ms", "80", "--prewarm", "08:00-10:00=decode:2",
         "22:00-02:00=prefill:2"]))
    assert config == replace(AutoscaleConfig(), autoscale_window_s=5, decode_tpot_target_ms=80,
                             prewarm=("08:00-10:00=decode:2", "22:00-02:00=prefill:2"))
    assert config_from_args(AutoscaleConfig, parser.parse_args(to_argv(config))) == config
    assert config_from_args(AutoscaleConfig, parser.parse_args([])) == AutoscaleConfig()
    assert "--scale-in-cooldown-s" in parser.format_help() and "--prefill-queue-low" in parser.format_help()
