"""Serving metrics from request records: pure functions, no I/O.

Definitions (vLLM's `vllm bench serve`, so numbers can be compared side by side):

- TTFT: send -> first content chunk.
- TPOT: (E2E - TTFT) / (output tokens - 1), per request: the first token is excluded; a request
  with one output token has no TPOT.
- ITL: the gaps between consecutive content chunks, pooled over all requests.
- E2E (vLLM's `e2el`): send -> end of the response.
- Throughputs divide by the run's duration (first send -> last response); only successful requests count.
- Goodput: successful requests per second that met every SLO given (`--slo ttft=MS,tpot=MS,e2el=MS`).

Percentiles interpolate linearly between the closest ranks (numpy's default, as vLLM uses).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from pdserve.bench.serve.client import RequestRecord

PERCENTILES = (50, 90, 99)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass(frozen=True, slots=True)
class Slo:
    """Service-level objectives in milliseconds; None: not constrained."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @classmethod
    def parse(cls, text: str) -> Slo:
        """`ttft=2500,tpot=50` -> Slo(2500, 50)."""
        values: dict[str, float] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, _, value = item.partition("=")
            key = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2el": "e2el_ms", "e2e": "e2el_ms"}.get(name.strip())
            if key is None or not value:
                raise ValueError(f"bad SLO {item!r}: expected ttft=MS, tpot=MS or e2el=MS")
            values[key] = float(value)
        return cls(**values)

    @property
    def needs_stream(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None

    def __str__(self) -> str:
        parts = [f"{n}<={v:g}ms" for n, v in (("ttft", self.ttft_ms), ("tpot", self.tpot_ms), ("e2el", self.e2el_ms))
                 if v is not None]
        return ", ".join(parts) or "none"


@dataclass(frozen=True, slots=True)
class LatencyStats:
    """One latency metric in milliseconds; NaN when there were no samples."""

    mean_ms: float
    median_ms: float
    std_ms: float
    percentiles_ms: dict[int, float]

    @classmethod
    def of(cls, values_s: Sequence[float]) -> LatencyStats:
        if not values_s:
            return cls(math.nan, math.nan, math.nan, {p: math.nan for p in PERCENTILES})
        ms = np.asarray(values_s, dtype=float) * 1000.0
        return cls(float(ms.mean()), float(np.median(ms)), float(ms.std()),
                   {p: percentile(ms, p) for p in PERCENTILES})


@dataclass(frozen=True, slots=True)
class Summary:
    """One run's results. `to_vllm_dict()` names them as `vllm bench serve --save-result` does."""

    duration_s: float
    num_requests: int
    completed: int
    cancelled: int
    failures: dict[str, int]  # error kind -> count
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    request_goodput: float | None  # None without SLOs
    max_concurrent_requests: int
    latency: dict[str, LatencyStats]  # "ttft", "tpot", "itl", "e2el"
    slo: Slo = field(default_factory=Slo)

    @property
    def failed(self) -> int:
        return sum(self.failures.values())

    def to_vllm_dict(self) -> dict[str, float | int | dict[str, int] | None]:
        out: dict[str, float | int | dict[str, int] | None] = {
            "duration": self.duration_s, "num_prompts": self.num_requests, "completed": self.completed,
            "failed": self.failed, "cancelled": self.cancelled, "failures_by_kind": dict(self.failures),
            "total_input_tokens": self.total_input_tokens, "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.request_throughput, "request_goodput": self.request_goodput,
            "output_throughput": self.output_throughput, "total_token_throughput": self.total_token_throughput,
            "max_concurrent_requests": self.max_concurrent_requests,
        }
        for name in LATENCY_METRICS:
            stats = self.latency[name]
            out[f"mean_{name}_ms"] = stats.mean_ms
            out[f"median_{name}_ms"] = stats.median_ms
            out[f"std_{name}_ms"] = stats.std_ms
            for p, value in stats.percentiles_ms.items():
                out[f"p{p}_{name}_ms"] = value
        return out


def percentile(values: Sequence[float] | np.ndarray, q: float) -> float:
    """q-th percentile, linear interpolation between closest ranks; NaN for no values."""
    if len(values) == 0:
        return math.nan
    return float(np.percentile(np.asarray(values, dtype=float), q))


def tpot_s(record: RequestRecord) -> float | None:
    """Time per output token after the first; None without a TTFT or with fewer than two tokens."""
    if record.ttft_s is None or record.output_tokens < 2:
        return None
    return (record.e2e_s - record.ttft_s) / (record.output_tokens - 1)


def itls_s(record: RequestRecord) -> list[float]:
    times = record.chunk_times_s
    return [b - a for a, b in zip(times[:-1], times[1:], strict=True)]


def meets_slo(record: RequestRecord, slo: Slo) -> bool:
    """A successful request within every SLO given. A missing TTFT/TPOT fails a TTFT/TPOT SLO."""
    if not record.ok:
        return False
    if slo.ttft_ms is not None and (record.ttft_s is None or record.ttft_s * 1000 > slo.ttft_ms):
        return False
    tpot = tpot_s(record)
    # NOTE: a single-token request has no TPOT and cannot miss a TPOT SLO.
    if slo.tpot_ms is not None and record.output_tokens >= 2 and (tpot is None or tpot * 1000 > slo.tpot_ms):
        return False
    return slo.e2el_ms is None or record.e2e_s * 1000 <= slo.e2el_ms


def max_concurrent(records: Sequence[RequestRecord]) -> int:
    """The most requests in flight at once (sweep over send/finish events; a finish at t frees its
    slot before a send at t)."""
    events = sorted([(r.sent_s, 1) for r in records] + [(r.sent_s + r.e2e_s, -1) for r in records],
                    key=lambda e: (e[0], e[1]))
    peak = level = 0
    for _, delta in events:
        level += delta
        peak = max(peak, level)
    return peak


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: Slo | None = None) -> Summary:
    slo = slo or Slo()
    ok = [r for r in records if r.ok]
    failures = Counter(r.error_kind for r in records if r.error_kind is not None)
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    tpots = [t for t in map(tpot_s, ok) if t is not None]
    latency = {
        "ttft": LatencyStats.of([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot": LatencyStats.of(tpots),
        "itl": LatencyStats.of([gap for r in ok for gap in itls_s(r)]),
        "e2el": LatencyStats.of([r.e2e_s for r in ok]),
    }
    per_s = 1.0 / duration_s if duration_s > 0 else math.nan
    constrained = any(v is not None for v in (slo.ttft_ms, slo.tpot_ms, slo.e2el_ms))
    goodput = sum(meets_slo(r, slo) for r in ok) * per_s if constrained else None
    return Summary(
        duration_s=duration_s, num_requests=len(records), completed=len(ok),
        cancelled=sum(r.cancelled for r in records), failures=dict(sorted(failures.items())),
        total_input_tokens=total_in, total_output_tokens=total_out, request_throughput=len(ok) * per_s,
        output_throughput=total_out * per_s, total_token_throughput=(total_in + total_out) * per_s,
        request_goodput=goodput, max_concurrent_requests=max_concurrent(records), latency=latency, slo=slo)
