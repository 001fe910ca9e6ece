"""calibrate -> simulate on the tiny model: the profile is measured with the real engine, fits its
samples, and drives the simulator."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest

from pdserve.cli import main
from pdserve.config import EngineArgs
from pdserve.sizing.calibrate import Grid, calibrate, fit, fit_error
from pdserve.sizing.profile import load_profile


def test_fit_recovers_a_known_step_model() -> None:
    from pdserve.sizing.calibrate import Sample
    from pdserve.sizing.profile import StepModel

    truth = StepModel(0.004, 2e-5, 1e-8, 1e-3, 2e-7)
    counts = [(t, t * (c + t / 2), 0, 0) for t in (32, 128, 512) for c in (0, 128)] + \
             [(0, 0.0, b, b * c) for b in (1, 4, 16) for c in (16, 256)]
    samples = [Sample(*x, truth.step_s(*x)) for x in counts]
    got = fit(samples)
    for name in StepModel.__slots__:
        assert getattr(got, name) == pytest.approx(getattr(truth, name), rel=1e-6, abs=1e-12)
    assert fit_error(got, samples) < 1e-9


@pytest.mark.slow
def test_calibrate_then_simulate(tmp_path: Path) -> None:
    args = EngineArgs(model=None, dtype="float32", num_threads=1, num_kv_blocks=256)  # the demo tiny model
    grid = Grid((16, 64), (0, 4), (1, 4), (16, 64))
    profile, samples = calibrate(args, [], "test", grid)
    assert len(samples) == 8 and all(s.seconds > 0 for s in samples)
    assert profile.num_kv_blocks == 256 and profile.model.num_layers == 2
    assert profile.kv_bytes_per_token == 2 * 2 * 2 * 32 * 4  # K and V, 2 layers, 2 KV heads, head_dim 32, float32
    s = profile.step
    assert min(s.base_s, s.prefill_token_s, s.prefill_pair_s, s.decode_seq_s, s.decode_context_s) >= 0
    assert s.base_s > 0
    path = tmp_path / "tiny.json"
    profile.save(path)
    assert load_profile(path) == profile
    out = tmp_path / "sim.json"
    assert main(["simulate", "--profile", str(path), "--prefill", "1", "--decode", "1", "--transport", "tcp",
                 "--scale", "0.02", "--num-prompts", "20", "--max-concurrency", "4", "--save", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["completed"] == 20 and doc["median_ttft_ms"] > 0


def test_samples_against_a_devices_roofline(capsys: pytest.CaptureFixture[str]) -> None:
    """`calibrate --compare-device`: each measured step next to the roofline's prediction for it,
    with the profile's element size (bf16 here) for weights and KV."""
    from pdserve.model.facts import load_model_facts
    from pdserve.sizing.calibrate import Sample, print_against_roofline
    from pdserve.sizing.devices import device
    from pdserve.sizing.profile import Limits, Profile, StepModel, roofline

    model = load_model_facts("qwen3-8b")
    measured = Profile("m", "calibrated on test", model, StepModel(0.03, 0, 0, 0, 0), model.kv_bytes_per_token(2), 16,
                       1000, 256, 8192)
    samples = [Sample(2048, 2048 * 1024.0, 0, 0, 0.070), Sample(0, 0.0, 64, 64 * 258, 0.037)]
    print_against_roofline(measured, samples, device("H200"))
    expected = roofline(model, device("H200"), Limits(1000, max_num_seqs=256, max_num_batched_tokens=8192)).step
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 2
    for row, sample in zip(rows, samples, strict=True):
        cells = [c.strip() for c in row.strip("|").split("|")]
        predicted = expected.step_s(sample.prefill_tokens, sample.prefill_pairs, sample.decode_seqs,
                                    sample.decode_context)
        assert float(cells[5]) == pytest.approx(predicted * 1e3, abs=0.01)
        assert float(cells[6]) == pytest.approx(sample.seconds / predicted, abs=0.01)


def test_gpu_kv_budget_leaves_another_workers_memory_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two workers on one GPU at --gpu-memory-utilization 0.4 each: the second gets its 40 % (the
    first's memory is not subtracted again), and never more than is free."""
    import torch

    from pdserve.config import _cuda_kv_budget
    from pdserve.model.demo_checkpoint import PRESETS, ModelVariant

    total = 100 * 2**30
    model = PRESETS["tiny"].config(ModelVariant(dtype=torch.float32))
    args = EngineArgs(gpu_memory_utilization=0.4)
    for free, budget_before_weights in ((total - 41 * 2**30, 40 * 2**30), (10 * 2**30, 10 * 2**30)):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device, free=free: (free, total))
        with_model = _cuda_kv_budget(args, model, torch.float32, torch.device("cuda"), 256)
        assert 0 < budget_before_weights - with_model < 2**30  # weights and activations of a tiny model


def test_workload_flops_count_prefill_once_and_each_later_token() -> None:
    """bench/matmul_rate.py: one 4-token prompt and 2 output tokens = the prefill (4 rows through
    the layers, 4 x 2.5 attention pairs, one LM-head row) + one decode step over 5 tokens."""
    from pdserve.bench.matmul_rate import gemm_shapes, workload_flops
    from pdserve.model.facts import load_model_facts

    tiny = load_model_facts("tiny")
    layer = 2.0 * tiny.num_layers * tiny.layer_params
    head = 2.0 * tiny.vocab_size * tiny.hidden_size
    pair = tiny.attention_flops_per_pair()
    assert workload_flops(tiny, [4], [2]) == pytest.approx(layer * 4 + pair * 4 * 2.5 + head + layer + head + pair * 5)
    assert workload_flops(tiny, [4], [2], cached_lens=[2]) == pytest.approx(
        layer * 2 + pair * 2 * (2 + 1.5) + head + layer + head + pair * 5)
    shapes = gemm_shapes(tiny, batch=24, chunk=512)
    assert len(shapes) == 9 and (24, tiny.hidden_size, tiny.vocab_size) in shapes


def test_gemm_ceiling_is_the_work_at_each_shapes_own_rate() -> None:
    """With every shape at one rate the ceiling is the work over that rate; slowing the decode
    batch's shapes slows only the later tokens' share (and the LM head's)."""
    from pdserve.bench.matmul_rate import Rate, gemm_ceiling_s, gemm_shapes, workload_flops
    from pdserve.model.facts import load_model_facts

    tiny = load_model_facts("small")
    prompts, outputs = [300, 40, 1000], [5, 1, 17]
    uniform = [Rate("", 1e9, shape) for shape in gemm_shapes(tiny, 3, 512)]
    assert gemm_ceiling_s(tiny, uniform, prompts, outputs, 3, 512) == pytest.approx(
        workload_flops(tiny, prompts, outputs) / 1e9)
    slow_decode = [Rate("", 1e9 if m == 512 else 0.5e9, (m, k, n)) for m, k, n in gemm_shapes(tiny, 3, 512)]
    layer = 2.0 * tiny.layers_matmul_params
    head = 2.0 * tiny.vocab_size * tiny.hidden_size
    extra = (sum(outputs) - len(outputs)) * layer / 1e9 + sum(outputs) * head / 1e9
    assert gemm_ceiling_s(tiny, slow_decode, prompts, outputs, 3, 512) == pytest.approx(
        workload_flops(tiny, prompts, outputs) / 1e9 + extra)


def test_served_steps_are_logged_and_fitted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """PDSERVE_STEP_LOG: each step's work in the step model's columns (every prompt token counted
    once as prefill, every later token as one decode sequence), and `calibrate --from-step-log`
    fits a profile to those steps instead of timing its own."""
    from pdserve.engine.llm import LLM
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.engine.step_log import read_step_logs

    monkeypatch.setenv("PDSERVE_STEP_LOG", str(tmp_path / "steps"))
    llm = LLM(model=None, dtype="float32", num_threads=1, num_kv_blocks=64, max_num_batched_tokens=32)
    prompts = [{"prompt_token_ids": list(range(1000 * i + 100, 1000 * i + 100 + n))} for i, n in enumerate((5, 40, 70))]
    llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0))
    llm.engine.close()
    steps = read_step_logs([tmp_path / "steps"])
    assert sum(s.work.prefill_tokens for s in steps) == 5 + 40 + 70
    assert sum(s.work.decode_seqs for s in steps) == 3 * 5  # the first token comes with the prefill
    assert max(s.work.prefill_tokens + s.work.decode_seqs for s in steps) <= 32  # the step budget
    assert all(s.period_s > 0 and s.role is None for s in steps)  # not a worker: no role in the name
    # each period starts on the host's monotonic clock, after the previous one ended
    assert all(s.start_s is not None for s in steps)
    assert all(b.start_s >= a.start_s + a.period_s - 1e-5 for a, b in itertools.pairwise(steps))  # type: ignore[operator]
    first = next(s.work for s in steps if s.work.decode_seqs)  # a decode step reads the whole context
    assert first.decode_context >= 5 + 1
    raw = [json.loads(line) for f in (tmp_path / "steps").iterdir() for line in f.read_text().splitlines()]
    assert raw[0]["gap_s"] is None  # idle before the first step; busy between the others
    assert all(r["gap_s"] is not None and r["gap_s"] >= 0 for r in raw[1:])
    assert [s.period_s for s in steps] == pytest.approx([r["seconds"] + (r["gap_s"] or 0) for r in raw])
    out = tmp_path / "served.json"
    assert main(["calibrate", "--dtype", "float32", "--num-threads", "1", "--num-kv-blocks", "64",
                 "--transports", "", "--from-step-log", str(tmp_path / "steps"), "--out", str(out)]) == 0
    profile = load_profile(out)
    assert f"{len(steps)} step samples (logged while serving)" in profile.notes
    assert profile.step.base_s > 0
    assert f"over {len(steps)} samples" in capsys.readouterr().out


def test_a_bad_step_log_is_refused_with_its_line(tmp_path: Path) -> None:
    from pdserve.sizing.calibrate import logged_samples

    log = tmp_path / "steps-1.jsonl"
    log.write_text('{"seconds": 0.1, "prefill_tokens": 3, "prefill_pairs": 4.5, "decode_seqs": 0, '
                   '"decode_context": 0}\n{"seconds": 0.1}\n')
    with pytest.raises(ValueError, match="steps-1.jsonl:2: not a step log line"):
        logged_samples([log])
    with pytest.raises(ValueError, match="no such step log"):
        logged_samples([tmp_path / "missing"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no logged steps"):
        logged_samples([tmp_path / "empty"])


def test_decode_workers_steps_get_a_model_of_their_own(tmp_path: Path) -> None:
    """Logged decode workers' steps (file steps-decode-*.jsonl) are fitted apart from the other
    roles' (`Profile.decode_step`), and the simulator's decode workers step with that model."""
    from pdserve.sizing.calibrate import logged_samples
    from pdserve.sizing.profile import StepModel
    from pdserve.sizing.sim.cluster import Topology
    from pdserve.sizing.sim.run import cluster_spec

    others, decode = StepModel(0.01, 1e-4, 0.0, 2e-3, 0.0), StepModel(0.03, 1e-4, 0.0, 5e-3, 0.0)
    (tmp_path / "logs").mkdir()
    for name, model, rows in (("steps-prefill-7.jsonl", others, [(t, 0) for t in (16, 64, 128, 200)]),
                              ("steps-colocated-8.jsonl", others, [(32, 2), (0, 3), (0, 8)]),
                              ("steps-decode-9.jsonl", decode, [(0, b) for b in (1, 2, 4, 8, 16)])):
        lines = [json.dumps({"seconds": model.step_s(t, 0.0, b, 0), "gap_s": None, "prefill_tokens": t,
                             "prefill_pairs": 0.0, "decode_seqs": b, "decode_context": 0}) for t, b in rows]
        (tmp_path / "logs" / name).write_text("\n".join(lines) + "\n")
    logged = logged_samples([tmp_path / "logs"])
    assert (len(logged.steps), len(logged.decode)) == (7, 5)
    profile, samples = calibrate(EngineArgs(model=None, dtype="float32", num_kv_blocks=64), [], "test", logged=logged)
    assert samples == logged.steps
    assert profile.step.base_s == pytest.approx(others.base_s) and profile.step.decode_seq_s == pytest.approx(2e-3)
    assert profile.decode_step is not None
    assert profile.decode_step.base_s == pytest.approx(decode.base_s)
    assert profile.decode_step.decode_seq_s == pytest.approx(5e-3)
    profile.save(tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json") == profile
    spec = cluster_spec(profile, Topology(num_prefill=1, num_decode=1), "tcp")
    assert spec.decode_step == profile.decode_step and spec.step == profile.step


@pytest.mark.slow
def test_a_pd_clusters_workers_log_their_steps_under_their_role(model_dirs: dict[str, Path], tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import httpx
    from pd_fixtures import start_cluster, stop_cluster

    from pdserve.sizing.calibrate import logged_samples

    monkeypatch.setenv("PDSERVE_STEP_LOG", str(tmp_path / "steps"))
    cluster = start_cluster(model_dirs["tiny"], "tcp", 1, 1)
    try:
        with httpx.Client(base_url=cluster.router.url, timeout=30) as http:
            reply = http.post("/v1/completions", json={"prompt": [5, 6, 7, 8, 9], "max_tokens": 4, "ignore_eos": True})
        assert reply.status_code == 200, reply.text
    finally:
        stop_cluster(cluster)
    names = sorted(p.name.rsplit("-", 1)[0] for p in (tmp_path / "steps").iterdir())
    assert names == ["steps-decode", "steps-prefill"]
    logged = logged_samples([tmp_path / "steps"])
    assert sum(s.prefill_tokens for s in logged.steps) == 5 and not any(s.decode_seqs for s in logged.steps)
    assert sum(s.decode_seqs for s in logged.decode) == 3  # the first token came from prefill


def test_calibrate_times_the_engine_with_the_threads_up_gives_a_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 29: calibrate on every core and `up`'s workers on CPUs // workers each disagreed; the
    default is now up's share (`--workers`, default up's 1 prefill + 1 decode), `--num-threads` wins."""
    from pdserve.cli import build_parser
    from pdserve.ops import threads
    from pdserve.sizing.calibrate import engine_args

    monkeypatch.setattr(threads, "num_cpus", lambda: 8)
    parse = build_parser().parse_args
    assert engine_args(parse(["calibrate", "--out", "p.json"])).num_threads == 4
    assert engine_args(parse(["calibrate", "--out", "p.json", "--workers", "8"])).num_threads == 1
    assert engine_args(parse(["calibrate", "--out", "p.json", "--num-threads", "3"])).num_threads == 3
    with pytest.raises(ValueError, match="--workers 0"):
        engine_args(parse(["calibrate", "--out", "p.json", "--workers", "0"]))


def test_calibrate_ends_with_a_served_pd_run_whose_fits_reach_the_profile(tmp_path: Path) -> None:
    """`pdserve calibrate`'s whole path, kept small (a short grid, two short loads of 8 and a long
    one of 12): the served PD run starts a real 1 prefill + 1 decode cluster, reads its workers'
    step logs, and the profile gets both roles' served steps and the PD path's costs."""
    out = tmp_path / "p.json"
    assert main(["calibrate", "--dtype", "float32", "--num-threads", "1", "--num-kv-blocks", "256",
                 "--prefill-tokens", "16,48", "--decode-batches", "1,4", "--transports", "",
                 "--served-requests", "8", "--served-concurrency", "4", "--served-rounds", "2",
                 "--served-long-requests", "12", "--served-long-rounds", "1", "--out", str(out)]) == 0
    profile = load_profile(out)
    assert profile.prefill_step is not None and profile.decode_step is not None
    assert profile.pd_path is not None and profile.pd_path.num_loads == 3
    assert profile.pd_path.num_requests > 0 and profile.pd_path.transport in ("nixl", "tcp")
    assert re.search(r"served PD run over \w+: prefill [\d.]+ x timed .* decode [\d.]+ x timed", profile.notes)


def test_gpu_kv_budget_counts_prompt_logprob_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step of prompt logprobs holds float32 [rows, vocab] logits, a float copy and their
    log-softmax, for at most PROMPT_LOGITS_ROWS prompt rows at once (the runner computes more in
    chunks): up to that many batched tokens, each takes that much from the KV pool besides its
    activations; past it, only its activations (at 8,192 batched tokens and Qwen3's vocabulary:
    ~14 GiB of logits reserved before, ~0.9 GiB now)."""
    import torch

    from pdserve.config import PROMPT_LOGITS_ROWS, _cuda_kv_budget
    from pdserve.model.demo_checkpoint import PRESETS, ModelVariant

    model = PRESETS["tiny"].config(ModelVariant(dtype=torch.float32))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (80 * 2**30, 80 * 2**30))
    args = EngineArgs(gpu_memory_utilization=0.9)
    row = model.vocab_size * 4 * 3
    budget = {n: _cuda_kv_budget(args, model, torch.float32, torch.device("cuda"), n)
              for n in (256, PROMPT_LOGITS_ROWS, 8192)}
    assert budget[256] - budget[PROMPT_LOGITS_ROWS] >= (PROMPT_LOGITS_ROWS - 256) * row
    assert budget[PROMPT_LOGITS_ROWS] - budget[8192] < (8192 - PROMPT_LOGITS_ROWS) * row / 100


def test_gpu_kv_budget_counts_the_weights_the_model_has() -> None:
    """Qwen3-8B in bfloat16 on an 80 GiB device: the KV pool gets what is left after its 8.2 B weights
    (transformers' count, `num_params`) and a small step's activations, no less: attention's o
    projection counted as 4 h x h a layer took 3.6 GB more than the weights are."""
    import torch

    from pdserve.config import _cuda_kv_budget
    from pdserve.model.demo_checkpoint import QWEN3_SHAPES, ModelVariant

    model = QWEN3_SHAPES["qwen3-8b"].config(ModelVariant(dtype=torch.bfloat16))
    total = 80 * 2**30
    args = EngineArgs(gpu_memory_utilization=0.9, max_num_seqs=1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "mem_get_info", lambda device: (total, total))
        budget = _cuda_kv_budget(args, model, torch.bfloat16, torch.device("cuda"), 256)
    left = int(total * 0.9) - model.num_params * 2
    assert left - 2**29 <= budget <= left, (left - budget) / 2**30
