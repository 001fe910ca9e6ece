"""The GPU check's kernel stage (pdserve/bench/gpu_kernels.py, run by scripts/device_check.sh) runs
here at tiny shapes in Triton's interpreter, so it cannot rot before a GPU runs it; its kernels
agree with SDPA."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("triton")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton kernels on CPU need the interpreter")
def test_smoke_run_checks_every_kernel_against_sdpa(tmp_path: Path) -> None:
    from pdserve.bench.gpu_kernels import main

    results = main(["--smoke", "--save", str(tmp_path / "kernels.json")])
    assert [r.kernel for r in results] == ["decode", "prefix", "sdpa (masked)", "prefix", "sdpa (causal)"]
    assert [r.shape for r in results[1:]] == ["8x24", "8x24", "8x8", "8x8"]
    assert all(r.max_error < 1e-4 and r.ms > 0 for r in results)
    assert len(json.loads((tmp_path / "kernels.json").read_text())) == 5


def test_device_check_script_parses_and_names_modules_that_exist() -> None:
    """scripts/device_check.sh is run only on a GPU: here it must at least parse, and every
    `python3 -m pdserve...` module and test file it runs must exist."""
    import importlib.util
    import re
    import subprocess

    script = Path(__file__).resolve().parents[1] / "scripts" / "device_check.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    modules = set(re.findall(r"python3 -m (pdserve[\w.]*)", text))
    assert "pdserve.bench.gpu_kernels" in modules
    assert all(importlib.util.find_spec(m) is not None for m in modules), modules
    tests = set(re.findall(r"tests/(test_\w+\.py)", text))
    assert tests and all((script.parents[1] / "tests" / t).exists() for t in tests), tests
