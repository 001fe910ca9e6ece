"""The PD path's costs (issue 29, item 3): the profile's fields (and its older versions'), the simulator
charging them, and calibrate's served PD run recovering them (against the simulator itself: no
cluster)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from pdserve.cli import main
from pdserve.model.facts import load_model_facts
from pdserve.sizing.profile import PROFILE_VERSION, PDPathCosts, Profile, StepModel, TransferModel, load_profile
from pdserve.sizing.served_pd import (
    PROBE_OUTPUT_LEN,
    PROBE_PROMPT_LEN,
    Load,
    ServedPlan,
    ServedRun,
    Step,
    _load_cost,
    _simulated,
    _solve,
    _token_s,
    fit_served,
    load_prompt_len,
    path_costs,
)
from pdserve.sizing.sim.cluster import Arrival, Topology
from pdserve.sizing.sim.run import ClusterOptions, cluster_spec, simulate

STEP = StepModel(0.005, 1e-5, 0.0, 3e-4, 1e-7)
PD = Topology(num_prefill=1, num_decode=1)


def _profile(**changes: object) -> Profile:
    profile = Profile("tiny", "test", load_model_facts("qwen3-0.6b"), STEP, 1000, 16, 4096, 16, 512,
                      {"tcp": TransferModel(0.001, 2e9)})
    return dataclasses.replace(profile, **changes)


def _alone(profile: Profile, **kwargs: object) -> tuple[float, float]:
    """One isolated PD request of 64 tokens, 8 out: (its first token's time, its second's)."""
    options = ClusterOptions(**kwargs)  # type: ignore[arg-type]
    run = simulate(cluster_spec(profile, PD, "tcp", options), [Arrival(64, 8, 0.0)], 1)
    record = run.result.records[0]
    return record.chunk_times_s[0], record.chunk_times_s[1]


def test_version_1_profiles_load_without_pd_path_costs(tmp_path: Path) -> None:
    """A profile written before version 2 (no "version", no "pd_path", no "prefill_step") loads, and
    says it is version 1 and has no PD path costs; a newer version than this pdserve's is refused."""
    raw = _profile().to_dict()
    for key in ("version", "pd_path", "prefill_step"):
        raw.pop(key)
    old = tmp_path / "v1.json"
    old.write_text(json.dumps(raw))
    profile = load_profile(old)
    assert profile.version == 1 and profile.pd_path is None and profile.prefill_step is None
    assert profile.step == STEP
    raw["version"] = PROFILE_VERSION + 1
    old.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="newer"):
        load_profile(old)


def test_version_4_fields_round_trip(tmp_path: Path) -> None:
    costs = PDPathCosts(0.012, 0.004, 0.0035, 0.0025, "tcp", 12)
    profile = _profile(pd_path=costs, prefill_step=dataclasses.replace(STEP, base_s=0.009))
    path = tmp_path / "v4.json"
    profile.save(path)
    assert json.loads(path.read_text())["version"] == PROFILE_VERSION == 4
    assert load_profile(path) == profile
    assert costs.relay_delay(2) == pytest.approx(2 * 0.0035)
    assert costs.handoff(4) == pytest.approx(0.004 + 4 * 0.0025)


@pytest.mark.parametrize("version", [2, 3])
def test_an_older_profile_loads_without_its_load_dependent_costs(tmp_path: Path, version: int) -> None:
    """Versions 2 and 3 counted the load other ways (2: the first token per request waiting for its
    own, the hand-off per stream decoding; 3: the first token per request in flight): such a
    profile loads with its fixed costs only, and notes that say so."""
    raw = _profile(pd_path=PDPathCosts(0.012, 0.004, 0.0, 0.0, "tcp", 12)).to_dict()
    raw["version"] = version
    for key in ("first_token_per_streaming_s", "handoff_per_waiting_s"):
        raw["pd_path"].pop(key)
    raw["pd_path"].update({"first_token_per_waiting_s": 0.010, "handoff_per_stream_s": 0.040} if version == 2 else
                          {"first_token_per_in_flight_s": 0.005, "handoff_per_waiting_s": 0.012})
    old = tmp_path / f"v{version}.json"
    old.write_text(json.dumps(raw))
    profile = load_profile(old)
    assert profile.version == version and profile.pd_path == PDPathCosts(0.012, 0.004, 0.0, 0.0, "tcp", 12)
    assert "load-dependent PD path costs are not used" in profile.notes


def test_a_steady_load_pays_the_first_tokens_load_cost_per_request_streaming() -> None:
    """Arrivals spread out (one every 60 ms, 8 in flight): few requests wait for their first token
    at once, but each shares the loops with the 7 others in flight, whose tokens stream through
    them, as served runs show (a steady load's real TTFT is about a burst's). A cost per request
    waiting for its first token alone, version 2's, charged the spread-out load almost nothing."""
    arrivals = [Arrival(64, 40, 0.060 * i) for i in range(40)]

    def ttft(costs: PDPathCosts) -> float:
        return simulate(cluster_spec(_profile(pd_path=costs), PD, "tcp"), arrivals, 8).summary.latency["ttft"].median_ms

    assert ttft(PDPathCosts(first_token_per_streaming_s=0.010)) > ttft(PDPathCosts()) + 40


def test_a_waves_first_tokens_do_not_pay_for_the_others_of_their_step() -> None:
    """8 requests at once, prefilled in one step: the 8 first tokens leave together and none of
    them counts the others of its step as streaming (a per-streaming cost charged in order would
    make the last of them pay for 7); a ninth, prefilled after them, pays for the 8 streams."""
    options = ClusterOptions(dispatch_s=0.0)  # NOTE: all 8 at prefill before it steps

    def firsts(costs: PDPathCosts, arrivals: list[Arrival]) -> list[float]:
        records = simulate(cluster_spec(_profile(pd_path=costs), PD, "tcp", options), arrivals, 9).result.records
        return [r.chunk_times_s[0] for r in records]

    wave, charged = [Arrival(64, 8, 0.0)] * 8, PDPathCosts(first_token_per_streaming_s=0.004)
    bare = firsts(PDPathCosts(), wave)
    assert bare == pytest.approx([bare[0]] * 8)  # one prefill step
    assert firsts(charged, wave) == pytest.approx(bare)
    late = [*wave, Arrival(64, 8, 0.001)]
    assert firsts(charged, late)[8] == pytest.approx(firsts(PDPathCosts(), late)[8] + 8 * 0.004)


@pytest.mark.parametrize("costs", [PDPathCosts(first_token_per_streaming_s=0.010),
                                   PDPathCosts(handoff_per_waiting_s=0.010)])
def test_the_load_dependent_costs_grow_with_the_load(costs: PDPathCosts) -> None:
    """Under load the first token's way shares the loops with the other requests in flight, and the
    hand-off waits behind the others' hand-offs: a request alone pays neither, a burst of 8 pays them."""
    arrivals = [Arrival(64, 40, 0.0)] * 16

    def medians(profile: Profile, num: int) -> tuple[float, float]:
        lat = simulate(cluster_spec(profile, PD, "tcp"), arrivals[:num], 8).summary.latency
        return lat["ttft"].median_ms, lat["e2el"].median_ms

    assert medians(_profile(pd_path=costs), 1) == pytest.approx(medians(_profile(), 1))
    (ttft, e2el), (bare_ttft, bare_e2el) = medians(_profile(pd_path=costs), 16), medians(_profile(), 16)
    if costs.first_token_per_streaming_s:
        assert ttft > bare_ttft + 10
    else:
        assert e2el > bare_e2el + 10


def test_a_waves_hand_offs_wait_behind_the_rest_of_it() -> None:
    """8 requests at once (one wave, nothing decoding yet): with a per-waiting hand-off cost each
    hand-off pays for the 7 others not yet at decode, in the first wave too (a per-stream-decoding
    cost, version 2's, was 0 there: nothing decoded yet)."""
    arrivals = [Arrival(64, 8, 0.0)] * 8

    def gaps(profile: Profile) -> list[float]:
        records = simulate(cluster_spec(profile, PD, "tcp"), arrivals, 8).result.records
        return [r.chunk_times_s[1] - r.chunk_times_s[0] for r in records]

    bare, charged = gaps(_profile()), gaps(_profile(pd_path=PDPathCosts(handoff_per_waiting_s=0.010)))
    assert min(charged) > min(bare) and max(charged) - max(bare) > 0.030


def test_the_served_loads_alternate_two_prompt_lengths() -> None:
    plan = ServedPlan(input_len=96)
    assert [load_prompt_len(plan, n) for n in range(4)] == [48, 144, 48, 144]
    assert load_prompt_len(ServedPlan(input_len=1), 0) == 1


def test_the_prefill_workers_step_with_their_served_model() -> None:
    slow = dataclasses.replace(STEP, base_s=0.050)
    bare_first, _ = _alone(_profile())
    first, _ = _alone(_profile(prefill_step=slow))
    assert first == pytest.approx(bare_first + 0.045)


@pytest.mark.parametrize("early_first_token", [True, False])
def test_the_first_tokens_load_delay_is_the_relays_every_later_token_and_the_end_take_it_too(
        early_first_token: bool) -> None:
    """The first token's load cost delays the router's relay, not just the first token: in a burst
    of 8 requests, each gets every token and its end that much later, so the gaps between tokens (TPOT) are
    the decode worker's, not shortened by a late first token (nor, when the first token comes from
    decode, lengthened by late later ones)."""
    from pdserve.bench.serve.workloads import random_lengths

    def records(costs: PDPathCosts) -> tuple:
        profile = _profile(pd_path=costs)
        spec = cluster_spec(profile, PD, "tcp", ClusterOptions(early_first_token=early_first_token))
        return simulate(spec, [Arrival(r.prompt_len, r.max_tokens, 0.0) for r in burst.requests], 8).result.records

    burst = random_lengths(8, 64, 16, seed=2)
    delays = set()
    for b, r in zip(records(PDPathCosts()), records(PDPathCosts(first_token_per_streaming_s=0.005)), strict=True):
        shift = [x - y for x, y in zip(r.chunk_times_s, b.chunk_times_s, strict=True)]
        assert shift == pytest.approx([shift[0]] * len(shift))  # every token as late as the first
        assert r.e2e_s - b.e2e_s == pytest.approx(shift[0])
        delays.add(round(shift[0], 6))
    # NOTE: the delay is 5 ms per stream relaying when the request's prefill step ended: none for the
    # first step's, more for each later one's
    assert min(delays) == 0 and max(delays) >= 0.005 * 5
    assert all(d / 0.005 == pytest.approx(round(d / 0.005)) for d in delays)


def test_fit_served_recovers_scale_and_shift() -> None:
    steps = [Step(t, 1.5 * t + 0.002) for t in (0.004, 0.006, 0.010, 0.020, 0.035)]
    model, a, b = fit_served(STEP, steps)
    assert (a, b) == pytest.approx((1.5, 0.002))
    assert model.base_s == pytest.approx(1.5 * STEP.base_s + 0.002)
    assert model.decode_seq_s == pytest.approx(1.5 * STEP.decode_seq_s)
    # a negative shift is not a cost: b = 0, a the ratio of the sums
    _, a, b = fit_served(STEP, [Step(0.01, 0.011), Step(0.02, 0.030)])
    assert b == 0 and a == pytest.approx(0.041 / 0.03)


def test_fit_served_weighs_each_step_as_its_sequences() -> None:
    """A decode step of 8 sequences counts as 8 steps (TPOT follows the tokens, not the steps)."""
    steps = [Step(0.010, 0.0105, 8), Step(0.012, 0.0127, 8), Step(0.004, 0.0055, 1), Step(0.006, 0.0070, 2)]
    repeated = [Step(s.predicted_s, s.seconds) for s in steps for _ in range(int(s.weight))]
    assert fit_served(STEP, steps)[1:] == pytest.approx(fit_served(STEP, repeated)[1:])
    # a single-sequence step slower than a full batch (the line falls): b = 0, a the weighted ratio
    slow_single = [Step(0.004, 0.012, 1), Step(0.010, 0.0105, 8)]
    _, a, b = fit_served(STEP, slow_single)
    assert b == 0 and a == pytest.approx((0.012 + 8 * 0.0105) / (0.004 + 8 * 0.010))
    _, a_unweighted, _ = fit_served(STEP, [dataclasses.replace(s, weight=1.0) for s in slow_single])
    assert a < 1.15 < 1.6 < a_unweighted


def test_solve_takes_the_side_of_a_jump_nearer_zero() -> None:
    """A load's median moves in steps: where it jumps over the target, the fit takes the side of the
    jump nearer it (the bisection's midpoint can land on the far side)."""
    assert _solve(lambda x: x - 0.3, 1.0) == pytest.approx(0.3)
    assert _solve(lambda x: -0.1 if x < 0.5 else 2.0, 1.0) == pytest.approx(0.5, abs=1e-6)
    assert _solve(lambda x: -0.1 if x < 0.5 else 2.0, 1.0) < 0.5
    assert _solve(lambda x: -2.0 if x < 0.5 else 0.1, 1.0) >= 0.5
    assert _solve(lambda x: x + 1.0, 1.0) == 0.0  # above the target with no cost: none


def test_path_costs_recovers_what_the_served_run_saw() -> None:
    """The served run's records made by the simulator with known costs: calibrate's fit recovers
    the fixed parts exactly, and load-dependent parts that give the load's medians."""
    from pdserve.bench.serve.workloads import random_lengths

    truth = PDPathCosts(0.008, 0.006, 0.002, 0.003)
    probe = random_lengths(6, PROBE_PROMPT_LEN, PROBE_OUTPUT_LEN, seed=1)
    load = random_lengths(24, 64, 16, range_ratio=0.75, seed=2)
    profile = _profile()
    run = ServedRun(_simulated(profile, truth, "tcp", probe, 1), probe,
                    (Load(_simulated(profile, truth, "tcp", load, 8), load, 8),), {}, "tcp")
    got = path_costs(profile, run)
    assert got.first_token_s == pytest.approx(truth.first_token_s, abs=1e-9)
    assert got.handoff_s == pytest.approx(truth.handoff_s, abs=1e-9)
    # NOTE: the load-dependent parts need not be unique (medians of a few requests, and a later first
    # token holds the second back too): they are charged, and they give the load's medians
    assert got.first_token_per_streaming_s + got.handoff_per_waiting_s > 0
    real, sim = run.loads[0].records, _simulated(profile, got, "tcp", load, 8)
    for index in (0, 1):
        assert _token_s(sim, index) == pytest.approx(_token_s(real, index), abs=1e-3)
    assert got.transport == "tcp" and got.num_requests == 6


def test_path_costs_take_the_median_of_the_loads_fits() -> None:
    """Three loads, one of them seen with a 5x larger first-token cost (a noisy spell): the profile
    keeps the median of the three fits, near the two that agree, not their mean."""
    from pdserve.bench.serve.workloads import random_lengths

    probe = random_lengths(6, PROBE_PROMPT_LEN, PROBE_OUTPUT_LEN, seed=1)
    profile = _profile()
    truths = (PDPathCosts(0.008, 0.006, 0.002, 0.003), PDPathCosts(0.008, 0.006, 0.010, 0.003),
              PDPathCosts(0.008, 0.006, 0.002, 0.003))
    loads = []
    for seed, truth in enumerate(truths, start=2):
        workload = random_lengths(24, 64, 16, seed=seed)
        loads.append(Load(_simulated(profile, truth, "tcp", workload, 8), workload, 8))
    run = ServedRun(_simulated(profile, truths[0], "tcp", probe, 1), probe, tuple(loads), {}, "tcp")
    fits = [path_costs(profile, dataclasses.replace(run, loads=(load,))) for load in loads]
    got = path_costs(profile, run)
    per_streaming = sorted(f.first_token_per_streaming_s for f in fits)
    assert got.first_token_per_streaming_s == pytest.approx(per_streaming[1])
    assert got.first_token_per_streaming_s < fits[1].first_token_per_streaming_s  # the outlier is not kept
    assert got.handoff_per_waiting_s == pytest.approx(sorted(f.handoff_per_waiting_s for f in fits)[1])


def test_path_costs_fit_the_first_token_on_long_loads_and_the_hand_off_on_short_ones() -> None:
    """A long load (seen with a larger first-token cost) and a short one: the first token's cost is
    the long load's solution with the hand-off's held, the hand-off's the short load's with the
    first token's held."""
    from pdserve.bench.serve.workloads import random_lengths

    probe = random_lengths(6, PROBE_PROMPT_LEN, PROBE_OUTPUT_LEN, seed=1)
    profile = _profile()
    short_truth, long_truth = PDPathCosts(0.008, 0.006, 0.002, 0.004), PDPathCosts(0.008, 0.006, 0.003, 0.004)
    short_w, long_w = (random_lengths(24, 64, 16, range_ratio=0.75, seed=2),
                       random_lengths(24, 64, 16, range_ratio=0.75, seed=3))
    short = Load(_simulated(profile, short_truth, "tcp", short_w, 8), short_w, 8)
    long_ = Load(_simulated(profile, long_truth, "tcp", long_w, 8), long_w, 8, long=True)
    run = ServedRun(_simulated(profile, short_truth, "tcp", probe, 1), probe, (short, long_), {}, "tcp")
    got = path_costs(profile, run)
    only_long = path_costs(profile, dataclasses.replace(run, loads=(long_,)))
    only_short = path_costs(profile, dataclasses.replace(run, loads=(short,)))
    assert got.num_loads == 2
    assert got.first_token_per_streaming_s > only_short.first_token_per_streaming_s + 0.0005
    assert got.handoff_per_waiting_s != pytest.approx(only_long.handoff_per_waiting_s, rel=0.05)
    # each is its load's solution with the other held (the last round's order: first token, then hand-off)
    assert got.handoff_per_waiting_s == pytest.approx(_load_cost(profile, got, "tcp", short, 1))
    assert got.first_token_per_streaming_s == pytest.approx(_load_cost(profile, got, "tcp", long_, 0), rel=0.05)


def test_simulate_says_when_a_profile_has_no_pd_path_costs(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "p.json"
    _profile().save(path)
    args = ["simulate", "--profile", str(path), "--prefill", "1", "--decode", "1", "--num-prompts", "4",
            "--workload", "random", "--input-len", "16", "--output-len", "4"]
    assert main(args) == 0
    assert "has no PD path costs" in capsys.readouterr().out
    _profile(pd_path=PDPathCosts(0.01, 0.01)).save(path)
    assert main(args) == 0
    assert "has no PD path costs" not in capsys.readouterr().out
