"""`python -m pdserve.bench.served_vs_offline` (issue 29), tiny: offline, then a served engine on a
thread and in its own process, a row each, every request answered."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.bench import served_vs_offline

pytestmark = pytest.mark.slow  # two servers as processes


def test_the_benchmark_prints_offline_and_both_served_engines(model_dirs: dict[str, Path],
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert served_vs_offline.main(["--model", str(model_dirs["tiny"]), "--num-requests", "4", "--concurrency", "4",
                                   "--input-len", "8", "--output-len", "4", "--num-kv-blocks", "64"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]
    assert [row.split("|")[1].strip() for row in rows] == [
        "offline (LLM.generate)", "served, engine thread (--engine-in-process)", "served, engine process"]
    for row in rows:
        cells = [cell.strip() for cell in row.split("|")[2:-1]]
        assert float(cells[0]) > 0 and float(cells[2]) > 0 and int(cells[4]) >= 4, row  # tok/s, step ms, steps
