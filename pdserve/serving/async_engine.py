"""Runs an `LLMEngine` on its own thread and exposes it to asyncio.

Contract: callers on the event loop `generate()` (an async iterator of cumulative
`RequestOutput`s, the last one `finished`) and `abort()`. All engine calls happen on the engine
thread; requests and aborts cross over through a queue and are applied between steps. Closing the
iterator early (client gone, task cancelled) aborts the request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pdserve.engine.llm_engine import EngineStats, LLMEngine
from pdserve.engine.output import RequestOutput
from pdserve.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: asyncio.Queue[RequestOutput | BaseException]
    loop: asyncio.AbstractEventLoop


@dataclass(frozen=True, slots=True)
class _Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class _Call:
    """Run `fn(engine)` on the engine thread between steps; its result resolves `future`. When
    `stream_for` is set and `keep_stream(result)` holds (default: result is not None, e.g. a
    reservation that succeeded), `stream` receives that request's outputs from then on; a
    RequestOutput result is delivered to its stream too."""

    fn: Callable[[LLMEngine], Any]
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop
    stream_for: str | None = None
    stream: asyncio.Queue[RequestOutput | BaseException] | None = None
    keep_stream: Callable[[Any], bool] = lambda result: result is not None


class AsyncLLM:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.config.scheduler.max_model_len
        self.model_path = engine.config.model_path
        self._inbox: queue.SimpleQueue[_Add | _Abort | _Call | None] = queue.SimpleQueue()
        self._streams: dict[str, _Add | _Call] = {}
        self._error: BaseException | None = None
        self._stats = engine.stats()
        # Called on the engine thread with every output delivered (and an aborted request's last
        # snapshot): the metrics' observer (serving/metrics.py). Set before requests arrive.
        self.output_listener: Callable[[RequestOutput], None] | None = None
        self.last_step_s = time.monotonic()  # when the engine thread last finished a step (or idled)
        self._thread = threading.Thread(target=self._loop, name="pdserve-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    def stats(self) -> EngineStats:
        """Snapshot taken by the engine thread after its last step (safe to read anywhere)."""
        return self._stats

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.engine.validate_request(prompt_token_ids, params)  # pure: safe off the engine thread

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        if not self.alive:
            raise EngineDeadError("the engine has stopped") from self._error
        self.validate_request(prompt_token_ids, params)
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._inbox.put(_Add(request_id, prompt_token_ids, params, stream, asyncio.get_running_loop()))
        async for output in self.consume(request_id, stream):
            yield output

    async def call(self, fn: Callable[[LLMEngine], T], stream_for: str | None = None,
                   stream: asyncio.Queue[RequestOutput | BaseException] | None = None,
                   keep_stream: Callable[[Any], bool] | None = None) -> T:
        """Run `fn(engine)` on the engine thread (the only thread that may touch the engine)."""
        if not self.alive:
            raise EngineDeadError("the engine has stopped") from self._error
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        call = _Call(fn, future, loop, stream_for, stream) if keep_stream is None else \
            _Call(fn, future, loop, stream_for, stream, keep_stream)
        self._inbox.put(call)
        return await future

    async def consume(self, request_id: str,
                      stream: asyncio.Queue[RequestOutput | BaseException]) -> AsyncIterator[RequestOutput]:
        """Yield a request's outputs until it finishes; leaving early aborts it."""
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def shutdown(self) -> None:
        self._inbox.put(None)
        self._thread.join(timeout=10)

    # -- engine thread -------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                # NOTE: blocking while idle, and while only KV reservations wait: spinning on empty
                # steps would hold the GIL against the event loop and the KV transport's thread.
                # Quarantined KV blocks bound the wait, so they return to the pool when due.
                next_release_s = self.engine.release_quarantined_blocks()
                if not self._drain_inbox(block=not self.engine.has_runnable_requests(), timeout_s=next_release_s):
                    return
                for output in self.engine.step():
                    self._deliver(output)
                self._stats = self.engine.stats()
                self.last_step_s = time.monotonic()
        except BaseException as exc:  # noqa: BLE001 - any engine failure must reach every waiter
            logger.exception("engine loop failed")
            self._error = exc
            for add in list(self._streams.values()):
                if add.stream is not None:
                    add.loop.call_soon_threadsafe(add.stream.put_nowait, EngineDeadError(f"engine failed: {exc}"))
            self._streams.clear()

    def _drain_inbox(self, block: bool, timeout_s: float | None = None) -> bool:
        """Apply queued adds/aborts, waiting for the first up to `timeout_s` (None: forever) when
        `block`; False on shutdown."""
        while True:
            try:
                item = self._inbox.get(block=block, timeout=timeout_s if block else None)
            except queue.Empty:
                return True
            block = False
            if item is None:
                return False
            if isinstance(item, _Abort):
                aborted = self.engine.abort_request(item.request_id)
                self._streams.pop(item.request_id, None)
                if aborted is not None and self.output_listener is not None:
                    self.output_listener(aborted)
                continue
            if isinstance(item, _Call):
                self._run_call(item)
                continue
            try:
                self.engine.add_request(item.request_id, item.prompt_token_ids, item.params)
            except ValueError as exc:
                item.loop.call_soon_threadsafe(item.stream.put_nowait, exc)
                continue
            self._streams[item.request_id] = item

    def _run_call(self, call: _Call) -> None:
        try:
            result = call.fn(self.engine)
        except Exception as exc:  # noqa: BLE001 - the caller gets it, the engine carries on
            call.loop.call_soon_threadsafe(_set_exception, call.future, exc)
            return
        if call.stream_for is not None and call.keep_stream(result):
            self._streams[call.stream_for] = call
        if isinstance(result, RequestOutput):
            self._deliver(result)
        call.loop.call_soon_threadsafe(_set_result, call.future, result)

    def _deliver(self, output: RequestOutput) -> None:
        if self.output_listener is not None:
            self.output_listener(output)
        add = self._streams.get(output.request_id)
        if add is None:
            return
        if output.finished:
            del self._streams[output.request_id]
        if add.stream is not None:
            add.loop.call_soon_threadsafe(add.stream.put_nowait, output)


def _set_result(future: asyncio.Future[Any], result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
