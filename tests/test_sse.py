"""A streamed response's events: their JSON is the text json.dumps writes (ChunkJson), and the events
an iterator has ready together go out in one write, never one held back for a later event, with
the iterator cleaned up as under a cancelled task when its consumer stops (event_stream.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from pdserve.serving import event_stream
from pdserve.serving.event_stream import EventStreamResponse, write_batches
from pdserve.serving.sse import ChunkJson, to_json

_VALUES: list[Any] = [None, "", "plain", 'quo"te \\ back', "tab\t nl\n cr\r \x00 \x1f \x7f", "ünï 中文 🙂",
                      "\ud800 lone", 0, -3, 7, 1.5, True, {"tokens": ["a", "ü"], "token_logprobs": [-0.25, None]},
                      ["x", {"y": None}]]


@pytest.mark.parametrize("value", _VALUES)
def test_to_json_writes_what_json_dumps_writes(value: Any) -> None:
    assert to_json(value) == json.dumps(value, ensure_ascii=False)


@pytest.mark.parametrize("kind", ["text_completion", "chat.completion.chunk"])
def test_a_chunk_is_the_text_json_dumps_writes(kind: str) -> None:
    chunks = ChunkJson.of("cmpl-\"ü\"", kind, 1_700_000_000, "mödel/\\x")
    head = {"id": "cmpl-\"ü\"", "object": kind, "created": 1_700_000_000, "model": "mödel/\\x"}
    for value in _VALUES:
        choices = [{"index": 3, "text": value, "logprobs": None, "finish_reason": "stop", "stop_reason": value}]
        assert chunks.chunk(to_json(choices)) == json.dumps(head | {"choices": choices}, ensure_ascii=False)
    usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7, "prompt_tokens_details": None}
    assert chunks.usage(usage) == json.dumps(head | {"choices": [], "usage": usage}, ensure_ascii=False)
    assert json.loads(chunks.chunk("[]"))["choices"] == []


class _Source:
    """An async generator of events; `gate` (when set) holds the next event until released, and
    what happened to the generator is recorded in `log`."""

    def __init__(self, bursts: list[list[str]], fail: Exception | None = None) -> None:
        self.bursts, self.fail = bursts, fail
        self.gate = asyncio.Event()
        self.log: list[str] = []

    async def events(self) -> AsyncIterator[str]:
        try:
            for number, burst in enumerate(self.bursts):
                if number:
                    self.gate.clear()
                    await self.gate.wait()  # NOTE: a suspension, as the router's inbox.get is
                for event in burst:
                    if event == "yield":
                        await asyncio.sleep(0)  # NOTE: suspends, waiting for nothing
                    yield event
            if self.fail is not None:
                raise self.fail
        except BaseException as exc:
            self.log.append(type(exc).__name__)
            raise
        finally:
            self.log.append("closed")


def _run_writer(source: _Source) -> list[list[str]]:
    """Write `source` with write_batches; each write releases the source's next burst (so a write
    held back until the next event would never happen: the test would time out)."""
    writes: list[list[str]] = []

    async def write(batch: list[str]) -> None:
        writes.append(list(batch))
        source.gate.set()

    async def main() -> None:
        await asyncio.wait_for(write_batches(source.events(), write), timeout=5)

    asyncio.run(main())
    return writes


def test_events_ready_together_go_out_in_one_write_and_none_waits_for_a_later_one() -> None:
    source = _Source([["a", "b", "c"], ["d"], ["e", "yield", "f"]])
    writes = _run_writer(source)
    # NOTE: "yield" (asyncio.sleep(0)) suspends the step without waiting for anything: its batch is
    # written before it, and the step then goes on as under its task.
    assert writes == [["a", "b", "c"], ["d"], ["e"], ["yield", "f"]]
    assert source.log == ["closed"]


def test_a_long_burst_is_written_in_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(event_stream, "_MAX_BATCH", 4)
    source = _Source([[str(i) for i in range(10)]])
    assert _run_writer(source) == [["0", "1", "2", "3"], ["4", "5", "6", "7"], ["8", "9"]]


def test_an_error_from_the_events_comes_after_what_was_ready_before_it() -> None:
    source = _Source([["a"], ["b", "c"]], fail=ValueError("broke"))
    writes: list[list[str]] = []

    async def write(batch: list[str]) -> None:
        writes.append(list(batch))
        source.gate.set()

    with pytest.raises(ValueError, match="broke"):
        asyncio.run(write_batches(source.events(), write))
    assert writes == [["a"], ["b", "c"]]
    assert source.log == ["ValueError", "closed"]


def test_a_write_that_fails_while_the_next_event_is_awaited_closes_the_events() -> None:
    """The client left during a write (the task cancelled there), while the iterator's next step had
    begun and waits: the step gets the CancelledError, so the iterator's clean-up (aborts) runs."""
    source = _Source([["a", "b"], ["c"]])

    async def write(batch: list[str]) -> None:
        raise asyncio.CancelledError

    async def main() -> None:
        with pytest.raises(asyncio.CancelledError):
            await write_batches(source.events(), write)

    asyncio.run(main())
    assert source.log == ["CancelledError", "closed"]


def test_a_task_cancelled_while_the_next_event_is_awaited_closes_the_events() -> None:
    source = _Source([["a"], ["never"]])
    writes: list[list[str]] = []

    async def write(batch: list[str]) -> None:
        writes.append(batch)

    async def main() -> None:
        task = asyncio.create_task(write_batches(source.events(), write))
        while not writes:
            await asyncio.sleep(0)
        await asyncio.sleep(0.01)  # NOTE: the task now waits on the source's gate, inside the step
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert writes == [["a"]]
    assert source.log == ["CancelledError", "closed"]


def test_the_response_sends_start_then_batches_then_the_end() -> None:
    source = _Source([["data: 1\n\n", "data: 2\n\n"], ["data: ü\n\n"]])
    messages: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)
        source.gate.set()

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()  # NOTE: the client never leaves
        raise AssertionError

    response = EventStreamResponse(source.events())
    asyncio.run(response({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send))
    assert messages[0]["type"] == "http.response.start" and messages[0]["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in messages[0]["headers"]
    assert [(m["body"], m["more_body"]) for m in messages[1:]] == [
        (b"data: 1\n\ndata: 2\n\n", True), ("data: ü\n\n".encode(), True), (b"", False)]
