"""calibrate -> simulate on the tiny model: the profile is measured with the real engine, fits its
samples, and drives the simulator."""

from __future__ import annotations

import json
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
