"""A CPU run never loads triton: the engine (its model loader included), the worker, router and
supervisor modules. Triton's extension prints ~28 `nanobind: leaked ...` lines at the exit of every
process that imported it, most of `pdserve up`'s shutdown output on a CPU-only run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_PROBE = """
import sys
from pdserve import LLM
import pdserve.cli, pdserve.disagg.router.app, pdserve.disagg.worker.app, pdserve.disagg.worker.core
import pdserve.ops.up, pdserve.serving.app
llm = LLM(model=sys.argv[1], dtype="float32", num_kv_blocks=64)
out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], None)[0].outputs[0].token_ids
assert out, out
loaded = sorted(m for m in sys.modules if m == "triton" or m.startswith("triton.") or m == "torch._dynamo")
print("LOADED", loaded)
"""


def test_a_cpu_run_never_imports_triton(model_dirs: dict[str, Path]) -> None:
    for name in ("tiny", "moe") if "moe" in model_dirs else ("tiny",):
        done = subprocess.run([sys.executable, "-c", _PROBE, str(model_dirs[name])], capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "LOADED []" in done.stdout, (name, done.stdout[-500:])
