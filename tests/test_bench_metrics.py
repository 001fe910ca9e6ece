"""`pdserve bench` metric math against hand-computed cases, and workload generation (pure, no server)."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from pdserve.bench.serve import workloads
from pdserve.bench.serve.client import RequestRecord
from pdserve.bench.serve.metrics import Slo, itls_s, max_concurrent, meets_slo, percentile, summarize, tpot_s


def _record(index: int = 0, *, sent_s: float = 0.0, ttft_s: float | None = 0.1, e2e_s: float = 1.0,
            output_tokens: int = 10, prompt_tokens: int = 100, chunk_times_s: tuple[float, ...] = (),
            error_kind: str | None = None, cancelled: bool = False) -> RequestRecord:
    return RequestRecord(index, sent_s, e2e_s, prompt_tokens, output_tokens, ttft_s, chunk_times_s, error_kind,
                         cancelled=cancelled)


# -- metrics -------------------------------------------------------------------------------------

def test_percentiles_interpolate_linearly_between_ranks() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile(list(range(1, 11)), 90) == pytest.approx(9.1)  # rank 0.9 * 9 = 8.1 -> 9 + 0.1
    assert percentile([0, 100], 99) == pytest.approx(99.0)
    assert percentile([7], 99) == 7
    assert math.isnan(percentile([], 50))


def test_tpot_excludes_the_first_token() -> None:
    # 10 tokens: the first at 0.1 s, the other 9 over the remaining 0.9 s -> 0.1 s each.
    assert tpot_s(_record(ttft_s=0.1, e2e_s=1.0, output_tokens=10)) == pytest.approx(0.1)
    assert tpot_s(_record(ttft_s=0.2, e2e_s=0.5, output_tokens=4)) == pytest.approx(0.1)
    assert tpot_s(_record(output_tokens=1)) is None  # no token after the first
    assert tpot_s(_record(ttft_s=None)) is None  # not streamed


def test_itl_is_the_gaps_between_content_chunks() -> None:
    assert itls_s(_record(chunk_times_s=(0.1, 0.15, 0.3))) == pytest.approx([0.05, 0.15])
    assert itls_s(_record(chunk_times_s=(0.1,))) == []


def test_goodput_counts_successes_within_every_slo() -> None:
    slo = Slo.parse("ttft=200,tpot=50")
    assert slo == Slo(ttft_ms=200, tpot_ms=50)
    good = _record(0, ttft_s=0.1, e2e_s=0.5, output_tokens=10)  # TPOT 0.4 / 9 = 44 ms
    slow_first = _record(1, ttft_s=0.3, e2e_s=0.5, output_tokens=10)
    slow_decode = _record(2, ttft_s=0.1, e2e_s=1.0, output_tokens=10)  # TPOT 100 ms
    failed = _record(3, error_kind="http_500", output_tokens=0)
    assert [meets_slo(r, slo) for r in (good, slow_first, slow_decode, failed)] == [True, False, False, False]
    summary = summarize([good, slow_first, slow_decode, failed], duration_s=2.0, slo=slo)
    assert summary.request_goodput == pytest.approx(0.5)  # one good request in 2 s
    assert summary.request_throughput == pytest.approx(1.5)
    assert summarize([good], 1.0).request_goodput is None  # no SLO, no goodput
    assert Slo.parse("e2el=1000").e2el_ms == 1000 and not Slo.parse("e2el=1000").needs_stream
    with pytest.raises(ValueError):
        Slo.parse("ttft")


def test_summary_throughput_latencies_and_failures() -> None:
    records = [
        _record(0, sent_s=0.0, ttft_s=0.1, e2e_s=1.0, output_tokens=10, prompt_tokens=100,
                chunk_times_s=(0.1, 0.4, 1.0)),
        _record(1, sent_s=0.5, ttft_s=0.3, e2e_s=1.5, output_tokens=5, prompt_tokens=50, chunk_times_s=(0.3, 0.5)),
        _record(2, sent_s=0.2, error_kind="http_429", output_tokens=0, e2e_s=0.01),
        _record(3, sent_s=0.2, error_kind="timeout", output_tokens=0, e2e_s=0.5),
        _record(4, sent_s=0.2, error_kind="http_429", output_tokens=0, e2e_s=0.01),
        _record(5, sent_s=3.0, cancelled=True, output_tokens=3, e2e_s=0.1),
    ]
    s = summarize(records, duration_s=4.0)
    assert (s.num_requests, s.completed, s.cancelled, s.failed) == (6, 2, 1, 3)
    assert s.failures == {"http_429": 2, "timeout": 1}
    assert (s.total_input_tokens, s.total_output_tokens) == (150, 15)  # successes only
    assert s.output_throughput == pytest.approx(15 / 4) and s.total_token_throughput == pytest.approx(165 / 4)
    assert s.latency["ttft"].mean_ms == pytest.approx(200.0) and s.latency["ttft"].median_ms == pytest.approx(200.0)
    assert s.latency["tpot"].mean_ms == pytest.approx((100.0 + 300.0) / 2)  # 0.9/9 and 1.2/4
    assert s.latency["itl"].mean_ms == pytest.approx((300 + 600 + 200) / 3)
    assert s.latency["e2el"].percentiles_ms[99] == pytest.approx(1000 + 0.99 * 500)
    assert s.max_concurrent_requests == 4  # 0.2-0.21 s: requests 0, 2, 3, 4 (1 starts after 2 and 4 end)
    out = s.to_vllm_dict()
    for key in ("completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
                "output_throughput", "total_token_throughput", "request_goodput", "mean_ttft_ms", "median_tpot_ms",
                "p99_ttft_ms", "p99_tpot_ms", "mean_itl_ms", "p90_e2el_ms", "std_itl_ms"):
        assert key in out, key
    assert math.isnan(summarize([], 1.0).latency["ttft"].percentiles_ms[99])


def test_max_concurrent_frees_a_slot_before_the_next_send() -> None:
    back_to_back = [_record(0, sent_s=0.0, e2e_s=1.0), _record(1, sent_s=1.0, e2e_s=1.0)]
    assert max_concurrent(back_to_back) == 1
    assert max_concurrent([_record(0, sent_s=0.0, e2e_s=1.0), _record(1, sent_s=0.5, e2e_s=1.0)]) == 2


# -- workloads -----------------------------------------------------------------------------------

def test_mix_counts_are_exact_proportions() -> None:
    assert workloads.mix_counts(10, (6, 3, 1)) == [6, 3, 1]
    assert workloads.mix_counts(100, (6, 3, 1)) == [60, 30, 10]
    assert sum(workloads.mix_counts(7, (6, 3, 1))) == 7


def test_seed_mix_ratios_scale_and_determinism() -> None:
    work = workloads.seed_mix(20, scale=0.05, seed=3)
    lens = [spec.prompt_len for spec in work.requests]
    assert sorted(set(lens)) == [25, 100, 250] and [lens.count(n) for n in (25, 100, 250)] == [12, 6, 2]
    assert all(len(spec.prompt) == spec.prompt_len for spec in work.requests)  # token ids: exact lengths
    assert all(spec.max_tokens == 25 for spec in work.requests)  # 500 x 0.05
    assert all(100 <= t < 32000 for spec in work.requests for t in spec.prompt)  # type: ignore[union-attr]
    assert workloads.seed_mix(20, scale=0.05, seed=3) == work
    assert workloads.seed_mix(20, scale=0.05, seed=4) != work
    full = workloads.seed_mix(10, output_len=7)
    assert sorted(spec.prompt_len for spec in full.requests) == [500] * 6 + [2000] * 3 + [5000]
    assert {spec.max_tokens for spec in full.requests} == {7}
    text = workloads.seed_mix(4, scale=0.01, kind=workloads.PromptKind(as_text=True))
    assert all(isinstance(s.prompt, str) and len(s.prompt.split()) == s.prompt_len for s in text.requests)


def test_random_and_shared_prefix_workloads() -> None:
    work = workloads.random_lengths(200, 100, 20, range_ratio=0.5, seed=1)
    assert all(50 <= s.prompt_len <= 150 and 10 <= s.max_tokens <= 30 for s in work.requests)
    assert len({s.prompt_len for s in work.requests}) > 10
    shared = workloads.shared_prefix(6, workloads.SharedPrefixes(32, count=2), suffix_len=8, output_len=4, seed=1)
    prompts = [s.prompt for s in shared.requests]
    assert all(len(p) == 40 for p in prompts)
    assert prompts[0][:32] == prompts[2][:32] != prompts[1][:32] and prompts[0][32:] != prompts[2][32:]


def test_sharegpt_file(tmp_path: Path) -> None:
    convo = [{"from": "human", "value": "word " * 40}, {"from": "gpt", "value": "reply " * 30}]
    data = [{"conversations": convo}, {"conversations": convo[:1]}, {"conversations": [convo[0], {"value": "no"}]}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data * 3))
    work = workloads.sharegpt(path, 10, seed=0)
    assert len(work.requests) == 3  # the one-turn and the too-short-reply conversations are skipped
    assert work.requests[0].prompt_len == 50 and work.requests[0].max_tokens == 45  # 4 characters a token
    assert workloads.sharegpt(path, 10, count_tokens=lambda text: len(text.split())).requests[0].max_tokens == 30


def test_arrivals_are_gamma_with_the_requested_rate_and_burstiness() -> None:
    assert workloads.arrival_offsets_s(3, math.inf) == [0.0, 0.0, 0.0]
    offsets = workloads.arrival_offsets_s(4000, 10.0, seed=1)
    gaps = [b - a for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
    assert offsets[0] == 0.0 and statistics.fmean(gaps) == pytest.approx(0.1, rel=0.05)
    # gamma with shape k has a coefficient of variation of 1 / sqrt(k): Poisson 1, bursty 2, regular 0.5
    for burstiness, cv in ((1.0, 1.0), (0.25, 2.0), (4.0, 0.5)):
        gaps = workloads.arrival_offsets_s(4000, 10.0, burstiness, seed=1)
        diffs = [b - a for a, b in zip(gaps[1:-1], gaps[2:], strict=True)]
        assert statistics.pstdev(diffs) / statistics.fmean(diffs) == pytest.approx(cv, rel=0.1)
    assert workloads.arrival_offsets_s(5, 2.0, seed=9) == workloads.arrival_offsets_s(5, 2.0, seed=9)


def test_compare_ratios_divide_by_the_baseline() -> None:
    from pdserve.bench.serve.compare import SystemRun, ratio_table

    slo = Slo(ttft_ms=1000)
    base = summarize([_record(0, ttft_s=0.1, e2e_s=1.0, output_tokens=10)], 1.0, slo)  # TPOT 100 ms, 10 tok/s
    faster = summarize([_record(0, ttft_s=0.05, e2e_s=0.5, output_tokens=10)], 0.5, slo)  # TPOT 50 ms, 20 tok/s
    headers, rows = ratio_table([SystemRun("colocated-chunked", "2", base), SystemRun("pd", "1 x (1 + 1)", faster)])
    assert dict(zip(headers, rows[0], strict=True))["throughput ratio"] == "1.00x"
    row = dict(zip(headers, rows[1], strict=True))
    assert (row["throughput ratio"], row["TTFT P99 ratio"], row["TPOT P99 ratio"], row["goodput ratio"]) == (
        "2.00x", "0.50x", "0.50x", "2.00x")
