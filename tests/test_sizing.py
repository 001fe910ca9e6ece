"""pdserve plan's arithmetic and pdserve simulate's model: the seed's worked example, refusals,
conservation (every request finished or refused, KV never over capacity, nothing leaked) and
agreement with closed-form cases."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from pdserve.bench.serve import workloads
from pdserve.cli import main
from pdserve.model.facts import load_model_facts
from pdserve.sizing.plan import GIB, PlanInputs, make_plan
from pdserve.sizing.profile import StepModel, TransferModel
from pdserve.sizing.sim.cluster import Arrival, ClusterSpec, Topology
from pdserve.sizing.sim.run import seed_mix_lengths, simulate
from pdserve.sizing.sim.worker import WorkerLimits

STEP = StepModel(base_s=0.010, prefill_token_s=1e-4, prefill_pair_s=1e-8, decode_seq_s=2e-3, decode_context_s=1e-6)


def test_plan_reproduces_the_seeds_worked_example(capsys: pytest.CaptureFixture[str]) -> None:
    # DIGEST 13: 40 GB card, 15 GB weights + overhead -> 25 GB of KV; 1.5 GB a request -> 16 -> set 12-13
    assert main(["plan", "--device-memory-gib", "40", "--reserved-gib", "15", "--kv-per-request-gib", "1.5",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kv_budget_bytes"] == 25 * GIB
    assert out["requests_fit"] == 16
    assert out["max_num_seqs"] == 12 and out["max_num_seqs_range"] == [12, 13]
    assert main(["plan", "--device-memory-gib", "40", "--reserved-gib", "15", "--kv-per-request-gib", "1.5"]) == 0
    assert "12 (set 12-13)" in capsys.readouterr().out


def test_plan_derives_kv_sizes_from_the_model() -> None:
    tiny = load_model_facts("tiny")  # 2 layers, 2 KV heads, head_dim 32
    plan = make_plan(PlanInputs(1 * GIB, 1.0, tiny, kv_dtype_bytes=2, block_size=16, overhead_bytes=0.25 * GIB,
                                mean_input_len=100, max_input_len=100, output_len=28))
    assert plan.kv_bytes_per_token == 2 * 2 * 2 * 32 * 2
    assert plan.kv_bytes_per_block == 16 * plan.kv_bytes_per_token
    assert plan.weights_bytes == tiny.num_params * 2
    budget = GIB - tiny.num_params * 2 - 0.25 * GIB
    assert plan.num_kv_blocks == int(budget // plan.kv_bytes_per_block)
    assert plan.kv_per_request_bytes == 8 * plan.kv_bytes_per_block  # 128 tokens = 8 blocks
    assert plan.requests_fit == int(budget // plan.kv_per_request_bytes)
    assert plan.max_num_seqs == math.floor(plan.requests_fit * 0.8)
    # TP 2 halves the weights and the KV heads of a rank
    half = make_plan(PlanInputs(1 * GIB, 1.0, tiny, tp=2, overhead_bytes=0.25 * GIB, mean_input_len=100,
                             output_len=28))
    assert half.kv_bytes_per_token == plan.kv_bytes_per_token // 2 and half.weights_bytes == plan.weights_bytes / 2


def test_plan_refuses_what_cannot_fit(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "qwen3-32b", "--device", "A10"]) == 2
    assert "do not fit" in capsys.readouterr().err
    with pytest.raises(ValueError, match="only"):
        make_plan(PlanInputs(40 * GIB, 1.0, None, reserved_bytes=39.5 * GIB, kv_per_request_bytes=1 * GIB))
    assert main(["plan", "--device", "H20", "--device-memory-gib", "40", "--reserved-gib", "1"]) == 2


def test_plan_refuses_a_config_that_is_no_qwen3_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A config.json without a field sizing needs, or of another model type: exit 2, the reason said."""
    config = tmp_path / "config.json"
    for raw, words in (({"hidden_size": 64, "num_attention_heads": 4}, "lacks vocab_size, intermediate_size"),
                       ({"model_type": "llama", "vocab_size": 8, "hidden_size": 64, "intermediate_size": 128,
                         "num_hidden_layers": 2, "num_attention_heads": 4}, "unsupported model_type 'llama'")):
        config.write_text(json.dumps(raw))
        assert main(["plan", "--model", str(config), "--device", "H20"]) == 2
        assert words in capsys.readouterr().err


def _spec(topology: Topology, limits: WorkerLimits, decode: WorkerLimits | None = None,
          transfer: TransferModel | None = None, max_queued: int = 512) -> ClusterSpec:
    return ClusterSpec(topology, STEP, limits, decode or limits, transfer, kv_bytes_per_token=1000, num_layers=4,
                       layerwise=True, max_queued_requests=max_queued)


def test_one_request_alone_ttft_is_prefill_plus_transfer() -> None:
    limits = WorkerLimits(num_kv_blocks=1000, block_size=16, max_num_seqs=8, max_num_batched_tokens=4096)
    transfer = TransferModel(latency_s=0.003, bytes_per_s=1e8)
    prefill_s = STEP.step_s(1000, 1000 * 500, 0, 0)
    colocated = simulate(_spec(Topology(num_colocated=1), limits), [Arrival(1000, 5, 0.0)], None)
    assert colocated.summary.latency["ttft"].median_ms == pytest.approx(prefill_s * 1e3)
    # NOTE: first without the router's early first token (on by default): decode's first token
    pd_spec = dataclasses.replace(_spec(Topology(num_prefill=1, num_decode=1), limits, transfer=transfer),
                                  early_first_token=False)
    pd = simulate(pd_spec, [Arrival(1000, 5, 0.0)], None)
    expected = prefill_s + transfer.exposed_s(1000 * 1000, prefill_s, 4)
    assert pd.summary.latency["ttft"].median_ms == pytest.approx(expected * 1e3)
    # decode alone: each later token is one step of one sequence over its growing context
    steps = [STEP.step_s(0, 0, 1, 1000 + k) for k in range(1, 5)]
    assert pd.summary.latency["tpot"].median_ms == pytest.approx(sum(steps) / 4 * 1e3)
    # the router's early first token: the client has it when prefill sampled it; the transfer
    # moves to the gap before the second token
    early = simulate(dataclasses.replace(pd_spec, early_first_token=True), [Arrival(1000, 5, 0.0)], None)
    assert early.summary.latency["ttft"].median_ms == pytest.approx(prefill_s * 1e3)
    assert early.summary.latency["e2el"].median_ms == pytest.approx(pd.summary.latency["e2el"].median_ms)


def test_saturated_decode_throughput_is_batch_over_step_time() -> None:
    step = StepModel(0.010, 1e-4, 0.0, 2e-3, 0.0)  # decode step time independent of context
    batch, out_len = 8, 50
    limits = WorkerLimits(1000, 16, max_num_seqs=batch, max_num_batched_tokens=4096)
    spec = ClusterSpec(Topology(num_colocated=1), step, limits, limits)
    run = simulate(spec, [Arrival(4, out_len, 0.0)] * (2 * batch), batch)
    decode_step = step.step_s(0, 0, batch, 0)
    assert run.summary.max_concurrent_requests == batch  # a finished request's slot is free for the next one
    assert run.summary.latency["tpot"].median_ms == pytest.approx(decode_step * 1e3)
    decode_tokens_s = (out_len - 1) * 2 * batch / (run.summary.duration_s - 2 * step.step_s(4 * batch, 8 * batch, 0, 0))
    assert decode_tokens_s == pytest.approx(batch / decode_step, rel=1e-6)


@pytest.mark.parametrize("topology", [Topology(num_colocated=2), Topology(num_prefill=1, num_decode=2)])
def test_conservation_under_kv_pressure_and_admission_limits(topology: Topology) -> None:
    lengths = [(p, o) for p, o in seed_mix_lengths(300, 0.05, 40, seed=3)]
    arrivals_ = [Arrival(p, o, 0.001 * i) for i, (p, o) in enumerate(lengths)] + [Arrival(5000, 10, 0.0)]
    limits = WorkerLimits(num_kv_blocks=40, block_size=16, max_num_seqs=32, max_num_batched_tokens=256)
    run = simulate(_spec(topology, limits, transfer=TransferModel(0.001, 1e9), max_queued=100), arrivals_, 200)
    s = run.summary
    # every request ended exactly once: finished, or refused (429 at the router, too long for any pool)
    assert s.completed + s.failed == len(arrivals_)
    assert s.failures.get("too_long") == 1 and s.failures.get("http_429", 0) > 0
    assert s.total_output_tokens == sum(o for (p, o), r in zip(lengths, run.result.records, strict=False) if r.ok)
    assert all(0 < w.peak_blocks_used <= w.limits.num_kv_blocks for w in run.cluster.workers)
    assert run.num_preemptions > 0  # the pool was small enough to preempt, and nothing was lost for it
    assert all(r.output_tokens == arrivals_[r.index].output_len for r in run.result.records if r.ok)
    assert s.max_concurrent_requests <= 200  # the client's cap


def test_prompts_over_the_budget_are_refused_without_chunked_prefill() -> None:
    limits = WorkerLimits(1000, 16, max_num_seqs=8, max_num_batched_tokens=512, enable_chunked_prefill=False)
    run = simulate(_spec(Topology(num_colocated=1), limits), [Arrival(600, 4, 0.0), Arrival(500, 4, 0.0)], None)
    assert run.summary.failures == {"too_long": 1} and run.summary.completed == 1


def test_seed_mix_lengths_match_bench_workload() -> None:
    bench = workloads.seed_mix(60, scale=0.1, seed=5, kind=workloads.PromptKind(vocab_size=1000))
    assert seed_mix_lengths(60, 0.1, None, 5) == [(r.prompt_len, r.max_tokens) for r in bench.requests]


def test_simulate_command_saves_bench_keys(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    out = tmp_path / "sim.json"
    assert main(["simulate", "--roofline", "H800:qwen3-8b", "--prefill", "1", "--decode", "2", "--num-prompts",
                 "40", "--max-concurrency", "8", "--transport", "erdma", "--save", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["completed"] == 40 and doc["median_ttft_ms"] > 0 and doc["p99_tpot_ms"] > 0
    assert len(doc["ttfts"]) == 40 and doc["max_concurrency"] == 8
    assert "Simulated: PD 1:2" in capsys.readouterr().out
    assert main(["simulate", "--roofline", "H800:qwen3-8b", "--colocated", "1", "--prefill", "1"]) == 2


def test_validate_sim_replays_a_saved_run(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    from pdserve.sizing import validate_sim

    # a "real" run that is itself simulated: replaying it must give the same numbers (0 % error)
    real = tmp_path / "real.json"
    assert main(["simulate", "--roofline", "H20:qwen3-8b", "--colocated", "2", "--num-prompts", "30",
                 "--max-concurrency", "6", "--request-rate", "3", "--seed", "4", "--save", str(real)]) == 0
    table = tmp_path / "table.json"
    assert validate_sim.main(["--roofline", "H20:qwen3-8b", "--run", f"colocated:2={real}", "--save", str(table)]) == 0
    rows = json.loads(table.read_text())
    assert {r["metric"] for r in rows} == {m for m, _ in validate_sim.METRICS}
    assert all(r["ok"] and abs(r["error"]) < 1e-9 for r in rows)
    # replayed on another topology it differs, and says so
    assert validate_sim.main(["--roofline", "H20:qwen3-8b", "--run", f"pd:1:1={real}", "--save", str(table)]) == 0
    assert any(abs(r["error"]) > 0.01 for r in json.loads(table.read_text()))
    with pytest.raises(SystemExit):
        validate_sim.main(["--roofline", "H20:qwen3-8b", "--run", "mixed:1=x.json"])


def test_prefill_workers_take_jobs_while_they_fit_their_token_budget() -> None:
    # the router's FIFO (disagg/router/memory_queue.py): three 300-token jobs fit a 1000-token budget
    # together; the fourth waits until a hand-off ends, i.e. for a whole (slow) transfer
    limits = WorkerLimits(num_kv_blocks=1000, block_size=16, max_num_seqs=8, max_num_batched_tokens=1000)
    transfer = TransferModel(latency_s=1.0, bytes_per_s=1e12)
    spec = _spec(Topology(num_prefill=1, num_decode=1), limits, transfer=transfer)
    run = simulate(spec, [Arrival(300, 2, 0.0)] * 4, None)
    ttfts = [r.ttft_s for r in run.result.records]
    assert ttfts[0] == ttfts[1] == ttfts[2]
    assert ttfts[3] is not None and ttfts[0] is not None and ttfts[3] - ttfts[0] >= transfer.latency_s


def test_a_request_on_its_way_does_not_join_the_step_that_starts_before_it_arrives() -> None:
    """`dispatch_s`: requests of a burst reach the worker one after another, and the worker starts
    a step as soon as it has work: the second request of a burst waits for the step after the
    first's (as a real engine does); with 0 both are batched into one step."""
    limits = WorkerLimits(num_kv_blocks=1000, block_size=16, max_num_seqs=8, max_num_batched_tokens=4096)
    burst = [Arrival(100, 2, 0.0), Arrival(100, 2, 0.0)]
    batched = simulate(_spec(Topology(num_colocated=1), limits), burst, None)
    together = STEP.step_s(200, 2 * 100 * 50, 0, 0)
    assert [r.ttft_s for r in batched.result.records] == pytest.approx([together, together])
    spec = dataclasses.replace(_spec(Topology(num_colocated=1), limits), dispatch_s=0.001)
    staggered = simulate(spec, burst, None)
    first = STEP.step_s(100, 100 * 50, 0, 0)
    second = STEP.step_s(100, 100 * 50, 1, 101)  # its prefill beside the first's decode
    ttfts = [r.ttft_s for r in staggered.result.records]
    # both due at 0: the first sent at 0 reaches the worker at 0.001; the second, sent at 0.001,
    # reaches it at 0.002, while the first's prefill step runs
    assert ttfts[0] == pytest.approx(0.001 + first)
    assert ttfts[1] == pytest.approx(0.001 + first + second)
