"""Prefill role: take a job, compute the prompt in chunks, stream each layer's KV into the decode
worker's reservation as soon as it is computed, send the first token (and the seeded sampler's
state) with the final message, then release the blocks once decode acknowledged everything.

While it holds a job, the service tells the job's decode worker every `transfer_timeout_s / 2`
that the attempt is still being worked on (POST /pd/alive): a KV transfer's time without progress
counts compute gaps out, which on a CPU can exceed the timeout between two layers of a chunk. It
stops saying so if the engine thread has not finished a step for `_ENGINE_STUCK_S`.

Each job is one attempt (`job.transfer_id`): the id the engine, the streamer and the transport use
here, so a retried request never collides with its earlier attempt. `run` returns how the
hand-off ended (`HandOff`), which is what the router, or the queue consumer, acknowledges.

The streaming itself is the engine's layer observer (`KVStreamer`), called on the engine thread
right after each layer; the transport moves the bytes on its own I/O thread meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import Counter
from functools import partial
from typing import Any

import httpx

from pdserve.disagg.control import HandOff, PrefillJob
from pdserve.disagg.kv_layout import KVLayout
from pdserve.disagg.kv_streamer import KVStreamer
from pdserve.disagg.phases import PrefillPhases
from pdserve.disagg.transport import make_sender
from pdserve.disagg.transport.base import KVSender
from pdserve.disagg.transport.errors import KVTransferError
from pdserve.engine.async_llm import AsyncLLM, OutputStream
from pdserve.engine.commands import AddPrefillOnly, GeneratorState, ReleaseKV
from pdserve.logs import bind_request_id

logger = logging.getLogger(__name__)
_ENGINE_STUCK_S = 30.0


class PrefillService:
    def __init__(self, client: AsyncLLM, transport: str, layout: KVLayout, transfer_timeout_s: float,
                 sender_options: dict[str, Any] | None = None) -> None:
        self.client = client
        self.transport = transport
        self.sender_options = sender_options or {}
        self.layout = layout
        self.transfer_timeout_s = transfer_timeout_s
        self.counters: Counter[str] = Counter()
        self._senders: dict[str, KVSender] = {}  # one per decode worker address
        self._senders_lock = threading.Lock()
        self._destination: dict[str, KVSender] = {}  # request id -> its decode worker's sender (engine thread)
        self._tasks: dict[str, asyncio.Task[HandOff]] = {}
        self._tokens: dict[str, int] = {}  # transfer id -> prompt tokens still to compute
        self._decode_urls: dict[str, str] = {}  # transfer id -> the decode worker it streams to
        self._keepalive: asyncio.Task[None] | None = None
        self.draining = False
        self.consumer: Any = None  # the Redis queue consumer feeding this service, if any
        self.streamer = KVStreamer(layout.block_size, layout.num_layers, self._send_layer)
        # NOTE: set before any request exists; from now on only the engine thread calls it.
        client.engine.layer_observer = self.streamer

    def _send_layer(self, request_id: str, layer: int, src: list[int], dst: list[int]) -> None:
        self._destination[request_id].send_layer(request_id, layer, src, dst)

    def _sender(self, address: str) -> KVSender:
        """Connected sender for a decode worker (handshake on first use; KVLayoutMismatch on a
        layout disagreement). Blocking: call it off the event loop."""
        with self._senders_lock:
            sender = self._senders.get(address)
            if sender is None:
                sender = make_sender(self.transport, self.layout, self.client.engine.runner.kv_cache,
                                     **self.sender_options)
                try:
                    sender.connect(address)
                except BaseException:
                    sender.close()
                    raise
                self._senders[address] = sender
            return sender

    async def run(self, job: PrefillJob) -> HandOff:
        """Accept a job and wait until its hand-off ended. Raises ValueError (bad job) or
        KVLayoutMismatch/KVTransferError (decode worker unusable) before anything is computed."""
        task = await self.submit(job)
        return await asyncio.shield(task)

    async def submit(self, job: PrefillJob) -> asyncio.Task[HandOff]:
        """Accept a job: raises ValueError (bad job) or KVLayoutMismatch/KVTransferError (decode
        worker unusable) before anything is computed. The task ends with the hand-off."""
        bind_request_id(job.request_id)
        params = job.params.build()
        rid = job.transfer_id
        if rid in self._tasks:
            raise ValueError(f"attempt {rid!r} is already running here")
        sender = await asyncio.to_thread(self._sender, job.kv_address)
        stream: OutputStream = asyncio.Queue()
        await self.client.send(AddPrefillOnly(rid, job.prompt_token_ids, params,
                                              before=partial(self._attach, rid, sender, job),
                                              if_refused=partial(self._detach, rid)), stream)
        self._tokens[rid] = len(job.prompt_token_ids) - job.num_cached_tokens
        if job.decode_url:
            self._decode_urls[rid] = job.decode_url
        task = self._tasks[rid] = asyncio.create_task(self._finish(rid, sender, stream))
        if self._keepalive is None or self._keepalive.done():
            self._keepalive = asyncio.create_task(self._keep_alive())
        return task

    def _attach(self, rid: str, sender: KVSender, job: PrefillJob) -> None:
        """Engine thread: where the attempt's KV goes."""
        self._destination[rid] = sender
        self.streamer.expect(rid, job.block_ids, job.num_cached_tokens)

    def _detach(self, rid: str) -> None:
        """Engine thread."""
        self.streamer.forget(rid)
        self._destination.pop(rid, None)

    async def _keep_alive(self) -> None:
        """While jobs are in flight: POST /pd/alive {transfer ids} to their decode workers."""
        period_s = self.transfer_timeout_s / 2
        async with httpx.AsyncClient(timeout=httpx.Timeout(self.transfer_timeout_s)) as http:
            await self._send_keepalives(http, period_s)

    async def _send_keepalives(self, http: httpx.AsyncClient, period_s: float) -> None:
        while self._tasks:
            await asyncio.sleep(period_s)
            if time.monotonic() - self.client.last_step_s > _ENGINE_STUCK_S:
                continue  # a stuck engine must not keep decode waiting forever
            by_decode: dict[str, list[str]] = {}
            for tid, url in list(self._decode_urls.items()):
                by_decode.setdefault(url, []).append(tid)
            for url, tids in by_decode.items():
                with contextlib.suppress(httpx.HTTPError):
                    await http.post(f"{url}/pd/alive", json={"transfer_ids": tids})

    async def abort(self, transfer_id: str) -> None:
        task = self._tasks.get(transfer_id)
        if task is not None:
            task.cancel()

    @property
    def num_in_flight(self) -> int:
        return len(self._tasks)

    @property
    def num_in_flight_tokens(self) -> int:
        """Prompt tokens of the jobs taken and not yet handed off (what a queue consumer budgets)."""
        return sum(self._tokens.values())

    async def _finish(self, rid: str, sender: KVSender, stream: OutputStream) -> HandOff:
        """Wait for the first token, send the final message, wait for decode's acknowledgement,
        release the blocks. Whatever happens (abort, rejection, timeout), the blocks are released
        when it ends: the lease is the transfer timeout."""
        try:
            final = None
            async for output in self.client.consume(rid, stream):
                final = output
            if final is None or final.outputs[0].finish_reason == "abort" or not final.outputs[0].token_ids:
                return HandOff(transfer_id=rid, status="aborted")
            self._tokens.pop(rid, None)
            state = await self.client.send(GeneratorState(rid))
            phases = PrefillPhases.of(final.metrics)
            sender.send_done(rid, final.outputs[0].token_ids[0], state,
                             prefill_queue_s=None if phases is None else phases.queue_s,
                             prefill_compute_s=None if phases is None else phases.compute_s)
            await sender.flush(rid, self.transfer_timeout_s)
            self.counters["handed_off"] += 1
            return HandOff(transfer_id=rid, status="handed_off")
        except KVTransferError as exc:
            self.counters["failed"] += 1
            logger.warning("request %s: %s", rid, exc)
            return HandOff(transfer_id=rid, status="failed", reason=str(exc))
        except asyncio.CancelledError:
            self.counters["aborted"] += 1
            return HandOff(transfer_id=rid, status="aborted")
        finally:
            self._tasks.pop(rid, None)
            self._tokens.pop(rid, None)
            self._decode_urls.pop(rid, None)
            await asyncio.shield(self._release(rid, sender))

    async def _release(self, rid: str, sender: KVSender) -> None:
        """Free the attempt's blocks, but only once the transport no longer reads them: after a
        failed or abandoned hand-off, a send still queued must not read blocks that another
        request reuses (decode would get wrong KV and never know)."""
        try:
            await sender.release(rid)
        except KVTransferError as exc:  # a send stuck reading them: better to leak than to corrupt
            logger.error("request %s: not freeing its KV blocks: %s", rid, exc)
            return
        # NOTE: the request is stopped (if cut short mid-prefill) and its blocks freed before the
        # streamer forgets it, on the engine thread: no step streams a request it has forgotten.
        await self.client.send(ReleaseKV(rid, after=partial(self._detach, rid)))

    def close(self) -> None:
        if self._keepalive is not None:
            self._keepalive.cancel()
        with self._senders_lock:
            for sender in self._senders.values():
                sender.close()
            self._senders.clear()
