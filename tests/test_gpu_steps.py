"""The GPU check's step stages (pdserve/sizing/gpu_steps.py, run by scripts/device_check.sh) run
here at tiny shapes on CPU: the same runner, plans, eager buckets and profiler code as on a GPU
(no graph captured, CPU ops profiled), so they cannot rot before a GPU runs them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("triton")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # conftest.py: set when there is no GPU
on_cpu = pytest.mark.skipif(not INTERPRETED, reason="the paged step's kernels on CPU need Triton's interpreter")


def _run(stage: str, tmp_path: Path) -> list[dict]:
    from pdserve.sizing.gpu_steps import main

    assert main([stage, "--smoke", "--save", str(tmp_path / f"{stage}.json")]) == 0
    return json.loads((tmp_path / f"{stage}.json").read_text())["results"]


@pytest.mark.slow
@on_cpu
def test_capture_builds_both_presets_and_replays_as_eager(tmp_path: Path) -> None:
    results = _run("capture", tmp_path)
    assert [r["model"] for r in results] == ["tiny", "tiny-moe"]
    assert all(r["values"]["graphs"] == r["values"]["expected"] == 0 for r in results)  # CPU: none captured
    assert all(r["values"]["piecewise"] == r["values"]["piecewise_expected"] == 0 for r in results)
    assert all(r["values"]["replay_vs_eager"] == 0.0 for r in results)


@pytest.mark.slow
@on_cpu
def test_profile_counts_ops_per_step_against_the_floor(tmp_path: Path) -> None:
    results = _run("profile", tmp_path)
    assert [r["step"] for r in results] == ["decode 1 x 20", "decode 4 x 20"]
    for r in results:
        v = r["values"]
        assert v["kernels"] > 2 * 10  # two layers of several ops each
        assert v["per_layer"] == v["kernels"] / 2
        assert 0 < v["gemm_ms"] <= v["busy_ms"] and v["other_ms"] == pytest.approx(v["busy_ms"] - v["gemm_ms"])
        assert v["floor_ms"] > 0 and v["x_floor"] == pytest.approx(v["busy_ms"] / v["floor_ms"])
    assert results[1]["values"]["floor_ms"] > results[0]["values"]["floor_ms"]  # more KV read


@pytest.mark.slow
@on_cpu
def test_long_and_mixed_split_the_step(tmp_path: Path) -> None:
    (long,) = _run("long", tmp_path)
    v = long["values"]
    assert v["step_ms"] > 0 and v["replay_ms"] > 0 and v["host_ms"] == pytest.approx(v["step_ms"] - v["replay_ms"])
    mixed, piecewise = _run("mixed", tmp_path)
    assert mixed["step"] == "4 x 20 decodes + 8 prompt"
    m = mixed["values"]
    assert min(m["mixed_ms"], m["decode_ms"], m["prompt_ms"]) > 0
    assert m["mixed_minus_decode_ms"] == pytest.approx(m["mixed_ms"] - m["decode_ms"])
    assert piecewise["step"] == "3 x 20 decodes + 6 prompt, piecewise"
    p = piecewise["values"]
    assert min(p["piecewise_ms"], p["eager_ms"]) > 0
    assert p["x_eager"] == pytest.approx(p["piecewise_ms"] / p["eager_ms"])


def test_summary_tables_every_saved_stage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pdserve.sizing.gpu_steps import main

    saved = {"hardware": "x", "results": [{"stage": "long", "model": "m", "step": "decode 1 x 8",
                                           "values": {"step_ms": 2.5, "graphs": 7.0}}]}
    (tmp_path / "long.json").write_text(json.dumps(saved))
    assert main(["summary", str(tmp_path / "long.json"), str(tmp_path / "missing.json")]) == 0
    out = capsys.readouterr().out
    assert "| long  | m     | decode 1 x 8 | step_ms 2.5, graphs 7 |" in out


def test_device_check_runs_every_stage() -> None:
    """scripts/device_check.sh runs each stage under its own limit, then the summary of their files."""
    import re

    from pdserve.sizing.gpu_steps import STAGES

    script = (Path(__file__).resolve().parents[1] / "scripts" / "device_check.sh").read_text()
    run = re.findall(r"python3 -m pdserve\.sizing\.gpu_steps (\w+)", script)
    assert run == [*STAGES, "summary"], run
    assert all(f'"$out/steps-{stage}.json"' in script for stage in STAGES)


def test_a_model_that_captures_fewer_graphs_than_buckets_fails_the_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    """The MoE preset must capture every bucket now: a short count is the stage's failure, not a row."""
    from pdserve.sizing import gpu_steps

    def short(ns: object, setup: object) -> list[gpu_steps.Result]:
        return [gpu_steps.Result("capture", "small-moe", "buckets 1,2", {"graphs": 0.0, "expected": 2.0}),
                gpu_steps.Result("capture", "qwen3-8b", "buckets 1,2", {"graphs": 2.0, "expected": 2.0})]

    monkeypatch.setitem(gpu_steps.STAGES, "capture", short)
    assert gpu_steps.main(["capture", "--smoke"]) == 1
    monkeypatch.setitem(gpu_steps.STAGES, "capture", lambda ns, setup: short(ns, setup)[1:])
    assert gpu_steps.main(["capture", "--smoke"]) == 0
    pieces_short = gpu_steps.Result("capture", "qwen3-8b", "tokens 8,16", {"graphs": 2.0, "expected": 2.0,
                                                                          "piecewise": 1.0, "piecewise_expected": 2.0})
    monkeypatch.setitem(gpu_steps.STAGES, "capture", lambda ns, setup: [pieces_short])
    assert gpu_steps.main(["capture", "--smoke"]) == 1


@pytest.mark.parametrize(("budget_s", "stages", "within_s"), [(30, "review", 30), (5, "review steps timings", 12)])
def test_device_check_ends_within_its_budget_whatever_a_stage_does(tmp_path: Path, budget_s: int, stages: str,
                                                                   within_s: int) -> None:
    """A device call runs 600 s at most: a stage that hangs is cut to the budget left, the stages after
    it are skipped, and the summary still prints; with the budget spent nothing runs unbounded (`timeout
    0` is no limit). Stand-ins for python3 and nvidia-smi: every stage hangs."""
    import subprocess
    import time

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text('#!/bin/sh\ncase "$*" in *make-model*|"-c "*) exit 0;; esac\nexec sleep 300\n')
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho stand-in GPU\n")
    for stand_in in bin_dir.iterdir():
        stand_in.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
           "STAGES": stages, "BUDGET_S": str(budget_s)}
    script = Path(__file__).resolve().parents[1] / "scripts" / "device_check.sh"
    start = time.monotonic()
    done = subprocess.run(["bash", str(script)], cwd=script.parents[1], env=env, capture_output=True, text=True,
                          timeout=120)
    took = time.monotonic() - start
    assert took < within_s, (took, done.stdout, done.stderr)
    summary = (tmp_path / "out" / "summary.md").read_text()
    if budget_s > 15:
        assert "| triton-kernels-cuda | 124 |" in summary, summary
    else:
        assert "| triton-kernels-cuda | skipped: budget spent |" in summary, summary
        assert "| steps-capture | skipped: budget spent |" in summary, summary
        assert "| calibrate-qwen3-8b | skipped: budget spent |" in summary, summary
        assert not (tmp_path / "out" / "make-8b.log").exists()
    assert "| gpu-kernels | skipped: budget spent |" in summary, summary
    assert "=== stages (summary.md)" in done.stdout
