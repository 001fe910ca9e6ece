"""`--device cuda:N` makes cuda:N the current device before anything launches on it."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import model_runner


@pytest.mark.parametrize(("device", "expected"), [("cuda:1", [torch.device("cuda:1")]), ("cuda", []), ("cpu", [])])
def test_bind_device_sets_an_indexed_cuda_device(monkeypatch: pytest.MonkeyPatch, device: str,
                                                 expected: list[torch.device]) -> None:
    calls: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    model_runner.bind_device(torch.device(device))
    assert calls == expected
