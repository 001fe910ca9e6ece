"""PD hand-off at the engine level: a prefill engine streams KV layer by layer (KVStreamer) into
blocks reserved on a decode engine, with a direct pool-to-pool copy standing in for the transport.
The decode engine's tokens must equal colocated ones, and neither engine may keep anything."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from helpers import assert_no_leak, greedy, random_prompt, until

from pdserve import LLM, SamplingParams
from pdserve.disagg.worker.kv_streamer import KVStreamer
from pdserve.engine.llm_engine import KVTransferSetup
from pdserve.engine.output import RequestOutput

PROMPTS = [random_prompt(n, seed=7000 + n) for n in (1, 15, 16, 17, 90, 300)]
MAX_TOKENS = 12
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1234, max_tokens=MAX_TOKENS, ignore_eos=True)


def pd_generate(prefill: LLM, decode: LLM, prompts: list[list[int]],
                params: SamplingParams) -> tuple[list[list[int]], list[int]]:
    """Returns the decode side's token ids per prompt and how many prompt tokens each reservation
    found already cached on the decode side."""
    p, d = prefill.engine, decode.engine
    layers = p.config.model.num_hidden_layers

    def send_layer(request_id: str, layer: int, src: list[int], dst: list[int], ready: object) -> None:
        d.runner.kv_cache[layer, :, dst] = p.runner.kv_cache[layer, :, src]

    streamer = KVStreamer(p.config.cache.block_size, layers, send_layer)
    p.configure_kv_transfer(KVTransferSetup(layer_observer=streamer))
    finals: dict[str, RequestOutput] = {}
    cached: list[int] = []
    try:
        for index, prompt in enumerate(prompts):
            reservation = d.reserve_remote(f"pd-{index}", prompt, params)
            assert reservation is not None
            cached.append(reservation.num_cached_tokens)
            streamer.expect(f"pd-{index}", reservation.block_ids, reservation.num_cached_tokens)
            p.add_request(f"pd-{index}", prompt, params, prefill_only=True)
        while p.has_unfinished_requests() or d.has_unfinished_requests():
            for out in p.step():
                assert out.finished and len(out.outputs[0].token_ids) == 1
                state = p.generator_state(out.request_id)
                output_state = d.complete_remote(out.request_id, out.outputs[0].token_ids[0], state)
                assert output_state is not None
                first = output_state.snapshot()
                p.release_kv(out.request_id)
                streamer.forget(out.request_id)
                if first.finished:
                    finals[first.request_id] = first
            finals |= {out.request_id: out for out in d.step() if out.finished}
    finally:
        p.configure_kv_transfer(KVTransferSetup())
    return [finals[f"pd-{i}"].outputs[0].token_ids for i in range(len(prompts))], cached


@pytest.mark.parametrize("params", [greedy(MAX_TOKENS), SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("chunked", [pytest.param(False, id="whole-prompt"),
                                     pytest.param(True, id="chunked-64", marks=pytest.mark.slow)])
def test_pd_matches_colocated(llm_factory: Callable[..., LLM], params: SamplingParams, chunked: bool) -> None:
    colocated = llm_factory("tiny")
    expected = [o.outputs[0].token_ids for o in colocated.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                                                    params)]
    prefill = llm_factory("tiny", max_num_batched_tokens=64 if chunked else 2048, enable_prefix_caching=False)
    decode = llm_factory("tiny", seed=1)
    got, _ = pd_generate(prefill, decode, PROMPTS, params)
    assert got == expected
    for llm in (colocated, prefill, decode):
        assert_no_leak(llm)


@pytest.mark.slow
def test_pd_prefix_hits_on_prefill_and_on_decode(llm_factory: Callable[..., LLM]) -> None:
    """The decode worker already holds the first 64 tokens (nothing of them is sent); the prefill
    worker holds the first 128 (it computes less, but must still send blocks 64..127)."""
    base = random_prompt(200, seed=99)
    prompts = [base[:150] + random_prompt(30, seed=100), base + random_prompt(5, seed=101)]
    colocated = llm_factory("untied")
    expected = [o.outputs[0].token_ids for o in colocated.generate([{"prompt_token_ids": p} for p in prompts],
                                                                    greedy(MAX_TOKENS))]
    prefill = llm_factory("untied", max_num_batched_tokens=48)
    decode = llm_factory("untied", seed=2)
    decode.generate([{"prompt_token_ids": base[:64]}], greedy(1))
    prefill.generate([{"prompt_token_ids": base[:128]}], greedy(1))
    hits_before = prefill.engine.stats().num_prefix_hit_tokens
    got, cached_on_decode = pd_generate(prefill, decode, prompts, greedy(MAX_TOKENS))
    assert got == expected
    assert cached_on_decode[0] >= 48 and all(c % 16 == 0 for c in cached_on_decode)
    assert prefill.engine.stats().num_prefix_hit_tokens > hits_before
    for llm in (colocated, prefill, decode):
        assert_no_leak(llm)


def test_abort_of_a_reserved_request_frees_its_blocks(llm_factory: Callable[..., LLM]) -> None:
    decode = llm_factory("tiny", seed=3)
    reservation = decode.engine.reserve_remote("r", PROMPTS[4], greedy(MAX_TOKENS))
    assert reservation is not None and len(reservation.block_ids) == -(-len(PROMPTS[4]) // 16)
    decode.engine.abort_request("r")
    assert_no_leak(decode)


def test_reservation_fails_cleanly_when_the_pool_is_full(llm_factory: Callable[..., LLM]) -> None:
    decode = llm_factory("tiny", num_kv_blocks=24, enable_prefix_caching=False)
    first = decode.engine.reserve_remote("a", PROMPTS[5], greedy(MAX_TOKENS))  # 19 blocks
    assert first is not None
    assert decode.engine.reserve_remote("b", PROMPTS[5], greedy(MAX_TOKENS)) is None
    assert "b" not in decode.engine.scheduler.requests
    decode.engine.abort_request("a")
    assert_no_leak(decode)


@pytest.mark.parametrize("params", [greedy(MAX_TOKENS), SEEDED], ids=["greedy", "seeded"])
def test_failed_hand_off_is_recomputed_on_decode(llm_factory: Callable[..., LLM], params: SamplingParams) -> None:
    """Failure policy "recompute": half the layers arrived, then the prefill side went silent. The
    decode engine computes the prompt itself; the answer is still the colocated one."""
    colocated = llm_factory("tiny")
    expected = colocated.generate([{"prompt_token_ids": PROMPTS[5]}], params)[0].outputs[0].token_ids
    prefill, decode = llm_factory("tiny", enable_prefix_caching=False), llm_factory("tiny", seed=4)
    p, d = prefill.engine, decode.engine
    reservation = d.reserve_remote("f", PROMPTS[5], params)
    assert reservation is not None

    def send_first_layer_only(request_id: str, layer: int, src: list[int], dst: list[int], ready: object) -> None:
        if layer == 0:
            d.runner.kv_cache[layer, :, dst] = p.runner.kv_cache[layer, :, src]

    streamer = KVStreamer(16, p.config.model.num_hidden_layers, send_first_layer_only)
    streamer.expect("f", reservation.block_ids, reservation.num_cached_tokens)
    p.configure_kv_transfer(KVTransferSetup(layer_observer=streamer))
    try:
        p.add_request("f", PROMPTS[5], params, prefill_only=True)
        while p.has_unfinished_requests():
            p.step()
    finally:
        p.configure_kv_transfer(KVTransferSetup())
    p.release_kv("f")  # the lease of a hand-off nobody acknowledged
    d.prefill_locally("f")
    final = None
    while d.has_unfinished_requests():
        final = next((o for o in d.step() if o.finished), final)
    assert final is not None and final.outputs[0].token_ids == expected
    for llm in (colocated, prefill, decode):
        assert_no_leak(llm)


def test_a_hand_off_the_engine_cannot_take_is_refused_unchanged(llm_factory: Callable[..., LLM]) -> None:
    """A final message with a first token outside the vocabulary, a generator state of the wrong
    size, or a prefill prefix hit outside the prompt, is refused before anything changes (it used
    to reach the sampler and kill the engine):
    the reservation still waits, and the recompute policy then answers with the colocated text."""
    colocated = llm_factory("tiny")
    expected = colocated.generate([{"prompt_token_ids": PROMPTS[3]}], SEEDED)[0].outputs[0].token_ids
    decode = llm_factory("tiny", seed=5)
    d = decode.engine
    assert d.reserve_remote("bad", PROMPTS[3], SEEDED) is not None
    vocab = d.config.model.vocab_size
    for token, state in ((vocab, None), (-1, None), (0, b"\x00" * 3)):
        with pytest.raises(ValueError):
            d.complete_remote("bad", token, state)
    for prefill_cached_tokens in (-1, len(PROMPTS[3]) + 1):  # prefill's prefix hit: within the prompt
        with pytest.raises(ValueError, match="prefill_cached_tokens"):
            d.complete_remote("bad", 0, None, prefill_cached_tokens)
    d.prefill_locally("bad")  # what the decode service does next under the recompute policy
    final = None
    while d.has_unfinished_requests():
        final = next((o for o in d.step() if o.finished), final)
    assert final is not None and final.outputs[0].token_ids == expected
    assert_no_leak(decode)


def test_an_idle_engine_loop_frees_quarantined_blocks_when_due(model_dirs: dict) -> None:
    """A decode engine over nixl keeps a cancelled reservation's blocks out of reuse for a while
    (`KVTransferSetup.remote_kv_quarantine_s`); its thread must give them back when that ends even
    if nothing else happens (it sleeps while idle)."""
    import asyncio
    import time

    from pdserve.config import EngineArgs
    from pdserve.engine.async_llm import AsyncLLM
    from pdserve.engine.commands import CachedPrefixTokens, ReserveRemote
    from pdserve.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(model=str(model_dirs["tiny"]), dtype="float32", num_kv_blocks=64))
    client = AsyncLLM(engine, KVTransferSetup(remote_kv_quarantine_s=0.5))
    aborted_at = 0.0
    try:
        async def reserve_then_abort() -> None:
            nonlocal aborted_at
            assert await client.send(ReserveRemote("r", random_prompt(100, seed=1), greedy(4)))
            aborted_at = time.monotonic()
            client.abort("r")
            await client.send(CachedPrefixTokens([1]))  # the abort was applied before this runs
            # NOTE: stats() is the snapshot the engine thread takes after its next step, not at the reply
            await until(lambda: client.stats().num_quarantined_kv_blocks > 0, "the stats after the abort")

        asyncio.run(reserve_then_abort())
        held = 64 - client.stats().num_free_kv_blocks
        assert held == client.stats().num_quarantined_kv_blocks == 7  # 100 prompt tokens, blocks of 16
        deadline = time.monotonic() + 5
        while client.stats().num_free_kv_blocks < 64 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.stats().num_free_kv_blocks == 64 and client.stats().num_quarantined_kv_blocks == 0
        assert time.monotonic() - aborted_at >= 0.45  # not before the quarantine ended
    finally:
        client.shutdown()


def test_engine_commands_reply_typed_and_route_outputs(model_dirs: dict) -> None:
    """Commands cross to the engine thread and their results come back; a refused one raises in
    its sender and the engine carries on; a reservation's stream gets the output that
    CompleteRemote produces, and nothing is left behind."""
    import asyncio

    from pdserve.config import EngineArgs
    from pdserve.engine.async_llm import AsyncLLM, OutputStream
    from pdserve.engine.commands import CachedPrefixTokens, CompleteRemote, ReserveRemote
    from pdserve.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(model=str(model_dirs["tiny"]), dtype="float32", num_kv_blocks=64))
    client = AsyncLLM(engine)
    prompt = random_prompt(40, seed=2)
    try:
        async def reserve_complete() -> None:
            stream: OutputStream = asyncio.Queue()
            reservation = await client.send(ReserveRemote("r", prompt, greedy(1)), stream)
            assert reservation is not None and len(reservation.block_ids) == 3
            with pytest.raises(ValueError, match="already in use"):
                await client.send(ReserveRemote("r", prompt, greedy(1)))
            assert await client.send(CompleteRemote("r", 7)) is None  # the output goes to the stream
            output = await stream.get()
            assert output.finished and output.outputs[0].token_ids == [7]  # prefill's token was the last
            assert await client.send(CachedPrefixTokens(prompt)) == 32  # its two full blocks stay cached

        asyncio.run(reserve_complete())
        assert client.alive and not engine.has_unfinished_requests()
        assert engine.scheduler.kv.pool.num_free_blocks == 64
    finally:
        client.shutdown()
