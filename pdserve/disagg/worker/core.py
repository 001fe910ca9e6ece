"""The engine process of a prefill or decode worker: `python -m pdserve.disagg.worker.core FD`,
started by the worker's API process (`start_worker`). It runs the engine core's loop
(engine/core_proc.py) with the worker's KV side beside the engine (`WorkerCoreSide`): the KV
receiver or the streamer and senders, which read and write the pool where it lives.

    reader thread ──kv calls──▶ KV loop (an asyncio loop on a thread of its own): connect, send_done,
                                flush, release (prefill); expect, cancel (decode) -> replies
    engine loop: ReserveRemote -> the receiver expects the transfer -> a forwarder on the KV loop
                 reports its events (progress coalesced: what arrived together goes as one)

Neither the engine loop nor the KV loop ever waits on the API process; a reply or an event is one
frame on the link, written under the core's send lock.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from pdserve.config import EngineArgs
from pdserve.disagg.config import WorkerConfig
from pdserve.disagg.kv_layout import KVLayout
from pdserve.disagg.transport.errors import KVTransferError, KVTransferTimeout
from pdserve.disagg.transport.messages import KVDone, KVProgress, KVRejected
from pdserve.disagg.worker.app import Worker, WorkerShape, assemble_worker
from pdserve.disagg.worker.kv_link import RemoteReceiver, RemoteSenders, encode_event, error_reply
from pdserve.disagg.worker.kv_side import KVSide, KVSideSpec, attach_kv_side
from pdserve.engine.core_client import EngineCoreClient
from pdserve.engine.core_proc import serve_engine_core
from pdserve.engine.core_wire import CoreReply, FromCore
from pdserve.engine.kv_event_publisher import endpoints_of
from pdserve.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)
_FOREVER_S = 3600.0  # a forwarder's wait: the transfer clocks run in the API process


def start_worker(args: EngineArgs, config: WorkerConfig, model_name: str) -> Worker:
    """A worker whose engine (and KV side) runs in an engine process of its own: the process is
    started and its engine built before this returns (ValueError: a bad flag; EngineStartError)."""
    spec = KVSideSpec.of(config, model_name)
    client = EngineCoreClient.start(args, worker=dataclasses.asdict(spec), module="pdserve.disagg.worker.core")
    try:
        layout = KVLayout.from_json(client.info["layout"])
        receiver = RemoteReceiver(client, layout, client.info["kv_address"]) if spec.role == "decode" else None
        senders = RemoteSenders(client) if spec.role == "prefill" else None
        events = endpoints_of(client.info.get("kv_events"))
        return assemble_worker(client, receiver, senders, WorkerShape(config, model_name, layout, spec.transport,
                                                                      events))
    except BaseException:
        client.shutdown()
        raise


class WorkerCoreSide:
    """The `CoreSide` of a worker (engine/core_proc.py): its KV side and the loop that runs its calls."""

    def __init__(self, engine: LLMEngine, worker: dict[str, Any], send: Callable[[FromCore], None]) -> None:
        # NOTE: decode: the engine's reservations expect through `expect`, which forwards each one's events
        self.kv: KVSide = attach_kv_side(engine, KVSideSpec(**worker), expectations=self)
        self._send = send
        self._loop = asyncio.new_event_loop()
        self._tasks: set[asyncio.Task[None]] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, name="pdserve-kv-side", daemon=True)
        self._thread.start()

    def info(self) -> dict[str, Any]:
        receiver = self.kv.receiver
        return {"layout": self.kv.layout.to_json(), "kv_address": "" if receiver is None else receiver.kv_address}

    def stats(self) -> dict[str, int]:
        receiver = self.kv.receiver
        return {} if receiver is None else {"num_dtype_conversions": receiver.num_dtype_conversions}

    def close(self) -> None:
        self.kv.close()
        self._loop.call_soon_threadsafe(self._loop.stop)

    # -- decode: `TransferExpectations` (engine thread, or a kv call) ---------------------------

    def expect(self, request_id: str, block_ids: list[int] | tuple[int, ...], token: str) -> None:
        receiver = self.kv.receiver
        assert receiver is not None
        receiver.expect(request_id, block_ids, token)
        self._loop.call_soon_threadsafe(self._start, self._forward(request_id))

    async def _forward(self, request_id: str) -> None:
        """The transfer's events to the API process until its last (or its cancel)."""
        receiver = self.kv.receiver
        assert receiver is not None
        while True:
            try:
                events = [await receiver.wait(request_id, _FOREVER_S)]
            except KVTransferTimeout:
                continue
            except KVTransferError:
                return  # cancelled (aborted, retargeted, ended by the API process)
            while not isinstance(events[-1], KVDone | KVRejected):  # NOTE: and what arrived with it
                try:
                    events.append(await receiver.wait(request_id, 0.0))
                except KVTransferError:  # nothing more now (a timeout), or cancelled: the next wait says
                    break
            self._send(FromCore(kv_events=[encode_event(e) for e in _coalesced(events)]))
            if isinstance(events[-1], KVDone | KVRejected):
                return

    # -- calls (the link's reader thread) -------------------------------------------------------

    def call(self, call_id: int, kv: list[Any]) -> None:
        self._loop.call_soon_threadsafe(self._start, self._run(call_id, kv))

    def _start(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = self._loop.create_task(coroutine)
        self._tasks.add(task)  # NOTE: the loop keeps only a weak reference to a task
        task.add_done_callback(self._tasks.discard)

    async def _run(self, call_id: int, kv: list[Any]) -> None:
        try:
            value = await self._dispatch(kv)
        except Exception as exc:  # noqa: BLE001 - the caller gets it by name
            if not call_id:
                logger.warning("KV side: %s failed: %r", kv[0] if kv else "?", exc)
                return
            kind, detail = error_reply(exc)
            self._send(FromCore(replies=[CoreReply(call_id, None, str(exc) or repr(exc), kind, detail)]))
            return
        if call_id:
            self._send(FromCore(replies=[CoreReply(call_id, value)]))

    async def _dispatch(self, kv: list[Any]) -> Any:
        method, *args = kv
        receiver, prefill = self.kv.receiver, self.kv.prefill
        if receiver is not None and method == "expect":
            rid, blocks, token = _typed(args, str, list, str)
            self.expect(rid, [int(b) for b in blocks], token)
        elif receiver is not None and method == "cancel":
            (rid,) = _typed(args, str)
            receiver.cancel(rid)
        elif method == "settled" and not args:
            return None  # NOTE: every call before it ran (KV loop, in order)
        elif prefill is not None and method == "connect":
            (address,) = _typed(args, str)
            return await prefill.connect(address)
        elif prefill is not None and method == "send_done":
            handle, rid, record, token = _typed(args, int, str, bytes, str)
            prefill.send_done(handle, rid, record, token=token)
        elif prefill is not None and method == "flush":
            handle, rid, timeout_s = _typed(args, int, str, (int, float))
            await prefill.flush(handle, rid, float(timeout_s))
        elif prefill is not None and method == "release":
            handle, rid = _typed(args, int, str)
            await prefill.release(handle, rid)
        else:
            raise ValueError(f"KV side: no call {method!r} with {len(args)} arguments here")
        return None


def _typed(args: list[Any], *kinds: type | tuple[type, ...]) -> list[Any]:
    """`args`, checked against `kinds` (a bool is no int here)."""
    if len(args) != len(kinds) or not all(isinstance(a, k) and not (isinstance(a, bool) and k is not str)
                                          for a, k in zip(args, kinds, strict=False)):
        raise ValueError(f"KV side: arguments {[type(a).__name__ for a in args]} where {kinds} were expected")
    return args


def _coalesced(events: list[Any]) -> list[Any]:
    """Progress events that arrived together as one (their blocks summed, the last layer)."""
    progress = [e for e in events if isinstance(e, KVProgress)]
    if len(progress) <= 1:
        return events
    merged = KVProgress(progress[-1].request_id, progress[-1].layer, tuple(b for e in progress for b in e.block_ids))
    return [merged, *(e for e in events if not isinstance(e, KVProgress))]


def main(fd: int) -> int:
    return serve_engine_core(fd, WorkerCoreSide)


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
