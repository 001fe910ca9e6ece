"""bench.gpu_floor (scripts/device_check.sh, stage `floor`): its floors, and a run on CPU with the
tiny model, so the device stage's Python runs before a GPU is lent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.model.facts import load_model_facts
from pdserve.sizing import gpu_floor
from pdserve.sizing.devices import device


def test_floors() -> None:
    model, h200 = load_model_facts("qwen3-8b"), device("H200")
    weights_only = gpu_floor.decode_floor_s(model, h200, 0, 0, 2, 2)
    assert weights_only == pytest.approx(model.matmul_params * 2 / 4.8e12)
    assert 3e-3 < weights_only < 3.5e-3  # ~7.6 G matmul parameters in bf16 at 4.8 TB/s
    per_token = model.kv_bytes_per_token(2) / 4.8e12  # 144 KiB of bf16 KV a token on qwen3-8b
    assert gpu_floor.decode_floor_s(model, h200, 64, 258, 2, 2) == pytest.approx(weights_only + 64 * 258 * per_token)
    assert gpu_floor.decode_floor_s(model, h200, 1, 100, 2, 1) < gpu_floor.decode_floor_s(model, h200, 1, 100, 2, 2)
    prefill = gpu_floor.prefill_floor_s(model, h200, 8192)
    assert 2 * model.matmul_params * 8192 / 989e12 < prefill < 1.2 * 2 * model.matmul_params * 8192 / 989e12


def test_runs_on_cpu(model_dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save = tmp_path / "floor.json"
    assert gpu_floor.main(["--model", str(model_dirs["tiny"]), "--device", "cpu", "--dtype", "float32",
                           "--batches", "1,2", "--context", "8", "--prefill-tokens", "16", "--save", str(save)]) == 0
    rows = json.loads(save.read_text())["rows"]
    assert [(r["step"], r["mode"]) for r in rows] == [
        ("decode 1 x 8", "graphs"), ("decode 2 x 8", "graphs"), ("prefill 16", "eager"),
        ("decode 1 x 8", "eager"), ("decode 2 x 8", "eager")]
    assert all(r["measured_s"] > 0 and r["floor_s"] > 0 and r["roofline_s"] > r["floor_s"] for r in rows)
    table = capsys.readouterr().out
    assert "| tiny" in table and "x roofline profile" in table
