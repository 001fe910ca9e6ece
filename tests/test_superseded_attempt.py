"""A decode worker retargeted to a new prefill attempt must never act on the old attempt's events
(issue 16, found by the soak: 1-2 of ~320 answers unlike colocated).

What happened: attempt @0's final message arrived just as the router retargeted the request to @1.
The decode service cancelled @0's watcher, but `asyncio.wait_for` (Python < 3.12) hands a task the
result that arrived just before its cancel instead of raising CancelledError, so the watcher
completed the request with @0's KV. It decoded in its reserved blocks while the receiver still
expected @1, whose layers then overwrote them (the prompt's last block: the KV of the tokens already
generated), and @1's own KVDone completed the request a second time (a KeyError in the engine)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
from helpers import greedy, random_prompt

from pdserve import LLM
from pdserve.config import EngineArgs
from pdserve.disagg.control import OutputFrame, ReserveReply, ReserveRequest, WireSamplingParams
from pdserve.disagg.handoff import HandOffDone
from pdserve.disagg.kv_layout import KVLayout
from pdserve.disagg.transport.fake import FakeKVReceiver, FakeKVSender
from pdserve.disagg.transport.messages import KVDone, KVEvent
from pdserve.disagg.transport.progress import AckTracker, EventBox
from pdserve.disagg.worker.decode_service import DecodeService
from pdserve.engine.async_llm import AsyncLLM
from pdserve.engine.commands import CachedPrefixTokens
from pdserve.engine.llm_engine import KVTransferSetup, LLMEngine

# Loop iterations between the event's arrival and the cancel: on CPython 3.11 the old
# `wait_for` handed the event over for 1-3 of them; the sweep covers every ordering up to "done".
_INTERLEAVINGS = range(6)
_NUM_DECODE_BLOCKS = 64


async def _cancel_after(arrive: Callable[[], None], waiter: Coroutine[Any, Any, object], iterations: int) -> None:
    """Start `waiter`, make its result arrive, let the loop run `iterations` times, cancel it: a
    cancel that found it unfinished must end it cancelled, never with the result."""
    task = asyncio.ensure_future(waiter)
    await asyncio.sleep(0)
    arrive()
    for _ in range(iterations):
        await asyncio.sleep(0)
    if task.cancel():
        with pytest.raises(asyncio.CancelledError):
            await task
    else:
        await task


@pytest.mark.parametrize("iterations", _INTERLEAVINGS)
def test_a_cancel_as_the_awaited_event_arrives_always_cancels(iterations: int) -> None:
    async def scenario() -> None:
        box = EventBox()
        box.open("r")
        await _cancel_after(lambda: box.put(KVDone("r", HandOffDone(7).encode())), box.get("r", 10.0), iterations)
        acks = AckTracker()
        acks.sent_layer("r")
        await _cancel_after(lambda: acks.acked("r"), acks.flush("r", 10.0), iterations)

    asyncio.run(scenario())


class LateEventReceiver(FakeKVReceiver):
    """Hands a watcher the event it waited for even when its task was cancelled meanwhile (as the
    old `wait_for` did): a late event of a superseded attempt, which the service must ignore."""

    async def wait(self, request_id: str, timeout_s: float) -> KVEvent:
        inner = asyncio.ensure_future(super().wait(request_id, timeout_s))
        try:
            return await asyncio.shield(inner)
        except asyncio.CancelledError:
            return await inner


async def _tokens(frames: AsyncIterator[OutputFrame]) -> list[int]:
    token_ids: list[int] = []
    async for frame in frames:
        assert frame.error is None and not frame.kv_retry
        assert frame.num_tokens_before == len(token_ids)  # delta frames
        token_ids = token_ids + frame.token_ids
    return token_ids


async def _hand_off(sender: FakeKVSender, tid: str, src: list[int], reply: ReserveReply, first_token: int) -> None:
    """Every layer of the prompt's blocks, then, once decode's watcher took those events and waits
    again, the final message: what a prefill attempt sends (its last layer leaves the final message
    behind on the wire)."""
    for layer in range(sender.layout.num_layers):
        sender.send_layer(tid, layer, src, reply.block_ids, token=reply.token)
    for _ in range(10):
        await asyncio.sleep(0)
    sender.send_done(tid, HandOffDone(first_token).encode(), token=reply.token)


def _prefill(prefill: LLM, tid: str, prompt: list[int]) -> tuple[int, list[int]]:
    """The first token and the held blocks of a prefill-only request."""
    engine = prefill.engine
    engine.add_request(tid, prompt, greedy(1), prefill_only=True)
    first = None
    while engine.has_unfinished_requests():
        first = next((out.outputs[0].token_ids[0] for out in engine.step() if out.finished), first)
    assert first is not None
    return first, engine.held_block_ids(tid)


@pytest.mark.parametrize("receiver_kind", [FakeKVReceiver, LateEventReceiver], ids=["receiver", "late-event"])
def test_a_retarget_as_the_old_attempt_completes_never_completes_it_twice(
        model_dirs: dict[str, Path], llm_factory: Callable[..., LLM], receiver_kind: type[FakeKVReceiver]) -> None:
    """For each interleaving: @0's KV and final message arrive, the loop runs a few times, the router
    retargets to @1. Either the retarget comes too late (the request already completed with @0) or
    @0 is ignored and the request completes once, with @1. The answer is the colocated one either
    way, and nothing is left on either side."""
    colocated, prefill = llm_factory("tiny"), llm_factory("tiny", enable_prefix_caching=False)
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(model_dirs["tiny"]), dtype="float32",
                                                   num_kv_blocks=_NUM_DECODE_BLOCKS))
    receiver = receiver_kind(KVLayout.from_pool("tiny", engine.runner.kv_cache), engine.runner.kv_cache)
    sender = FakeKVSender(KVLayout.from_pool("tiny", prefill.engine.runner.kv_cache), prefill.engine.runner.kv_cache)
    sender.connect(receiver.address)
    client = AsyncLLM(engine, KVTransferSetup(expectations=receiver))  # NOTE: as build_worker sets it up
    service = DecodeService(client, receiver, "fail", transfer_timeout_s=30.0)
    params = greedy(8)

    async def one_request(index: int, iterations: int) -> None:
        rid, prompt = f"r{index}", random_prompt(40 + index, seed=1600 + index)  # a partial last block
        expected = colocated.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids
        reply = await service.reserve(ReserveRequest(request_id=rid, transfer_id=f"{rid}@0", prompt_token_ids=prompt,
                                                     params=WireSamplingParams.of(params)))
        assert reply is not None and reply.num_cached_tokens == 0
        answer = asyncio.ensure_future(_tokens(service.stream(rid)))
        first, src = _prefill(prefill, f"{rid}@0", prompt)
        await _hand_off(sender, f"{rid}@0", src, reply, first)
        for _ in range(iterations):
            await asyncio.sleep(0)
        attempts = [f"{rid}@0"]
        if await service.retarget(rid, f"{rid}@1"):
            await _hand_off(sender, f"{rid}@1", src, reply, first)
            attempts.append(f"{rid}@1")
        for tid in attempts:
            await sender.flush(tid, 5.0)
        prefill.engine.release_kv(f"{rid}@0")
        assert await answer == expected
        for _ in range(10):  # a stale watcher would complete it again within a few iterations
            await asyncio.sleep(0)
        assert service.stats().completed == index + 1, f"{attempts}: completed twice"

    async def scenario() -> None:
        for index, iterations in enumerate(_INTERLEAVINGS):
            await one_request(index, iterations)
        await client.send(CachedPrefixTokens([1]))  # every command before it was applied

    try:
        asyncio.run(scenario())
        assert service.num_in_flight == 0 and not receiver.reserved_request_ids()
        assert not sender.pending_request_ids() and not engine.has_unfinished_requests()
        assert engine.scheduler.kv.pool.num_free_blocks == _NUM_DECODE_BLOCKS
        assert prefill.engine.scheduler.kv.pool.num_free_blocks == prefill.engine.scheduler.kv.pool.num_blocks
    finally:
        client.shutdown()
        service.close()
