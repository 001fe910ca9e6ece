"""The autoscaling policy: how many prefill and decode workers the pool should have, from what the
router sees. `pdserve up --autoscale` calls it; k8s_autoscale.py renders the same rules as KEDA/HPA
objects, so they are stated here declaratively, each with the PromQL it amounts to (`w` is
`autoscale_window_s`, series from the router's GET /metrics; with several routers take `max` over
routers for the depth, which each router reads whole from the shared queue).

    The supervisor, about once a second:
        signals = scrape(router_url)              # pdserve/ops/signals.py; None: skip observe
        autoscaler.observe(signals)
        for decision in autoscaler.decide(live_workers_per_role, time.monotonic()):
            log decision.log_line(); start workers, or drain the surplus

Rules, per role, first match wins; `desired` is then clamped to [min, max]. Series: DEPTH =
pdserve:prefill_queue_depth, QLAT = pdserve:prefill_queue_latency_seconds, TPOT =
pdserve:request_time_per_output_token_seconds, PER = pdserve:decode_running /
pdserve:workers_ready{worker_role="decode"} (running requests per ready decode worker).

  bounds   current < min  -> min (reason `prewarm` when a pre-warm interval raised it, else `bounds`)
           current > max  -> max (reason `bounds`)
  prefill  out +1, `queue_depth`:    min_over_time(DEPTH[w]) > prefill_queue_target
           out +1, `queue_latency`:  histogram_quantile(0.9, rate(QLAT_bucket[w])) > prefill_queue_latency_target_s
           in -1,  `idle`:           max_over_time(DEPTH[w]) <= prefill_queue_low and that P90 is below
                                     prefill_queue_latency_target_s / 2 (or no request got a first token in w)
  decode   out,    `running_per_worker`: min_over_time(PER[w]) > decode_running_high, to
                                     max(current + 1, ceil(pdserve:decode_running / decode_running_target))
           out +1, `tpot_p99`:       histogram_quantile(0.99, rate(TPOT_bucket[w])) > decode_tpot_target_ms
           out +1, `tpot_avg`:       rate(TPOT_sum[w]) / rate(TPOT_count[w]) > decode_tpot_avg_target_ms
           in -1,  `idle`:           max_over_time(PER[w]) < decode_running_low, and neither TPOT rule holds
                                     (or no request finished in w)

Never on CPU or GPU utilisation. Timing:
- A role's window must be covered: a reading at or before `now - w` (and none of the rules counts
  readings older than the role's last decision: after a decision, that role's window starts
  again, so a worker being added has time to load before the next step); the newest reading must
  be under 5 s old. A router that restarted (its counters went back) starts every window again.
- Scale-in also waits `scale_in_cooldown_s` after any decision of that role, and goes one worker at
  a time; it is always a drain (the supervisor's part). Scale-out is immediate once a rule holds.
- Bounds and pre-warm act at once, window or not; when a pre-warm interval ends the minimum drops
  back, and the pool shrinks by the idle rule, not at once.
- No latency signal is not a good latency: a window in which no request finished has no P90/P99/
  mean (None). It never scales out, and it does not block scale-in, which then rests on the depth
  or concurrency alone: a pool that stays idle shrinks, while requests that are stuck keep the
  depth up (the latency histograms are observed only as requests get their first token or finish,
  so a stuck pool shows in the depth, not in the latencies).
- A worker slower to load than `w` may see a second step before it is ready: keep `w` above load time.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge

from pdserve.config import knob
from pdserve.ops.prewarm import PrewarmRule, parse_prewarm, prewarm_minimum
from pdserve.ops.signals import ROLES, HistogramSnapshot, Role, Signals, mean, quantile

__all__ = ["AutoscaleConfig", "Autoscaler", "Decision", "HistogramSnapshot", "Reason", "Role", "Signals"]

Direction = Literal["out", "in"]
Reason = Literal["queue_depth", "queue_latency", "running_per_worker", "tpot_p99", "tpot_avg", "idle", "prewarm",
                 "bounds"]
_STALE_S = 5.0  # a window whose newest reading is older than this decides nothing


@dataclass(frozen=True, slots=True)
class AutoscaleConfig:
    """`pdserve up --autoscale`: when each role's pool grows and shrinks (pdserve/ops/autoscale.py)."""

    autoscale_window_s: float = knob(60.0, "a scaling condition must hold this long (s); after a decision about "
                                           "a role, that role's window starts again")
    prefill_queue_target: float = knob(10.0, "prefill scales out when the prefill queue depth stays above this "
                                             "for the window")
    prefill_queue_latency_target_s: float = knob(1.5, "...or when the queue latency P90 over the window is above "
                                                      "this (s)")
    prefill_queue_low: float = knob(1.0, "prefill scales in when the queue depth stays at or below this for the "
                                         "window and the queue latency P90 is under half its target")
    decode_running_high: float = knob(15.0, "decode scales out when running requests per ready decode worker "
                                            "stay above this for the window")
    decode_running_target: float = knob(10.0, "...to ceil(running requests / this) workers (at least one more)")
    decode_running_low: float = knob(4.0, "decode scales in when running requests per worker stay below this for "
                                          "the window and TPOT is within its targets")
    decode_tpot_target_ms: float = knob(60.0, "decode scales out when the TPOT P99 over the window is above this "
                                              "(ms)")
    decode_tpot_avg_target_ms: float = knob(50.0, "...or when the average TPOT over the window is above this (ms)")
    scale_in_cooldown_s: float = knob(300.0, "no scale-in of a role within this long after any scaling decision "
                                             "about it (s)")
    prewarm: tuple[str, ...] = knob((), "HH:MM-HH:MM=prefill:N,decode:M (local time; wraps midnight when the end "
                                        "comes first): raises the minimum pool sizes in that interval")

    def validate(self) -> None:
        checks = [
            (self.autoscale_window_s > 0, f"autoscale_window_s must be > 0, got {self.autoscale_window_s}"),
            (0 <= self.prefill_queue_low < self.prefill_queue_target,
             f"need 0 <= prefill_queue_low < prefill_queue_target, got {self.prefill_queue_low} and "
             f"{self.prefill_queue_target}"),
            (self.prefill_queue_latency_target_s > 0,
             f"prefill_queue_latency_target_s must be > 0, got {self.prefill_queue_latency_target_s}"),
            (0 <= self.decode_running_low < self.decode_running_target <= self.decode_running_high,
             "need 0 <= decode_running_low < decode_running_target <= decode_running_high, got "
             f"{self.decode_running_low}, {self.decode_running_target} and {self.decode_running_high}"),
            (self.decode_tpot_target_ms > 0, f"decode_tpot_target_ms must be > 0, got {self.decode_tpot_target_ms}"),
            (self.decode_tpot_avg_target_ms > 0,
             f"decode_tpot_avg_target_ms must be > 0, got {self.decode_tpot_avg_target_ms}"),
            (self.scale_in_cooldown_s >= 0, f"scale_in_cooldown_s must be >= 0, got {self.scale_in_cooldown_s}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        for spec in self.prewarm:
            parse_prewarm(spec)


@dataclass(frozen=True, slots=True)
class Decision:
    """Resize `role` from `current` to `desired` workers."""

    role: Role
    current: int
    desired: int
    direction: Direction
    reason: Reason  # the rule, a label of pdserve:autoscaler_decisions_total
    detail: str  # for people: "running/instance 17.5 > 15 for 60 s"

    def log_line(self) -> str:
        return f"autoscale: {self.role} {self.current} -> {self.desired}: {self.detail}"


@dataclass(frozen=True, slots=True)
class _Proposal:
    """What a rule asks for, before the bounds clamp it."""

    direction: Direction
    desired: int
    reason: Reason
    detail: str


@dataclass(frozen=True, slots=True)
class _Window:
    """The readings a role's rules judge: `readings[0]` is the latest one at or before the window's
    start (the baseline the histograms are diffed against), the last one the newest."""

    readings: tuple[Signals, ...]
    window_s: float

    def quantile(self, pick: Callable[[Signals], HistogramSnapshot], q: float) -> float | None:
        return quantile(pick(self.readings[0]), pick(self.readings[-1]), q)

    def mean(self, pick: Callable[[Signals], HistogramSnapshot]) -> float | None:
        return mean(pick(self.readings[0]), pick(self.readings[-1]))

    def held(self, what: str) -> str:
        return f"{what} for {_num(self.window_s)} s"


def _num(value: float) -> str:
    """17.5 -> '17.5', 60.0 -> '60', 0.1234 -> '0.12'."""
    return str(int(value)) if float(value).is_integer() else f"{value:.2f}".rstrip("0").rstrip(".")


def _queue_latency(s: Signals) -> HistogramSnapshot:
    return s.queue_latency


def _tpot(s: Signals) -> HistogramSnapshot:
    return s.tpot


def _per_instance(s: Signals) -> float | None:
    """Running requests per ready decode worker; None while none is ready (no signal)."""
    return s.decode_running / s.ready["decode"] if s.ready.get("decode", 0) > 0 else None


def _prefill_out(c: AutoscaleConfig, w: _Window, current: int) -> _Proposal | None:
    depths = [r.prefill_queue_depth for r in w.readings]
    if min(depths) > c.prefill_queue_target:
        return _Proposal("out", current + 1, "queue_depth",
                         w.held(f"queue depth {_num(depths[-1])} > {_num(c.prefill_queue_target)}"))
    p90 = w.quantile(_queue_latency, 0.9)
    if p90 is not None and p90 > c.prefill_queue_latency_target_s:
        return _Proposal("out", current + 1, "queue_latency", f"queue latency P90 {_num(p90)} s > "
                         f"{_num(c.prefill_queue_latency_target_s)} s over {_num(w.window_s)} s")
    return None


def _prefill_in(c: AutoscaleConfig, w: _Window, current: int) -> _Proposal | None:
    depths = [r.prefill_queue_depth for r in w.readings]
    p90 = w.quantile(_queue_latency, 0.9)
    half = c.prefill_queue_latency_target_s / 2
    if max(depths) > c.prefill_queue_low or (p90 is not None and p90 >= half):
        return None
    latency = "no request" if p90 is None else f"queue latency P90 {_num(p90)} s < {_num(half)} s"
    return _Proposal("in", current - 1, "idle", w.held(f"queue depth <= {_num(c.prefill_queue_low)}") + f", {latency}")


def _tpot_ms(w: _Window) -> tuple[float | None, float | None]:
    p99, avg = w.quantile(_tpot, 0.99), w.mean(_tpot)
    return (None if p99 is None else 1000 * p99), (None if avg is None else 1000 * avg)


def _decode_out(c: AutoscaleConfig, w: _Window, current: int) -> _Proposal | None:
    per = [_per_instance(r) for r in w.readings]
    if all(p is not None and p > c.decode_running_high for p in per):
        desired = max(current + 1, math.ceil(w.readings[-1].decode_running / c.decode_running_target))
        return _Proposal("out", desired, "running_per_worker",
                         w.held(f"running/instance {_num(per[-1] or 0)} > {_num(c.decode_running_high)}"))
    p99, avg = _tpot_ms(w)
    over = f"over {_num(w.window_s)} s"
    if p99 is not None and p99 > c.decode_tpot_target_ms:
        return _Proposal("out", current + 1, "tpot_p99",
                         f"TPOT P99 {_num(p99)} ms > {_num(c.decode_tpot_target_ms)} ms {over}")
    if avg is not None and avg > c.decode_tpot_avg_target_ms:
        return _Proposal("out", current + 1, "tpot_avg",
                         f"TPOT avg {_num(avg)} ms > {_num(c.decode_tpot_avg_target_ms)} ms {over}")
    return None


def _decode_in(c: AutoscaleConfig, w: _Window, current: int) -> _Proposal | None:
    """Called only when `_decode_out` proposed nothing: TPOT is within its targets (or unknown)."""
    per = [_per_instance(r) for r in w.readings]
    if not all(p is not None and p < c.decode_running_low for p in per):
        return None
    p99, _ = _tpot_ms(w)
    tpot = "no request finished" if p99 is None else f"TPOT P99 {_num(p99)} ms"
    return _Proposal("in", current - 1, "idle",
                     w.held(f"running/instance {_num(per[-1] or 0)} < {_num(c.decode_running_low)}") + f", {tpot}")


_RULES = {"prefill": (_prefill_out, _prefill_in), "decode": (_decode_out, _decode_in)}


class Autoscaler:
    """The policy (see the module docstring). `bounds` are each role's (min, max) workers; the
    metrics go to `registry`; `wall_clock` (local time) places the pre-warm intervals. Not
    thread-safe: one caller observes and decides."""

    def __init__(self, config: AutoscaleConfig, bounds: Mapping[Role, tuple[int, int]], *,
                 registry: CollectorRegistry, wall_clock: Callable[[], datetime] = datetime.now) -> None:
        config.validate()
        self.config = config
        self.bounds = _checked_bounds(bounds)
        self.prewarm = [parse_prewarm(spec) for spec in config.prewarm]
        for rule in self.prewarm:
            for role, minimum in rule.minimum.items():
                if minimum > self.bounds[role][1]:
                    raise ValueError(f"prewarm {rule.spec!r} asks for {minimum} {role} workers, above the "
                                     f"maximum {self.bounds[role][1]}")
        self._wall_clock = wall_clock
        self._readings: deque[Signals] = deque()
        self._last_decision: dict[Role, float] = dict.fromkeys(ROLES, -math.inf)
        self._desired = Gauge("pdserve:autoscaler_desired_replicas", "Autoscaler: workers each role should have",
                              ["role"], registry=registry)
        self._decisions = Counter("pdserve:autoscaler_decisions", "Autoscaler: scaling decisions by role, "
                                  "direction (out, in) and reason", ["role", "direction", "reason"],
                                  registry=registry)

    def observe(self, signals: Signals) -> None:
        """One more reading (older or same-time ones are ignored). Keeps the window, plus the
        latest reading before it (the baseline)."""
        if self._readings and signals.time <= self._readings[-1].time:
            return
        if self._readings and _restarted(self._readings[-1], signals):
            self._readings.clear()  # its counters went back: no window spans the restart
        self._readings.append(signals)
        start = signals.time - self.config.autoscale_window_s
        while len(self._readings) >= 2 and self._readings[1].time <= start:
            self._readings.popleft()

    def decide(self, current: Mapping[Role, int], now: float) -> list[Decision]:
        """At most one decision per role. `current`: the live (not draining) workers per role;
        `now`: monotonic seconds, the clock of `Signals.time`."""
        decisions = []
        for role in ROLES:
            decision = self._decide(role, current[role], now)
            if decision is not None:
                decisions.append(decision)
                self._last_decision[role] = now
                self._decisions.labels(role, decision.direction, decision.reason).inc()
            self._desired.labels(role).set(current[role] if decision is None else decision.desired)
        return decisions

    def _decide(self, role: Role, current: int, now: float) -> Decision | None:
        low, high, rule = self._limits(role)
        proposal = _bounds_proposal(current, low, high, rule) or self._rule_proposal(role, current, now)
        if proposal is None:
            return None
        desired = min(high, max(low, proposal.desired))
        if desired == current:
            return None
        return Decision(role, current, desired, proposal.direction, proposal.reason, proposal.detail)

    def _limits(self, role: Role) -> tuple[int, int, PrewarmRule | None]:
        """(min, max) now, and the pre-warm rule that raised the minimum (None if none did)."""
        low, high = self.bounds[role]
        prewarm, rule = prewarm_minimum(self.prewarm, role, self._wall_clock())
        return (prewarm, high, rule) if prewarm > low else (low, high, None)

    def _rule_proposal(self, role: Role, current: int, now: float) -> _Proposal | None:
        window = self._window(role, now)
        if window is None:
            return None
        scale_out, scale_in = _RULES[role]
        proposal = scale_out(self.config, window, current)
        if proposal is not None or now - self._last_decision[role] < self.config.scale_in_cooldown_s:
            return proposal
        return scale_in(self.config, window, current)

    def _window(self, role: Role, now: float) -> _Window | None:
        """The readings since `role`'s last decision covering [now - window, now]; None when they
        do not (too few, or the newest too old)."""
        window_s = self.config.autoscale_window_s
        readings = [r for r in self._readings if self._last_decision[role] < r.time <= now]
        starts = [i for i, r in enumerate(readings) if r.time <= now - window_s]
        if not starts or readings[-1].time < now - _STALE_S:
            return None
        return _Window(tuple(readings[starts[-1]:]), window_s)


def _bounds_proposal(current: int, low: int, high: int, rule: PrewarmRule | None) -> _Proposal | None:
    if current > high:
        return _Proposal("in", high, "bounds", f"above the maximum {high}")
    if current < low and rule is not None:
        return _Proposal("out", low, "prewarm", f"prewarm {rule.spec} raises the minimum to {low}")
    if current < low:
        return _Proposal("out", low, "bounds", f"below the minimum {low}")
    return None


def _checked_bounds(bounds: Mapping[Role, tuple[int, int]]) -> dict[Role, tuple[int, int]]:
    checked: dict[Role, tuple[int, int]] = {}
    for role in ROLES:
        if role not in bounds:
            raise ValueError(f"autoscale bounds must name both roles; {role} is missing")
        low, high = bounds[role]
        if not 1 <= low <= high:
            raise ValueError(f"{role} bounds {low}:{high}: need 1 <= MIN <= MAX")
        checked[role] = (low, high)
    return checked


def _restarted(before: Signals, after: Signals) -> bool:
    return after.queue_latency.count < before.queue_latency.count or after.tpot.count < before.tpot.count
