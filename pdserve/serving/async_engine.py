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
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pdserve.engine.llm_engine import EngineStats, LLMEngine
from pdserve.engine.output import RequestOutput
from pdserve.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


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


class AsyncLLM:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.config.scheduler.max_model_len
        self._inbox: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._streams: dict[str, _Add] = {}
        self._error: BaseException | None = None
        self._stats = engine.stats()
        self._thread = threading.Thread(target=self._loop, name="pdserve-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    def stats(self) -> EngineStats:
        """Snapshot taken by the engine thread after its last step (safe to read anywhere)."""
        return self._stats

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        if not self.alive:
            raise EngineDeadError("the engine has stopped") from self._error
        self.engine.validate_request(prompt_token_ids, params)  # pure: safe off the engine thread
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._inbox.put(_Add(request_id, prompt_token_ids, params, stream, asyncio.get_running_loop()))
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
                if not self._drain_inbox(block=not self.engine.has_unfinished_requests()):
                    return
                for output in self.engine.step():
                    self._deliver(output)
                self._stats = self.engine.stats()
        except BaseException as exc:  # noqa: BLE001 - any engine failure must reach every waiter
            logger.exception("engine loop failed")
            self._error = exc
            for add in list(self._streams.values()):
                add.loop.call_soon_threadsafe(add.stream.put_nowait, EngineDeadError(f"engine failed: {exc}"))
            self._streams.clear()

    def _drain_inbox(self, block: bool) -> bool:
        """Apply queued adds/aborts; False on shutdown."""
        while True:
            try:
                item = self._inbox.get(block=block, timeout=None)
            except queue.Empty:
                return True
            block = False
            if item is None:
                return False
            if isinstance(item, _Abort):
                self.engine.abort_request(item.request_id)
                self._streams.pop(item.request_id, None)
                continue
            try:
                self.engine.add_request(item.request_id, item.prompt_token_ids, item.params)
            except ValueError as exc:
                item.loop.call_soon_threadsafe(item.stream.put_nowait, exc)
                continue
            self._streams[item.request_id] = item

    def _deliver(self, output: RequestOutput) -> None:
        add = self._streams.get(output.request_id)
        if add is None:
            return
        if output.finished:
            del self._streams[output.request_id]
        add.loop.call_soon_threadsafe(add.stream.put_nowait, output)
