"""`python -m pdserve.bench.pd_parity`: every prompt greedy and seeded, streamed and not; the exit
status says whether PD's answers equal colocated's (the servers are stubbed: the GPU run starts
real ones, docs/BENCHMARKS.md "On a GPU")."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from pdserve.bench import pd_parity


def test_requests_cover_greedy_and_seeded_streamed_and_not() -> None:
    requests = pd_parity.make_requests([4, 60], max_tokens=8)
    assert len(requests) == 8 and [len(r["prompt"]) for r in requests] == [4] * 4 + [60] * 4
    kinds = {(r["temperature"] > 0, r["stream"]) for r in requests}
    assert kinds == {(False, False), (False, True), (True, False), (True, True)}
    assert all(r["seed"] is not None for r in requests if r["temperature"] > 0)
    assert pd_parity.make_requests([4, 60], max_tokens=8) == requests  # the same prompts every run


@pytest.mark.parametrize("pd_texts, status", [(["a", "b", "c", "d"], 0), (["a", "b", "X", "d"], 1)])
def test_exit_status_is_whether_every_answer_matches(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str], pd_texts: list[str],
                                                     status: int) -> None:
    started: list[list[str]] = []

    def fake_measure(name: str, cli_args: list[str], port: int, ns: argparse.Namespace,
                     requests: list[dict[str, Any]]) -> dict[str, Any]:
        started.append(cli_args)
        texts = ["a", "b", "c", "d"] if name == "colocated" else pd_texts
        return {"texts": texts, "ttft_s": [0.01, 0.02, 0.03]}

    monkeypatch.setattr(pd_parity, "measure", fake_measure)
    assert pd_parity.main(["--prompt-lens", "4", "--device", "cuda", "--dtype", "bfloat16"]) == status
    assert started[0][0] == "serve" and started[1][0] == "up"
    assert all("--device" in args and "bfloat16" in args for args in started)  # engine flags go to both
    assert "--kv-transport" in started[1]
    out = capsys.readouterr().out
    assert ("3/4" in out) == (status == 1) and ("differs" in out) == (status == 1)
