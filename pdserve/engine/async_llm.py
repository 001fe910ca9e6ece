"""Runs an `LLMEngine` on its own thread and exposes it to asyncio.

Contract: callers on the event loop `generate()` (an async iterator of cumulative
`RequestOutput`s, the last one `finished`), `abort()`, and `send()` a typed command
(`engine/commands.py`) whose result they await. Only the engine thread touches the engine:
commands cross over through a queue and are applied between steps, in the order they were sent.
Closing the iterator early (client gone, task cancelled) aborts the request and frees its KV blocks.

Failures. A request whose own handling raised (`LLMEngine.take_failures`) ends alone: its stream
raises RequestFailedError, the engine carries on. Any other exception on the engine thread (the
model step for the whole batch) is fatal: every request in flight and every queued command gets
EngineDeadError, `alive` turns False, and `on_fatal` is called (the server drains and exits
non-zero, so its supervisor restarts it).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from pdserve.config import EngineConfig
from pdserve.engine.commands import Abort, AddRequest, Command
from pdserve.engine.llm_engine import EngineStats, KVTransferSetup, LLMEngine
from pdserve.engine.model_runner import bind_device
from pdserve.engine.output import RequestOutput, RequestState
from pdserve.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
R = TypeVar("R")


class EngineDeadError(RuntimeError):
    """The engine thread failed: nothing more will run on this engine."""


class RequestFailedError(RuntimeError):
    """This request failed in the engine (its own handling raised); the engine carries on."""


class OutputSink(Protocol):
    """Where a request's outputs go (an asyncio.Queue): outputs, or the exception that ends it."""

    def put_nowait(self, item: RequestOutput | BaseException, /) -> None: ...


OutputStream = asyncio.Queue[RequestOutput | BaseException]


class EngineClient(Protocol):
    """What a worker's services use of their engine: `AsyncLLM` (a thread of this process) or
    `EngineCoreClient` (an engine process of its own, engine/core_client.py)."""

    config: EngineConfig
    last_step_s: float  # when the engine last finished a step (or went idle)

    async def send(self, command: Command[R], sink: OutputSink | None = None) -> R: ...

    def consume(self, request_id: str, stream: OutputStream) -> AsyncIterator[RequestOutput]: ...

    def abort(self, request_id: str) -> None: ...


@dataclass(frozen=True, slots=True)
class _Envelope:
    """A command in the inbox, with where its result and its request's outputs go (engine thread
    -> `loop`). `future` is None for fire-and-forget commands (`abort`)."""

    command: Command[Any]
    loop: asyncio.AbstractEventLoop | None = None
    future: asyncio.Future[Any] | None = None
    sink: OutputSink | None = None

    def reply(self, result: object) -> None:
        if self.loop is not None and self.future is not None:
            self.loop.call_soon_threadsafe(set_result, self.future, result)

    def fail(self, exc: BaseException) -> None:
        if self.loop is not None and self.future is not None:
            self.loop.call_soon_threadsafe(set_exception, self.future, exc)


@dataclass(frozen=True, slots=True)
class LoopStream:
    """A request's output sink and the event loop it belongs to (filled from another thread)."""

    sink: OutputSink
    loop: asyncio.AbstractEventLoop

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.sink.put_nowait, item)


class AsyncLLM:
    def __init__(self, engine: LLMEngine, kv_transfer: KVTransferSetup | None = None) -> None:
        """`kv_transfer` (disaggregated workers) is set on the engine before its thread starts."""
        if kv_transfer is not None:
            engine.configure_kv_transfer(kv_transfer)
        self.engine = engine
        self.config = engine.config
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.config.scheduler.max_model_len
        self.vocab_size = engine.config.model.vocab_size
        self.model_path = engine.config.model_path
        self._inbox: queue.SimpleQueue[_Envelope | None] = queue.SimpleQueue()
        self._streams: dict[str, LoopStream] = {}  # engine thread only
        self._error: BaseException | None = None
        self._stats = engine.stats()
        # Called on the engine thread with every output delivered (and an aborted request's last
        # snapshot): the metrics' observer (serving/metrics.py). Set before requests arrive.
        self.output_listener: Callable[[RequestOutput], None] | None = None
        self.last_step_s = time.monotonic()  # when the engine thread last finished a step (or idled)
        # Called once, on the engine thread, after a fatal failure was delivered to every waiter
        # (cli: drain and exit non-zero). Set before requests arrive.
        self.on_fatal: Callable[[BaseException], None] | None = None
        self._thread = threading.Thread(target=self._loop, name="pdserve-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    @property
    def failure(self) -> BaseException | None:
        """What ended the engine thread; None while it runs or after a clean `shutdown`."""
        return self._error

    def stats(self) -> EngineStats:
        """Snapshot taken by the engine thread after its last step (safe to read anywhere)."""
        return self._stats

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.engine.validate_request(prompt_token_ids, params)  # pure: safe off the engine thread

    async def send(self, command: Command[R], sink: OutputSink | None = None) -> R:
        """Apply `command` on the engine thread and return its result (or raise its exception).
        `sink` receives the outputs of the request the command starts (`Command.stream_of`)."""
        if not self.alive:
            raise EngineDeadError("the engine has stopped") from self._error
        loop = asyncio.get_running_loop()
        future: asyncio.Future[R] = loop.create_future()
        self._inbox.put(_Envelope(command, loop, future, sink))
        if self._error is not None:  # it died meanwhile, perhaps after failing what it found queued
            self._fail_queued(self._error)
        return await future

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        self.validate_request(prompt_token_ids, params)
        stream: OutputStream = asyncio.Queue()
        try:
            await self.send(AddRequest(request_id, prompt_token_ids, params), stream)
        except asyncio.CancelledError:
            self.abort(request_id)  # it may have been added meanwhile; the abort comes after
            raise
        async for output in self.consume(request_id, stream):
            yield output

    async def consume(self, request_id: str, stream: OutputStream) -> AsyncIterator[RequestOutput]:
        """Yield a request's outputs until it finishes; leaving early aborts it."""
        async for output in consume_outputs(request_id, stream, self.abort):
            yield output

    def abort(self, request_id: str) -> None:
        """Fire and forget (callable from `finally` blocks): the engine applies it in order."""
        self._inbox.put(_Envelope(Abort(request_id)))

    def shutdown(self) -> None:
        self._inbox.put(None)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.engine.close()

    def _loop(self) -> None:
        """The engine thread. NOTE: CUDA's current device is per thread; the runner bound it on the
        thread that built it, not on this one, where the steps launch (`bind_device`)."""
        try:
            bind_device(self.config.device)
            while True:
                # NOTE: blocking while idle, and while only KV reservations wait: spinning on empty
                # steps would hold the GIL against the event loop and the KV transport's thread.
                # Quarantined KV blocks bound the wait, so they return to the pool when due.
                next_release_s = self.engine.release_quarantined_blocks()
                if not self._drain_inbox(block=not self.engine.has_runnable_requests(), timeout_s=next_release_s):
                    return
                for output in self.engine.step():
                    self._deliver(output)
                self._deliver_failures()
                self._stats = self.engine.stats()
                self.last_step_s = time.monotonic()
        except BaseException as exc:  # noqa: BLE001 - any engine failure must reach every waiter
            logger.exception("engine loop failed: failing every request, the engine is dead")
            self._fail_everyone(exc)
            if self.on_fatal is not None:
                self.on_fatal(exc)

    def _fail_everyone(self, exc: BaseException) -> None:
        self._error = exc
        for request_id, stream in self._streams.items():
            stream.put(EngineDeadError(f"engine failed: {exc}"))
            try:  # free its blocks if the engine's bookkeeping still can
                self.engine.abort_request(request_id)
            except Exception:  # noqa: BLE001 - the engine is broken; the process is going away
                logger.debug("could not abort %s after the engine failed", request_id, exc_info=True)
        self._streams.clear()
        self._fail_queued(exc)

    def _deliver_failures(self) -> None:
        for failure in self.engine.take_failures():
            stream = self._streams.pop(failure.request_id, None)
            if stream is not None:
                stream.put(RequestFailedError(failure.error))

    def _fail_queued(self, exc: BaseException) -> None:
        """Commands the dead engine will never apply: their senders get EngineDeadError."""
        while True:
            try:
                envelope = self._inbox.get_nowait()
            except queue.Empty:
                return
            if envelope is not None:
                envelope.fail(EngineDeadError(f"engine failed: {exc}"))

    def _drain_inbox(self, block: bool, timeout_s: float | None = None) -> bool:
        """Apply queued commands, waiting for the first up to `timeout_s` (None: forever) when
        `block`; False on shutdown."""
        while True:
            try:
                envelope = self._inbox.get(block=block, timeout=timeout_s if block else None)
            except queue.Empty:
                return True
            block = False
            if envelope is None:
                return False
            self._apply(envelope)

    def _apply(self, envelope: _Envelope) -> None:
        command = envelope.command
        try:
            result = command.apply(self.engine)
        except Exception as exc:  # noqa: BLE001 - the caller gets it, the engine carries on
            self._deliver_failures()
            envelope.fail(exc)
            return
        opened = command.stream_of(result)
        if opened is not None and envelope.sink is not None and envelope.loop is not None:
            self._streams[opened] = LoopStream(envelope.sink, envelope.loop)
        closed = command.closes()
        if closed is not None:
            self._streams.pop(closed, None)
        output = command.emitted(result)
        if output is not None:
            self._deliver(output)
        self._deliver_failures()
        # NOTE: an output state's snapshot went to the stream; the reply carries none (as over the wire)
        envelope.reply(None if isinstance(result, RequestState) else result)

    def _deliver(self, output: RequestOutput) -> None:
        if self.output_listener is not None:
            self.output_listener(output)
        stream = self._streams.get(output.request_id)
        if stream is None:
            return
        if output.finished:
            del self._streams[output.request_id]
        stream.put(output)


async def consume_outputs(request_id: str, stream: OutputStream,
                          abort: Callable[[str], None]) -> AsyncIterator[RequestOutput]:
    """Yield a request's outputs until it finishes (an exception in the stream is raised); leaving
    early calls `abort`."""
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
            abort(request_id)


def set_result(future: asyncio.Future[Any], result: object) -> None:
    if not future.done():
        future.set_result(result)


def set_exception(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
