"""prompt_logprobs through PD, piece by piece (the whole path, PD against colocated over HTTP, is in
tests/test_openai_parity.py): the packed form the prefill worker's final KV message carries, a
final message holding a long prompt's over TCP, the decode engine taking them (or refusing, changing
nothing, what cannot be this prompt's), and a resumed request not asking for them again."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Callable

import pytest
from helpers import assert_no_leak, greedy, random_prompt
from kv_transport_helpers import PoolSpec, record

from pdserve import LLM
from pdserve.disagg.handoff import HandOffDone
from pdserve.disagg.prompt_logprobs_wire import pack, unpack
from pdserve.disagg.router.core import continuation
from pdserve.disagg.transport import KVDone, make_receiver, make_sender
from pdserve.disagg.transport.frames import MAX_HEADER_BYTES
from pdserve.engine.logprobs import PromptLogprobs
from pdserve.tokenizer import load_tokenizer

PROMPT = random_prompt(20, seed=31)


def entries(num_tokens: int, k: int) -> list[PromptLogprobs | None]:
    """Float32-exact values (what the sampler computes), as a prompt of `num_tokens` would have."""
    return [None] + [PromptLogprobs(p % 1000, -p / 8, p % 7 + 1, tuple((t, -(p + t) / 4) for t in range(k)))
                     for p in range(1, num_tokens)]


def test_packed_prompt_logprobs_round_trip_and_malformed_blobs_are_refused() -> None:
    for num_tokens, k in ((1, 0), (2, 0), (5, 3), (9, 20)):
        assert unpack(pack(entries(num_tokens, k))) == entries(num_tokens, k)
    blob = pack(entries(5, 3))
    for bad in (blob[:6], blob[:-1], blob + b"\x00", b"\x15" + blob[1:]):  # short, long, k = 21
        with pytest.raises(ValueError):
            unpack(bad)
    nan = pack([None, PromptLogprobs(1, math.nan, 1, ())])
    with pytest.raises(ValueError, match="NaN"):
        unpack(nan)


def test_a_final_message_with_a_long_prompts_logprobs_crosses_tcp() -> None:
    """Beyond the 1 MiB every other frame header is held to: the receiver sizes its limit by the
    longest prompt its pool can hold."""
    spec = PoolSpec(num_layers=1, num_blocks=400, block_size=16, num_kv_heads=1, head_dim=4)
    blob = pack(entries(6000, 20))
    assert len(blob) * 4 / 3 > MAX_HEADER_BYTES
    decode_pool, prefill_pool = spec.pool(1), spec.pool(2)
    receiver = make_receiver("tcp", spec.layout(decode_pool), decode_pool)
    sender = make_sender("tcp", spec.layout(prefill_pool), prefill_pool)
    try:
        sender.connect(receiver.address)
        receiver.expect("r", [3])
        sender.send_layer("r", 0, [5], [3])
        sender.send_done("r", record(7, prompt_logprobs=blob))

        async def finish() -> object:
            await sender.flush("r", 10.0)
            event = await receiver.wait("r", 10.0)
            while not isinstance(event, KVDone):
                event = await receiver.wait("r", 10.0)
            return event

        done = asyncio.run(finish())
        assert isinstance(done, KVDone) and HandOffDone.decode(done.record).prompt_logprobs == blob
    finally:
        sender.close()
        receiver.close()


def test_decode_takes_the_prompts_logprobs_or_refuses_them_unchanged(llm_factory: Callable[..., LLM]) -> None:
    params = greedy(3, prompt_logprobs=2)
    expected = llm_factory("tiny").generate([{"prompt_token_ids": PROMPT}], params)[0]
    assert expected.prompt_logprobs is not None
    decode = llm_factory("tiny", seed=5)
    d = decode.engine
    good = expected.prompt_logprobs
    wrong_token = [None, dataclasses.replace(good[1], token_id=PROMPT[1] + 1), *good[2:]]  # type: ignore[type-var]
    wrong_k = [None, dataclasses.replace(good[1], top=good[1].top[:1]), *good[2:]]  # type: ignore[union-attr]
    for name in ("a", "b"):
        assert d.reserve_remote(name, PROMPT, params) is not None
    for bad in (None, good[:-1], wrong_token, wrong_k):
        with pytest.raises(ValueError, match="prompt logprobs"):
            d.complete_remote("a", 0, None, 0, bad)
    d.prefill_locally("a")  # refused unchanged: the recompute policy still answers it whole
    first = d.complete_remote("b", expected.outputs[0].token_ids[0], None, 0, good)
    assert first is not None and first.snapshot().prompt_logprobs == good
    finals = {}
    while d.has_unfinished_requests():
        finals |= {o.request_id: o for o in d.step() if o.finished}
    assert finals["a"].prompt_logprobs == good and finals["b"].prompt_logprobs == good
    assert finals["a"].outputs[0].token_ids == expected.outputs[0].token_ids
    assert_no_leak(decode)


def test_a_resumed_request_does_not_ask_for_its_prompts_logprobs_again(model_dirs: dict) -> None:
    tokenizer = load_tokenizer(str(model_dirs["tiny"]))
    params = greedy(8, prompt_logprobs=2)
    assert continuation(tokenizer, params, [], "").prompt_logprobs == 2
    sent = tokenizer.encode("Hello")
    assert continuation(tokenizer, params, sent, "Hello").prompt_logprobs is None
