"""A failure inside the engine: one request's own fault ends that request alone (its client gets an
error, the others in its batch finish with the right text, no block leaks, the engine runs on); a
fault of the model step for the whole batch fails every request in flight at once, frees their
blocks and reports the engine dead (`on_fatal`: the server then drains and exits non-zero)."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import generate_texts, greedy, random_prompt
from server_fixtures import ServerHandle, start_server

from pdserve import LLM
from pdserve.config import EngineArgs
from pdserve.engine.async_llm import AsyncLLM, EngineDeadError
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.output import RequestState

MAX_TOKENS = 12
POISON = random_prompt(24, seed=41)  # the request whose output processing raises
GOOD = [random_prompt(30, seed=seed) for seed in (42, 43)]


@pytest.fixture
def server(model_dirs: dict[str, Path]) -> Iterator[ServerHandle]:
    handle = start_server(model_dirs["tiny"], "tiny", dtype="float32", num_kv_blocks=128)
    yield handle
    handle.stop()


def poison_output_processing(monkeypatch: pytest.MonkeyPatch, after_tokens: int) -> None:
    """POISON's output processing raises from its `after_tokens`-th token on: a fault of that
    request alone, in the middle of a batch."""
    add_token = RequestState.add_token

    def faulty(self: RequestState, index: int, token_id: int, logprobs: Any) -> str | None:
        if self.prompt_token_ids == POISON and len(self.sequences[index].token_ids) >= after_tokens:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return add_token(self, index, token_id, logprobs)

    monkeypatch.setattr(RequestState, "add_token", faulty)


def body(prompt: list[int], **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            **extra}


def test_a_request_that_fails_alone_gets_an_error_and_the_batch_finishes(
        server: ServerHandle, colocated: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    expected = generate_texts(colocated, GOOD, greedy(MAX_TOKENS))
    poison_output_processing(monkeypatch, after_tokens=3)
    with httpx.Client(base_url=server.base_url, timeout=60) as http, concurrent.futures.ThreadPoolExecutor(4) as pool:
        good = [pool.submit(http.post, "/v1/completions", json=body(prompt)) for prompt in GOOD]
        bad = pool.submit(http.post, "/v1/completions", json=body(POISON))
        bad_stream = pool.submit(http.post, "/v1/completions", json=body(POISON, stream=True))
        replies = [future.result() for future in good]
        failed, failed_stream = bad.result(), bad_stream.result()
    assert [reply.json()["choices"][0]["text"] for reply in replies] == expected
    assert failed.status_code == 500, failed.text
    assert "request failed in the engine" in failed.json()["error"]["message"]
    assert failed_stream.status_code == 200  # the stream had started: the error comes in-band
    events = [line.removeprefix("data: ") for line in failed_stream.text.split("\n\n") if line.strip()]
    assert events[-1] == "[DONE]" and "request failed in the engine" in events[-2]
    server.wait_until_idle()  # asserts: engine alive, no block and no request left


def test_a_request_failing_alone_in_offline_generate_raises_and_leaves_nothing(
        model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(model=str(model_dirs["tiny"]), dtype="float32", num_kv_blocks=64)
    poison_output_processing(monkeypatch, after_tokens=2)
    with pytest.raises(RuntimeError, match="request failed in the engine"):
        generate_texts(llm, [GOOD[0], POISON], greedy(MAX_TOKENS))
    pool = llm.engine.scheduler.kv.pool
    assert not llm.engine.has_unfinished_requests() and pool.num_free_blocks == pool.num_blocks


def test_a_broken_model_step_fails_every_request_in_flight_and_reports_the_engine_dead(
        model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(model_dirs["tiny"]), dtype="float32", num_kv_blocks=64))
    execute = engine.runner.execute
    num_steps = 0

    def broken(*args: Any) -> Any:
        nonlocal num_steps
        num_steps += 1
        if num_steps > 4:  # every request has started decoding by then
            raise RuntimeError("injected: the device fell over")
        return execute(*args)

    monkeypatch.setattr(engine.runner, "execute", broken)
    client = AsyncLLM(engine)
    fatal: list[BaseException] = []
    client.on_fatal = fatal.append

    async def run_one(prompt: list[int]) -> BaseException | None:
        try:
            async for _ in client.generate(str(prompt[0]), prompt, greedy(100)):
                pass
        except EngineDeadError as exc:
            return exc
        return None

    async def run_all() -> list[BaseException | None]:
        return await asyncio.wait_for(asyncio.gather(*(run_one(p) for p in [*GOOD, POISON])), timeout=30)

    try:
        errors = asyncio.run(run_all())
        assert all(isinstance(e, EngineDeadError) and "device fell over" in str(e) for e in errors), errors
        client._thread.join(10)  # on_fatal runs on the engine thread, after the errors went out
        assert not client.alive and len(fatal) == 1 and client.failure is fatal[0]
        assert isinstance(asyncio.run(run_one(GOOD[0])), EngineDeadError)  # later work is refused at once
        pool = engine.scheduler.kv.pool
        assert not engine.has_unfinished_requests() and pool.num_free_blocks == pool.num_blocks
    finally:
        client.shutdown()
