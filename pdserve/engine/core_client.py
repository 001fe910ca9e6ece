"""The API process's side of an engine in its own process (engine/core_proc.py): `EngineCoreClient`
offers what a colocated server uses of `AsyncLLM` (generate, abort, send, stats, alive, on_fatal,
output_listener), and is its output processor.

    event loop ──ToCore──▶ socket ──▶ engine core: apply commands, step, ONE FromCore per step
    reader thread ◀──FromCore── socket       (every request's new token ids and finish state)
        └─ per request: RequestState (detokenize, stop strings, logprobs) -> cumulative RequestOutput
           -> its stream on its event loop; a stop string found here -> `stop_sequence` to the core

The reader thread does what the engine thread's `_emit` did in-process (`RequestState`, the same
code), so the engine process spends no time on text. One lock covers the request table: the event
loop (generate, abort) and the reader thread both change it, and the output listener (metrics)
runs under it, so it stays single-threaded. A writer thread alone writes the socket (commands
queue for it), so no thread of this process ever waits on the engine process reading.

Failures, as with `AsyncLLM`: a request whose output processing raised (here, or in the core) ends
alone with RequestFailedError and is aborted in the core. The engine core's end (a fatal step, a
frame that does not decode, its process gone: EOF) fails every request in flight and every waiting
command with EngineDeadError, `alive` turns False and `on_fatal` runs (the server drains and exits
non-zero). The engine process exits when this one is gone (EOF on its link).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import socket
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from pdserve.config import EngineArgs, EngineConfig, create_engine_config
from pdserve.engine.async_llm import (
    EngineDeadError,
    LoopStream,
    OutputSink,
    OutputStream,
    RequestFailedError,
    consume_outputs,
    set_exception,
    set_result,
)
from pdserve.engine.commands import (
    Abort,
    AddPrefillOnly,
    AddRequest,
    Command,
    ReserveRemote,
    StopSequence,
)
from pdserve.engine.core_wire import (
    CoreReply,
    FrameReader,
    FromCore,
    ToCore,
    decode_from_core,
    encode_to_core,
    link_buffers,
    recv_frames,
    result_of,
)
from pdserve.engine.engine_types import EngineStats, check_request
from pdserve.engine.link_writer import LinkWriter
from pdserve.engine.output import OutputSettings, RequestDelta, RequestOutput, RequestState, SequenceDelta
from pdserve.engine.request import RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tensor_parallel import spawn_module
from pdserve.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)
R = TypeVar("R")
_SHUTDOWN_WAIT_S = 10.0


class EngineStartError(RuntimeError):
    """The engine core process could not build its engine (its message says why)."""


@dataclass(slots=True)
class _Tracked:
    state: RequestState
    stream: LoopStream


class EngineCoreClient:
    def __init__(self, process: subprocess.Popen[bytes], sock: socket.socket, reader: FrameReader,
                 config: EngineConfig, first: FromCore) -> None:
        """Use `start`."""
        assert first.stats is not None
        stats = first.stats
        self.process = process
        self.config = config
        self.info = first.info or {}  # what a worker's KV side said at start (engine/core_proc.py CoreSide)
        # A worker's KV side: its events (on the reader thread) and counters (with the stats)
        self.kv_listener: Callable[[list[list[Any]]], None] | None = None
        self.kv_stats: dict[str, int] = {}
        self.tokenizer = load_tokenizer(config.model_path)
        self.max_model_len = config.scheduler.max_model_len
        self.vocab_size = config.model.vocab_size
        self.model_path = config.model_path
        self._sock = sock
        self._frames = reader
        self._stats = stats
        self._error: BaseException | None = None
        self._closing = False
        self._lock = threading.Lock()  # _requests, _pending, and the output listener's calls
        # NOTE: neither the event loop nor the reader thread ever waits on the engine process reading
        # (a reader blocked on a full socket while the engine blocks on sending it outputs would be a
        # deadlock): `LinkWriter` sends what the socket takes at once, its thread the rest
        self._link = LinkWriter(sock)
        self._requests: dict[str, _Tracked] = {}
        self._pending: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]]] = {}
        self._call_ids = itertools.count(1)
        # As AsyncLLM's: called with every output delivered (metrics), here on the reader thread.
        self.output_listener: Callable[[RequestOutput], None] | None = None
        self.on_fatal: Callable[[BaseException], None] | None = None
        self.last_step_s = time.monotonic()  # when the engine core's loop last sent a message
        self._reader = threading.Thread(target=self._read, name="pdserve-engine-core-reader", daemon=True)
        self._reader.start()

    @classmethod
    def start(cls, args: EngineArgs, worker: dict[str, Any] | None = None,
              module: str = "pdserve.engine.core_proc") -> EngineCoreClient:
        """Spawn the engine core process (`module`) and wait until its engine is built; `worker`: the
        KV side it builds beside the engine (disagg/worker/core.py). A bad flag raises ValueError here,
        before anything starts; a failure in the engine process EngineStartError."""
        config = create_engine_config(args)
        process, sock = spawn_module(module)
        link_buffers(sock)
        root = logging.getLogger()
        json_logs = any(type(h.formatter).__name__ == "JsonFormatter" for h in root.handlers)
        reader = FrameReader()
        try:
            sock.sendall(encode_to_core(ToCore("start", engine_args=dataclasses.asdict(args), worker=worker,
                                               log_level=logging.getLevelName(root.getEffectiveLevel()),
                                               log_format="json" if json_logs else "text")))
            first = _first_message(sock, reader)
        except BaseException:
            process.kill()
            process.wait()
            raise
        if first is None or not first.ready or first.stats is None:
            why = f"exit status {process.wait()}" if first is None else first.fatal
            process.kill()
            process.wait()
            raise EngineStartError(f"the engine process failed to start: {why}")
        logger.debug("engine core process: pid %d", process.pid)
        return cls(process, sock, reader, config, first)

    @property
    def alive(self) -> bool:
        return self._error is None and self._reader.is_alive()

    @property
    def failure(self) -> BaseException | None:
        """What ended the engine; None while it runs or after a clean `shutdown`."""
        return self._error

    @property
    def num_in_flight(self) -> int:
        """Requests this process still streams (their outputs not all delivered)."""
        return len(self._requests)

    def stats(self) -> EngineStats:
        """The engine core's latest (sent every few ms while busy, and when it goes idle)."""
        return self._stats

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        check_request(prompt_token_ids, params, self.max_model_len, self.vocab_size)

    async def send(self, command: Command[R], sink: OutputSink | None = None) -> R:
        """Apply `command` in the engine process and return its result (or raise its exception), as
        `AsyncLLM.send`: `sink` receives the outputs of the request the command starts. Those a
        stream is opened for (`Command.stream_of`) are registered before the command leaves, so no
        output can come back first."""
        if isinstance(command, Abort):
            self.abort(command.request_id)
            return cast(R, None)
        opens = _opens_stream(command)
        if opens is not None:
            if sink is None:
                raise ValueError(f"{type(command).__name__} starts a request: pass the sink of its outputs")
            self._track(*opens, sink)
        try:
            value = await self._call(ToCore("command", command=command))
        except BaseException:
            if opens is not None:
                self._untrack(opens[0])
            raise
        result = result_of(command, value)
        if opens is not None and command.stream_of(result) is None:  # e.g. a reservation with no room
            self._untrack(opens[0])
        closed = command.closes()
        if closed is not None:
            self._untrack(closed)
        return cast(R, result)

    async def call_kv(self, kv: list[Any]) -> Any:
        """A call to the worker's KV side in the engine process; raises `CoreCallError` (named by
        the KV side) or EngineDeadError."""
        return await self._call(ToCore("kv", kv=kv))

    def tell_kv(self, kv: list[Any]) -> None:
        """A call to the KV side that nobody awaits (fire and forget, in order with the others)."""
        self._send_quietly(ToCore("kv", kv=kv))

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        self.validate_request(prompt_token_ids, params)
        stream: OutputStream = asyncio.Queue()
        try:
            await self.send(AddRequest(request_id, list(prompt_token_ids), params), stream)
        except BaseException:
            self.abort(request_id)  # refused, or cancelled: it may have been added meanwhile
            raise
        async for output in self.consume(request_id, stream):
            yield output

    async def consume(self, request_id: str, stream: OutputStream) -> AsyncIterator[RequestOutput]:
        """Yield a request's outputs until it finishes; leaving early aborts it."""
        async for output in consume_outputs(request_id, stream, self.abort):
            yield output

    def _track(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, sink: OutputSink) -> None:
        """Outputs of `request_id` go to `sink` from now on, through its output state (detokenizing)."""
        state = RequestState.of_request(request_id, None, list(prompt_token_ids), params,
                                        OutputSettings(self.tokenizer), time.monotonic())
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._requests[request_id] = _Tracked(state, LoopStream(sink, asyncio.get_running_loop()))

    def _untrack(self, request_id: str) -> None:
        with self._lock:
            self._requests.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Fire and forget (callable from `finally` blocks): the stream closes here at once, and the
        engine core frees the request's blocks when the abort reaches it."""
        with self._lock:
            tracked = self._requests.pop(request_id, None)
            if tracked is not None and self.output_listener is not None:
                state = tracked.state
                for index in range(len(state.sequences)):
                    state.finish(index, RequestStatus.FINISHED_ABORTED, None)
                self.output_listener(state.snapshot())
        self._send_quietly(ToCore("command", command=Abort(request_id)))

    def shutdown(self) -> None:
        self._closing = True
        self._send_quietly(ToCore("shutdown"))
        self._link.close()
        try:
            self.process.wait(timeout=_SHUTDOWN_WAIT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._reader.join(timeout=_SHUTDOWN_WAIT_S)
        self._link.join(_SHUTDOWN_WAIT_S)
        self._sock.close()

    # -- the link ------------------------------------------------------------------------------

    async def _call(self, message: ToCore) -> Any:
        if not self.alive:
            raise EngineDeadError("the engine has stopped") from self._error
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        call_id = next(self._call_ids)
        with self._lock:
            self._pending[call_id] = (loop, future)
        self._send_quietly(dataclasses.replace(message, call_id=call_id))
        if self._error is not None:  # it died meanwhile, perhaps after failing what was pending
            self._fail_pending(self._error)
        return await future

    def _send_quietly(self, message: ToCore) -> None:
        """Never waits on the engine process; a link that is gone is the reader thread's to report (EOF)."""
        self._link.send(encode_to_core(message))

    def _read(self) -> None:
        """The reader thread: every message of the engine core, until it ends."""
        try:
            while True:
                frames = recv_frames(self._sock, self._frames)
                if frames is None:
                    if self._closing:
                        return
                    raise EngineDeadError(f"the engine process exited (status {self.process.wait()})")
                for frame in frames:
                    message = decode_from_core(frame)
                    self._on_message(message)
                    if message.fatal is not None:
                        raise RuntimeError(message.fatal)
        except BaseException as exc:  # noqa: BLE001 - any end of the engine must reach every waiter
            if self._closing:
                return
            logger.error("the engine core failed (%s): failing every request, the engine is dead", exc)
            self._fail_everyone(exc)
            if self.process.poll() is None:  # e.g. it sent what does not decode: it must not run on
                self.process.kill()
            if self.on_fatal is not None:
                self.on_fatal(exc)

    def _on_message(self, message: FromCore) -> None:
        if message.outputs or message.alone.request_ids or message.failures or message.stats is not None:
            self.last_step_s = time.monotonic()  # NOTE: not the KV side's
        if message.stats is not None:
            self._stats = message.stats
        with self._lock:
            for delta in message.outputs:
                self._process(delta)
            for delta in message.alone.deltas():
                self._process(delta)
            for request_id, error in message.failures:
                tracked = self._requests.pop(request_id, None)
                if tracked is not None:
                    tracked.stream.put(RequestFailedError(error))
            if message.stats is not None and message.kv_stats is not None:
                self.kv_stats = message.kv_stats
            if message.kv_events and self.kv_listener is not None:
                self.kv_listener(message.kv_events)
            self._answer(message.replies)

    def _answer(self, replies: list[CoreReply]) -> None:
        """Each reply to its waiting call (under the lock)."""
        for reply in replies:
            pending = self._pending.pop(reply.call_id, None)
            if pending is None:
                continue
            loop, future = pending
            if reply.error is None:
                loop.call_soon_threadsafe(set_result, future, reply.value)
            else:
                loop.call_soon_threadsafe(set_exception, future, _raised(reply))

    def _process(self, delta: RequestDelta) -> None:
        """Feed one request's new tokens to its output state, as `LLMEngine._advance` does in-process;
        deliver its cumulative output."""
        tracked = self._requests.get(delta.request_id)
        if tracked is None:
            return  # aborted, or failed here: the core learns it (or has) from the abort
        state = tracked.state
        try:
            for seq in delta.sequences:
                self._feed(delta.request_id, state, seq)
            if state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = delta.first_scheduled_time
            if delta.num_cached_tokens:
                state.num_cached_tokens = delta.num_cached_tokens
            if delta.prompt_logprobs is not None:
                state.prompt_logprobs = delta.prompt_logprobs
            output = state.snapshot()
        except Exception as exc:  # noqa: BLE001 - this request's fault: end it, keep the engine
            logger.exception("request %s failed; ending it alone", delta.request_id)
            del self._requests[delta.request_id]
            self._send_quietly(ToCore("command", command=Abort(delta.request_id)))
            tracked.stream.put(RequestFailedError(f"request failed in the engine: {exc!r}"))
            return
        if self.output_listener is not None:
            self.output_listener(output)
        if output.finished:
            del self._requests[delta.request_id]
        tracked.stream.put(output)

    def _feed(self, request_id: str, state: RequestState, seq: SequenceDelta) -> None:
        """One sequence's new tokens and finish state into its output state (`_process`)."""
        local = state.sequences[seq.index]
        for k, token_id in enumerate(seq.token_ids):
            if local.finish_reason is not None:
                break  # stopped here by a stop string: later tokens from the core are dropped
            stop = state.add_token(seq.index, token_id, None if seq.logprobs is None else seq.logprobs[k])
            if stop is not None:  # NOTE: a stop string wins over a token-level stop in the same step
                state.finish(seq.index, RequestStatus.FINISHED_STOPPED, stop)
                self._send_quietly(ToCore("command", command=StopSequence(request_id, seq.index, stop)))
        if seq.finish_reason is not None and local.finish_reason is None:
            state.finish(seq.index, RequestStatus(seq.finish_reason), seq.stop_reason)

    def _fail_everyone(self, exc: BaseException) -> None:
        self._error = exc
        with self._lock:
            for tracked in self._requests.values():
                tracked.stream.put(EngineDeadError(f"engine failed: {exc}"))
            self._requests.clear()
        self._fail_pending(exc)

    def _fail_pending(self, exc: BaseException) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for loop, future in pending.values():
            loop.call_soon_threadsafe(set_exception, future, EngineDeadError(f"engine failed: {exc}"))


class CoreCallError(RuntimeError):
    """A call to a worker's KV side failed there: `kind` names the error (the KV side's own names),
    `detail` what it carries besides the message."""

    def __init__(self, kind: str, message: str, detail: list[str]) -> None:
        super().__init__(message)
        self.kind = kind
        self.detail = detail


def _raised(reply: CoreReply) -> BaseException:
    message = reply.error or ""
    if reply.error_kind == "value":
        return ValueError(message)
    if reply.error_kind in ("", "runtime"):
        return RuntimeError(message)
    return CoreCallError(reply.error_kind, message, reply.error_detail)


def _opens_stream(command: Command[Any]) -> tuple[str, list[int], SamplingParams] | None:
    """The request whose outputs a command may start streaming (`Command.stream_of`)."""
    if isinstance(command, AddRequest | AddPrefillOnly | ReserveRemote):
        return command.request_id, command.prompt_token_ids, command.params
    return None


def _first_message(sock: socket.socket, reader: FrameReader) -> FromCore | None:
    """The engine core's first message (ready, or why it could not start); None: it exited first."""
    while True:
        frames = recv_frames(sock, reader)
        if frames is None:
            return None
        if frames:
            return decode_from_core(frames[0])
