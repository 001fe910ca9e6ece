"""`--device cuda:N` makes cuda:N the current device before anything launches on it."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from pdserve.engine import model_runner
from pdserve.engine.async_llm import AsyncLLM


@pytest.mark.parametrize(("device", "expected"), [("cuda:1", [torch.device("cuda:1")]), ("cuda", []), ("cpu", [])])
def test_bind_device_sets_an_indexed_cuda_device(monkeypatch: pytest.MonkeyPatch, device: str,
                                                 expected: list[torch.device]) -> None:
    calls: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    model_runner.bind_device(torch.device(device))
    assert calls == expected


class _IdleEngine:
    """What `AsyncLLM` reads of an engine, on `cuda:1`, with nothing to run."""

    def __init__(self) -> None:
        self.config = SimpleNamespace(device=torch.device("cuda:1"), scheduler=SimpleNamespace(max_model_len=8),
                                      model=SimpleNamespace(vocab_size=8), model_path="idle")
        self.tokenizer = None
        self.closed = False

    def stats(self) -> None:
        return None

    def release_quarantined_blocks(self) -> None:
        return None

    def has_runnable_requests(self) -> bool:
        return False

    def close(self) -> None:
        self.closed = True


def test_the_engine_thread_binds_the_device_it_steps_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA's current device is per thread: the runner binds it where it is built, and `AsyncLLM`'s
    steps (Triton launches, graph replays, events) run on its own thread, which must bind it too."""
    calls: list[tuple[torch.device, int]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append((device, threading.get_ident())))
    engine = _IdleEngine()
    llm = AsyncLLM(engine)  # type: ignore[arg-type]
    llm.shutdown()
    assert engine.closed
    assert calls == [(torch.device("cuda:1"), llm._thread.ident)]
    assert llm._thread.ident != threading.get_ident()
