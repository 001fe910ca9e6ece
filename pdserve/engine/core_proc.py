"""The engine core process: `python -m pdserve.engine.core_proc FD`, started by its API process
(engine/core_client.py) with FD its end of a private socket pair; a prefill or decode worker's is
`python -m pdserve.disagg.worker.core FD`, the same loop with the worker's KV side beside the engine.

It builds the `LLMEngine` (and with --tensor-parallel-size its ranks, children of this process), then
runs a busy loop that never waits on the API process:

    reader thread: frames from the link -> engine commands to the loop's inbox; `kv` calls straight
                   to the KV side (its own thread: they never wait for a step)
    loop:  commands that arrived (waiting for one only while nothing is runnable) -> apply each
           step_deltas() (one forward) -> ONE `FromCore` with every request's new token ids, the failures,
           the commands' replies, and the stats when due (every STATS_EVERY_S, and on going idle)

Token ids only: the API process detokenizes and applies stop strings, and sends `StopSequence` back
on a hit. Outputs are deltas against what was sent before (`RequestState.delta`, a cursor per sequence);
a steady decode's delta, one token and nothing else, travels in a step-wide short form instead
(`StepTokens`: two flat lists, no object per request), which the API process reads as those deltas.

Lifecycle. SIGINT/SIGTERM are ignored (`pdserve up` signals the whole process group; the API
process decides when this one stops: `shutdown`, or EOF on the link when it is gone, then this
process exits at once). A step that raises is fatal: a last `FromCore` with `fatal`, exit 1.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from pdserve import envs
from pdserve.config import EngineArgs
from pdserve.engine.core_wire import (
    CoreReply,
    CoreWireError,
    FrameReader,
    FromCore,
    ToCore,
    decode_to_core,
    encode_from_core,
    link_buffers,
    recv_frames,
    reply_value,
)
from pdserve.engine.kv_event_publisher import endpoints_info
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.output import RequestDelta, RequestState, StepTokens
from pdserve.logs import configure_logging

logger = logging.getLogger(__name__)
STATS_EVERY_S = 0.05  # how stale /metrics' engine gauges may be while the engine is busy


def inject_model_step_failure(engine: LLMEngine) -> None:
    """Tests only, off unless PDSERVE_TEST_FAIL_MODEL_STEP is set: no request can make a real
    process's model step fail, so this makes it raise from the N-th step on."""
    fail_at = envs.test_fail_model_step()
    if fail_at is None:
        return
    logger.warning("%s=%d: the model step will fail (tests only)", envs.TEST_FAIL_MODEL_STEP, fail_at)
    execute, calls = engine.runner.execute, itertools.count(1)

    def failing(*args: Any) -> Any:
        if next(calls) >= fail_at:
            raise RuntimeError(f"injected model step failure ({envs.TEST_FAIL_MODEL_STEP})")
        return execute(*args)

    setattr(engine.runner, "execute", failing)  # noqa: B010 - mypy refuses assigning a method


class CoreSide(Protocol):
    """What a worker adds beside the engine in its engine process (disagg/worker/core.py): its KV
    transport's engine side. It answers `kv` calls on its own thread (`send` is thread-safe)."""

    def info(self) -> dict[str, Any]:
        """For the API process, with the first message."""

    def call(self, call_id: int, kv: list[Any]) -> None:
        """Run a `kv` call (reader thread: hand it to the side's own thread); reply with `call_id` > 0."""

    def stats(self) -> dict[str, int]: ...

    def close(self) -> None: ...


# (engine, the start message's `worker`, send): the side, its hooks set on the engine
SideFactory = Callable[[LLMEngine, dict[str, Any], Callable[[FromCore], None]], CoreSide]


class EngineCore:
    def __init__(self, engine: LLMEngine, sock: socket.socket, reader: FrameReader) -> None:
        engine.detokenize = False
        self.engine = engine
        self.sock = sock
        self.side: CoreSide | None = None
        self._stats_sent_s = 0.0
        self._send_lock = threading.Lock()  # the loop, and the KV side's thread
        self._inbox: queue.SimpleQueue[ToCore | None] = queue.SimpleQueue()  # None: the link ended
        self._frames = reader
        self._link_error: Exception | None = None  # what broke the link (a frame that did not decode)

    def send(self, message: FromCore) -> None:
        data = encode_from_core(message)
        with self._send_lock:
            self.sock.sendall(data)

    def run(self) -> None:
        """Until `shutdown` or EOF; raises what a step raised (fatal)."""
        threading.Thread(target=self._read, name="pdserve-engine-core-reader", daemon=True).start()
        engine = self.engine
        while True:
            runnable = engine.has_runnable_requests()
            # NOTE: blocking only while nothing is runnable; quarantined KV blocks bound the wait
            timeout = 0.0 if runnable else engine.release_quarantined_blocks()
            commands = self._receive(timeout)
            if commands is None:
                return
            replies: list[CoreReply] = []
            outputs: list[RequestDelta] = []
            alone = StepTokens()  # the step's one-token deltas, in their short form
            for command in commands:
                if command.kind == "shutdown":
                    return
                self._apply(command, replies, outputs)
            if engine.has_runnable_requests():
                outputs.extend(engine.step_deltas(alone))
            failures = [(f.request_id, f.error) for f in engine.take_failures()]
            now = time.monotonic()
            idle = not engine.has_runnable_requests()
            produced = bool(outputs or alone.request_ids or failures)
            stats_due = now - self._stats_sent_s >= STATS_EVERY_S or (idle and (commands or produced))
            if produced or replies or stats_due:
                stats = engine.stats() if stats_due else None
                if stats is not None:
                    self._stats_sent_s = now
                kv_stats = self.side.stats() if stats is not None and self.side is not None else None
                self.send(FromCore(outputs, failures, replies, stats, kv_stats=kv_stats, alone=alone))

    def _read(self) -> None:
        """The reader thread: engine commands to the inbox, `kv` calls to the KV side."""
        try:
            while (frames := recv_frames(self.sock, self._frames)) is not None:
                for frame in frames:
                    message = decode_to_core(frame)
                    if message.kind == "kv" and self.side is not None and message.kv is not None:
                        self.side.call(message.call_id, message.kv)
                    else:
                        self._inbox.put(message)
        except Exception as exc:  # noqa: BLE001 - e.g. a frame that does not decode: the link is unusable
            self._link_error = exc
        self._inbox.put(None)

    def _receive(self, timeout: float | None) -> list[ToCore] | None:
        """Every command that arrived, waiting up to `timeout` (None: forever) for the first; None
        when the link ended."""
        commands: list[ToCore] = []
        block = timeout is None or timeout > 0
        while True:
            try:
                message = self._inbox.get(block=block, timeout=timeout if block else None)
            except queue.Empty:
                return commands
            if message is None:
                if self._link_error is not None:
                    raise self._link_error  # fatal: the API process sent what does not decode
                return None
            commands.append(message)
            block = False

    def _apply(self, message: ToCore, replies: list[CoreReply], outputs: list[RequestDelta]) -> None:
        engine, command = self.engine, message.command
        try:
            if message.kind != "command" or command is None:
                raise CoreWireError(f"{message.kind!r} after start")
            result = command.apply(engine)
        except Exception as exc:  # noqa: BLE001 - the caller gets it, the engine carries on
            if message.call_id:
                kind = "value" if isinstance(exc, ValueError) else "runtime"
                replies.append(CoreReply(message.call_id, None, str(exc) or repr(exc), kind))
            else:
                logger.warning("engine core: %s failed: %r", type(command).__name__, exc)
            return
        if isinstance(result, RequestState):  # NOTE: what a command emitted (CompleteRemote's first token)
            outputs.append(result.delta())
        if message.call_id:
            replies.append(CoreReply(message.call_id, reply_value(result)))


def _start(sock: socket.socket, reader: FrameReader) -> ToCore:
    while True:
        frames = recv_frames(sock, reader)
        if frames is None:
            raise SystemExit(1)  # the API process is gone already
        if frames:
            start = decode_to_core(frames[0])
            if start.kind != "start" or start.engine_args is None:
                raise CoreWireError(f"expected start, got {start.kind!r}")
            return start


def serve_engine_core(fd: int, side_factory: SideFactory | None = None) -> int:
    """The engine process's life: build the engine (and a worker's KV side), run the loop."""
    # NOTE: the API process stops this one (shutdown, or EOF when it is gone): `pdserve up`'s signals
    # to the process group must not kill the engine under a draining server
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    sock = socket.socket(fileno=fd)
    link_buffers(sock)
    reader = FrameReader()
    start = _start(sock, reader)
    configure_logging(start.log_level, "json" if start.log_format == "json" else "text")
    core: EngineCore | None = None
    try:
        assert start.engine_args is not None
        engine = LLMEngine.from_engine_args(EngineArgs(**start.engine_args))
        inject_model_step_failure(engine)
        core = EngineCore(engine, sock, reader)
        if start.worker is not None:
            if side_factory is None:
                raise CoreWireError("a worker's KV side needs `python -m pdserve.disagg.worker.core`")
            core.side = side_factory(engine, start.worker, core.send)
    except Exception as exc:  # noqa: BLE001 - the API process reports it (a bad flag: exit 2)
        logger.debug("engine core failed to start", exc_info=True)
        sock.sendall(encode_from_core(FromCore(fatal=f"{exc}")))
        return 1
    # NOTE: as the API server does (ops/serve.run_server): what lives as long as the process (modules, the
    # model) leaves the collector's sight, so a full collection never stalls a step scanning it
    gc.collect()
    gc.freeze()
    envs.serving_switch_interval()
    core.send(FromCore(stats=engine.stats(), ready=True, info=_start_info(core)))
    try:
        core.run()
    except (BrokenPipeError, ConnectionResetError):
        os._exit(1)  # the API process is gone: nobody to tell, nothing to drain
    except BaseException as exc:  # noqa: BLE001 - the API process fails every request and exits non-zero
        logger.exception("engine core failed: the engine is dead")
        with contextlib.suppress(OSError):
            core.send(FromCore(fatal=f"{exc}"))
        _close(core)
        return 1
    _close(core)
    return 0


def _start_info(core: EngineCore) -> dict[str, Any] | None:
    """The first message's `info`: the KV side's, and where the engine publishes KV-cache events
    (`kv_events`: kv_event_publisher.py `endpoints_info`; the API process advertises it)."""
    info = {} if core.side is None else dict(core.side.info())
    events = endpoints_info(core.engine.kv_event_publisher)
    if events is not None:
        info["kv_events"] = events
    return info or None


def _close(core: EngineCore) -> None:
    if core.side is not None:
        core.side.close()
    core.engine.close()


def main(fd: int) -> int:
    return serve_engine_core(fd)


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
