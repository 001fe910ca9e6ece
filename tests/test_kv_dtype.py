"""`--kv-cache-dtype`: the KV pool's element type apart from the model's, and the PD hand-off
between workers whose KV dtypes differ (decode converts on arrival instead of refusing).

What is exact, and why. bfloat16 -> float32 is lossless (every bfloat16 value is a float32), and a
model computing in bfloat16 casts what it reads from the pool to bfloat16 before any math. So a
decode worker with `--dtype bfloat16 --kv-cache-dtype float32` sees, at every step, exactly the
values a `--dtype bfloat16` (KV bfloat16) engine sees: the prompt's K/V arrive as bfloat16 values
and are stored exactly, its own new K/V are bfloat16 values (computed in bfloat16) stored exactly,
and both are read back as the same bfloat16 numbers. Hence prefill (bfloat16, KV bfloat16) ->
decode (bfloat16, KV float32) must give token for token the text of a colocated bfloat16 engine.
(A float32 model with a bfloat16 pool would not do: decode's own new tokens' K/V would be rounded
in the colocated run and not in the float32 pool, so the texts could differ by design.)"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch
from helpers import assert_no_leak, generate_token_ids, greedy, random_prompt, token_prompts, with_scales
from kv_transport_helpers import PoolSpec, record
from metrics_helpers import scrape
from pd_fixtures import start_cluster, stop_cluster
from server_fixtures import parse_sse

from pdserve import LLM, SamplingParams
from pdserve.config import EngineArgs, create_engine_config
from pdserve.disagg.kv_layout import KVLayout, KVLayoutMismatch
from pdserve.disagg.transport import (
    KVDone,
    KVProgress,
    KVReceiver,
    KVRejected,
    KVTransferError,
    make_receiver,
    make_sender,
    nixl_available,
)
from pdserve.disagg.transport.messages import DoneHeader, LayerHeader
from pdserve.disagg.transport.reservations import PayloadRejected, ReservationTable
from pdserve.disagg.wire import WireFormatError
from pdserve.disagg.worker.decode_service import DecodeService
from pdserve.model.kv_scales import KVScales, requantize

NIXL = pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(), reason="nixl_cu12 is not installed"))
SPEC = PoolSpec()
PROMPTS = [random_prompt(n, seed=700 + n) for n in (5, 23, 70)]  # the last one in chunks of 32
# the PD cluster's block size (16) and token budget: the bfloat16 reference serves both kinds of test
ENGINE_ARGS = {"max_num_batched_tokens": 32, "num_kv_blocks": 64}


# -- the engine ------------------------------------------------------------------------------------
def test_kv_cache_dtype_sets_the_pools_type_and_size(model_dirs: dict[str, Path]) -> None:
    args = EngineArgs(model=str(model_dirs["tiny"]), dtype="float32", kv_cache_memory="1MiB")
    same = create_engine_config(args)
    half = create_engine_config(dataclasses.replace(args, kv_cache_dtype="bfloat16"))
    assert same.kv_dtype == torch.float32 and half.kv_dtype == torch.bfloat16 and half.dtype == torch.float32
    assert half.kv_bytes_per_block * 2 == same.kv_bytes_per_block
    assert half.cache.num_kv_blocks == 2 * same.cache.num_kv_blocks  # the same bytes hold twice the blocks
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float32, bfloat16, float16"):
        create_engine_config(dataclasses.replace(args, kv_cache_dtype="int8"))


def test_a_float32_pool_under_bfloat16_compute_gives_the_bfloat16_tokens(llm_factory: Callable[..., LLM]) -> None:
    """See the module docstring: chunked prefill reading earlier chunks back, batched decodes."""
    plain = llm_factory("tiny", dtype="bfloat16", **ENGINE_ARGS)
    wide = llm_factory("tiny", dtype="bfloat16", kv_cache_dtype="float32", **ENGINE_ARGS)
    assert wide.engine.runner.kv_cache.dtype == torch.float32
    assert plain.engine.runner.kv_cache.dtype == torch.bfloat16
    assert generate_token_ids(wide, PROMPTS, greedy(8)) == generate_token_ids(plain, PROMPTS, greedy(8))
    assert_no_leak(wide)


def test_a_bfloat16_pool_under_float32_compute_rounds_only_what_is_read_back(
        llm_factory: Callable[..., LLM]) -> None:
    """A prompt's single chunk attends to its own fresh K/V: its first token and logprobs are the
    float32 engine's exactly; later tokens read rounded K/V back (the pool is bfloat16)."""
    full = llm_factory("tiny", **ENGINE_ARGS)
    rounded = llm_factory("tiny", kv_cache_dtype="bfloat16", **ENGINE_ARGS)
    assert rounded.engine.runner.kv_cache.dtype == torch.bfloat16
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3)
    for want, have in zip(full.generate(token_prompts(PROMPTS[:2]), params),
                          rounded.generate(token_prompts(PROMPTS[:2]), params), strict=True):
        first_want, first_have = (o.outputs[0].logprobs[0] for o in (want, have))  # type: ignore[index]
        assert first_have == first_want
        assert want.outputs[0].token_ids[0] == have.outputs[0].token_ids[0]
    assert_no_leak(rounded)


# -- the handshake and the receiver's validation ---------------------------------------------------
def layout(dtype: str = "float32", **changes: object) -> KVLayout:
    fields = {"model_id": "m", "dtype": dtype, "kv_cache_dtype": dtype, "block_size": 16, "num_layers": 2,
              "num_kv_heads": 2, "head_dim": 32}
    return KVLayout(**(fields | changes))  # type: ignore[arg-type]


def test_the_handshake_maps_float_kv_dtypes_and_refuses_the_rest_naming_the_field() -> None:
    for src, dst in (("bfloat16", "float32"), ("float32", "float16"), ("float16", "bfloat16")):
        layout(dst).check_compatible(layout(src), convert_dtype=True)
        assert layout(dst).converts_from(layout(src))
        with pytest.raises(KVLayoutMismatch) as plain:  # the pool's own checks never convert
            layout(dst).check_compatible(layout(src))
        assert plain.value.field == "dtype"
    refusals = [("dtype", layout("uint8", kv_cache_dtype="float8_e4m3fn", k_scales=(1.0, 1.0), v_scales=(1.0, 1.0))),
                ("head_dim", layout("bfloat16", head_dim=64)), ("block_size", layout("bfloat16", block_size=8)),
                ("model_id", layout("bfloat16", model_id="other"))]
    for field, peer in refusals:
        with pytest.raises(KVLayoutMismatch, match=f"KV layout mismatch on {field}") as e:
            layout().check_compatible(peer, convert_dtype=True)
        assert e.value.field == field


def test_fp8_layouts_carry_their_scales_and_any_two_convert() -> None:
    """FP8 against a float pool, against the other FP8 format, against other scales: converted at
    the hand-off (never by a pool's own checks). The same type and scales: the bytes as they are."""
    fp8 = layout("float8_e4m3fn", k_scales=(0.5, 2.0), v_scales=(1.0, 4.0))
    assert KVLayout.from_json(fp8.to_json()) == fp8 and fp8.layer_scales(1) == (2.0, 4.0)
    peers = [layout("bfloat16"), layout("float32"), dataclasses.replace(fp8, k_scales=(1.0, 2.0)),
             dataclasses.replace(fp8, dtype="float8_e5m2", kv_cache_dtype="float8_e5m2")]
    for peer in peers:
        for src, dst in ((fp8, peer), (peer, fp8)):
            src.check_handoff(dst)
            assert dst.converts_from(src)
            with pytest.raises(KVLayoutMismatch) as plain:
                dst.check_compatible(src)
            assert plain.value.field in ("dtype", "k_scales")
    assert not fp8.converts_from(fp8)
    assert fp8.stores_as("float8_e4m3fn", (2.0, 4.0), 1) and not fp8.stores_as("float8_e4m3fn", (2.0, 4.0), 0)
    assert layout("bfloat16").stores_as("bfloat16", (1.0, 1.0), 0) and not fp8.stores_as("bfloat16", (1.0, 1.0), 0)


@pytest.mark.parametrize(("changes", "error"), [
    ({"dtype": "float8_e4m3fn"}, "an FP8 KV layout needs 2 K and V scales .one per layer., got 0 and 0"),
    ({"dtype": "float8_e4m3fn", "k_scales": (1.0,), "v_scales": (1.0, 1.0)}, "needs 2 K and V scales"),
    ({"dtype": "float8_e4m3fn", "k_scales": (1.0, -2.0), "v_scales": (1.0, 1.0)}, "finite and > 0, got -2.0"),
    ({"dtype": "bfloat16", "k_scales": (1.0, 1.0), "v_scales": (1.0, 1.0)}, "FP8 pools only"),
])
def test_bad_fp8_layouts_are_refused_clearly(changes: dict[str, object], error: str) -> None:
    dtype = str(changes.pop("dtype"))
    with pytest.raises(ValueError, match=error):
        layout(dtype, kv_cache_dtype=dtype, **changes)
    good = layout("float8_e4m3fn", k_scales=(1.0, 2.0), v_scales=(1.0, 1.0)).to_json()
    for bad in (good.replace("2.0", "NaN"), good.replace("2.0", "-2.0"), good.replace("[1.0,2.0]", '["2"]')):
        with pytest.raises(WireFormatError):  # what a peer's handshake carries is checked the same way
            KVLayout.from_json(bad)


def test_the_receiver_checks_a_payloads_scales() -> None:
    """Only FP8 payloads are scaled; an FP8 payload with other scales than the pool's is converted."""
    fp8 = layout("float8_e4m3fn", k_scales=(0.5, 2.0), v_scales=(1.0, 4.0))
    table = ReservationTable(fp8, num_blocks=8)
    table.expect("r", [1, 2])

    def header(dtype: str, scales: tuple[float, float], layer: int = 0) -> LayerHeader:
        num_bytes = 2 * fp8.as_dtype(dtype).block_bytes_per_layer
        return LayerHeader("r", layer, (1, 2), num_bytes, dtype, fp8.payload_shape(2), "", 0, *scales)

    table.check_layer(header("float8_e4m3fn", (0.5, 1.0)))
    table.check_layer(header("float8_e4m3fn", (3.0, 3.0)))
    table.check_layer(header("bfloat16", (1.0, 1.0)))
    with pytest.raises(PayloadRejected, match=r"scales \[2.0, 1.0\] on a bfloat16 payload"):
        table.check_layer(header("bfloat16", (2.0, 1.0)))
    with table.admit_layer(header("float8_e4m3fn", (2.0, 4.0), layer=1)):
        pass  # its own scales: no conversion
    assert table.admit_done(DoneHeader("r", 1, record(7)), in_order=True) and table.num_converted == 0


def test_the_receiver_counts_a_converted_payloads_bytes_in_its_own_dtype() -> None:
    table = ReservationTable(layout(), num_blocks=8)
    table.expect("r", [1, 2])
    per_block = {"float32": layout().block_bytes_per_layer, "bfloat16": layout("bfloat16").block_bytes_per_layer}
    assert per_block["bfloat16"] * 2 == per_block["float32"]

    def header(dtype: str, num_bytes: int) -> LayerHeader:
        return LayerHeader("r", 0, (1, 2), num_bytes, dtype, layout().payload_shape(2))

    table.check_layer(header("bfloat16", 2 * per_block["bfloat16"]))
    with pytest.raises(PayloadRejected, match="byte count"):
        table.check_layer(header("bfloat16", 2 * per_block["float32"]))
    table.check_layer(header("float8_e4m3fn", 2 * per_block["bfloat16"] // 2))  # FP8: 1 byte an element
    with pytest.raises(PayloadRejected, match="byte count"):
        table.check_layer(header("float8_e4m3fn", 2 * per_block["bfloat16"]))
    with pytest.raises(PayloadRejected, match="dtype uint8"):
        table.check_layer(header("uint8", 2 * per_block["bfloat16"] // 2))


# -- the transports --------------------------------------------------------------------------------
async def drain(receiver: KVReceiver, request_id: str) -> list:
    events = []
    while not events or isinstance(events[-1], KVProgress):
        events.append(await receiver.wait(request_id, 10.0))
    return events


def hand_off(transport: str, src_dtype: str, dst_dtype: str, *, staging_payloads: int | None = None,
             src_scales: KVScales | None = None, dst_scales: KVScales | None = None) -> None:
    """Two interleaved requests, two chunks each, every layer: each destination block holds its
    source block cast to decode's dtype (FP8: its values requantized with decode's scales), every
    other block is untouched, nothing is left behind. `staging_payloads` (nixl): shrink the staging
    buffer to that many payloads, so claims wait. `*_scales`: FP8 pools' (default 1.0)."""
    src_spec, dst_spec = SPEC.with_(dtype=src_dtype), SPEC.with_(dtype=dst_dtype)
    src_pool, dst_pool = src_spec.pool(2), dst_spec.pool(1)
    before = dst_pool.clone()
    src_layout, dst_layout = src_spec.layout(src_pool, src_scales), dst_spec.layout(dst_pool, dst_scales)
    receiver = make_receiver(transport, dst_layout, dst_pool)
    sender = make_sender(transport, src_layout, src_pool)
    if staging_payloads is not None:
        receiver._staging.num_bytes = staging_payloads * 3 * src_spec.layout(src_pool).block_bytes_per_layer
    plans = {"a": ([1, 2, 3, 9, 10, 11], [20, 21, 4, 5, 6, 0]), "b": ([4, 5, 13, 7, 8, 6], [9, 8, 7, 12, 13, 14])}
    try:
        sender.connect(receiver.address)
        for rid, (_, dst) in plans.items():
            receiver.expect(rid, dst)
        for chunk in (slice(0, 3), slice(3, 6)):
            for layer in range(SPEC.num_layers):
                for rid, (src, dst) in plans.items():
                    sender.send_layer(rid, layer, src[chunk], dst[chunk])
        for rid in plans:
            sender.send_done(rid, record(7))

        async def finish() -> list[list]:
            await asyncio.gather(*(sender.flush(rid, 10.0) for rid in plans))
            return [await drain(receiver, rid) for rid in plans]

        assert all(isinstance(events[-1], KVDone) for events in asyncio.run(finish()))
        for layer in range(SPEC.num_layers):
            for src, dst in plans.values():
                want = requantize(src_pool[layer][:, src], src_layout.layer_scales(layer), dst_pool.dtype,
                                  dst_layout.layer_scales(layer))
                assert torch.equal(dst_pool[layer][:, dst].view(torch.uint8), want.view(torch.uint8)), (layer, dst)
        others = torch.ones(SPEC.num_blocks, dtype=torch.bool)
        others[[d for _, dst in plans.values() for d in dst]] = False
        assert torch.equal(dst_pool[:, :, others].view(torch.uint8), before[:, :, others].view(torch.uint8))
        assert receiver.num_dtype_conversions == (len(plans) if dst_layout.converts_from(src_layout) else 0)
        assert receiver.reserved_request_ids() == frozenset() and sender.pending_request_ids() == frozenset()
        assert getattr(receiver, "num_staging_bytes_in_use", 0) == 0
        assert getattr(receiver, "num_registrations", 0) == 0  # nixl: each staging range's registration revoked
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("transport", ["fake", "tcp", NIXL])
@pytest.mark.parametrize(("src", "dst"), [("bfloat16", "float32"), ("float32", "bfloat16"), ("float16", "bfloat16")])
def test_a_payload_in_another_float_dtype_is_converted_into_the_blocks(transport: str, src: str, dst: str) -> None:
    hand_off(transport, src, dst)


# per layer of SPEC's 3: scales other than 1.0, each layer its own
DECODE_SCALES = KVScales((0.5, 2.0, 0.125), (4.0, 0.25, 1.5))
PREFILL_SCALES = KVScales((0.25, 1.0, 2.0), (1.0, 0.5, 3.0))


@pytest.mark.parametrize("transport", ["fake", "tcp", NIXL])
@pytest.mark.parametrize(("src", "dst", "src_scales", "dst_scales"), [
    ("bfloat16", "float8_e4m3fn", None, DECODE_SCALES),  # a bfloat16 prefill worker into an FP8 decode pool
    ("float32", "float8_e5m2", None, DECODE_SCALES),
    ("float8_e4m3fn", "bfloat16", PREFILL_SCALES, None),  # and back
    ("float8_e4m3fn", "float8_e4m3fn", PREFILL_SCALES, DECODE_SCALES),  # rescaled, not refused
    ("float8_e5m2", "float8_e4m3fn", PREFILL_SCALES, DECODE_SCALES),
    ("float8_e4m3fn", "float8_e4m3fn", DECODE_SCALES, DECODE_SCALES),  # the same bytes: in place, no conversion
])
def test_fp8_payloads_are_converted_with_the_receivers_scales(transport: str, src: str, dst: str,
                                                             src_scales: KVScales | None,
                                                             dst_scales: KVScales | None) -> None:
    hand_off(transport, src, dst, src_scales=src_scales, dst_scales=dst_scales)


@pytest.mark.skipif(not nixl_available(), reason="nixl_cu12 is not installed")
def test_nixl_claims_wait_for_staging_room_and_all_land() -> None:
    """Room for one 3-block payload at a time: 12 claims in flight take turns."""
    hand_off("nixl", "bfloat16", "float32", staging_payloads=1)


# -- PD workers --------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("transport", ["tcp", NIXL])
def test_pd_bfloat16_prefill_to_float32_kv_decode_gives_the_bfloat16_colocated_text(
        model_dirs: dict[str, Path], llm_factory: Callable[..., LLM], transport: str) -> None:
    """See the module docstring. The colocated reference runs each prompt alone, as the router
    does here, with the cluster's block size and token budget (the 70-token prompt in chunks)."""
    reference = llm_factory("tiny", dtype="bfloat16", **ENGINE_ARGS)
    engine_options = {"prefill": {"dtype": "bfloat16"}, "decode": {"dtype": "bfloat16", "kv_cache_dtype": "float32"}}
    cluster = start_cluster(model_dirs["tiny"], transport, 1, 1, max_num_batched_tokens=32,
                            engine_options=engine_options)
    try:
        decode: DecodeService = cluster.service(DecodeService)
        assert decode.receiver.kv_cache.dtype == torch.float32
        with httpx.Client(base_url=cluster.router.url, timeout=60) as http:
            seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=10, ignore_eos=True)
            for prompt, params in ((PROMPTS[1], greedy(10)), (PROMPTS[2], seeded)):
                [want] = reference.generate(token_prompts([prompt]), params)
                body = {"prompt": prompt, "max_tokens": 10, "ignore_eos": True,
                        "temperature": params.temperature, "seed": params.seed}
                reply = http.post("/v1/completions", json=body)
                assert reply.status_code == 200, reply.text
                assert reply.json()["choices"][0]["text"] == want.outputs[0].text
                streamed = http.post("/v1/completions", json=body | {"stream": True})
                chunks = [e for e in parse_sse(streamed.text) if isinstance(e, dict)]
                assert "".join(c["choices"][0]["text"] for c in chunks) == want.outputs[0].text
        cluster.wait_until_idle()
        assert decode.stats().kv_dtype_conversions == decode.stats().completed == 4
        assert scrape(cluster.workers[0][0].url).value("pdserve:kv_dtype_conversions_total") == 4
        assert decode.receiver.reserved_request_ids() == frozenset()
        assert getattr(decode.receiver, "num_staging_bytes_in_use", 0) == 0
    finally:
        stop_cluster(cluster)


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["tcp", NIXL])
def test_pd_bfloat16_prefill_to_fp8_decode_gives_the_fp8_colocated_text(
        model_dirs: dict[str, Path], tmp_path: Path, transport: str) -> None:
    """Why identical: the prompt's one chunk attends to its fresh bfloat16 K/V on the prefill worker
    as in the colocated FP8 engine; decode quantizes the arriving bfloat16 values with its own
    scales (the checkpoint's) exactly as the colocated engine's writes do (in float32, model/
    kv_scales.py), and every later step reads the same FP8 bytes. (A prompt in several chunks would
    differ: a bfloat16 prefill pool's later chunks read unquantized K/V.)"""
    num_layers = create_engine_config(EngineArgs(model=str(model_dirs["tiny"]))).model.num_hidden_layers
    scaled = with_scales(model_dirs["tiny"], tmp_path / "scaled", [0.25 * (i + 1) for i in range(num_layers)],
                         [2.0 / (i + 1) for i in range(num_layers)])
    reference = LLM(model=str(scaled), dtype="bfloat16", kv_cache_dtype="fp8", **ENGINE_ARGS)
    engine_options = {"prefill": {"dtype": "bfloat16"}, "decode": {"dtype": "bfloat16", "kv_cache_dtype": "fp8"}}
    cluster = start_cluster(scaled, transport, 1, 1, max_num_batched_tokens=32, engine_options=engine_options)
    try:
        decode: DecodeService = cluster.service(DecodeService)
        assert decode.receiver.kv_cache.dtype == torch.float8_e4m3fn
        assert decode.receiver.layout.k_scales == tuple(0.25 * (i + 1) for i in range(num_layers))
        with httpx.Client(base_url=cluster.router.url, timeout=60) as http:
            seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True)
            for prompt, params in ((PROMPTS[0], greedy(24)), (PROMPTS[1], greedy(24)), (PROMPTS[1], seeded)):
                [want] = reference.generate(token_prompts([prompt]), params)
                body = {"prompt": prompt, "max_tokens": 24, "ignore_eos": True,
                        "temperature": params.temperature, "seed": params.seed}
                reply = http.post("/v1/completions", json=body)
                assert reply.status_code == 200, reply.text
                assert reply.json()["choices"][0]["text"] == want.outputs[0].text
        cluster.wait_until_idle()
        assert decode.stats().kv_dtype_conversions == decode.stats().completed == 3
        assert scrape(cluster.workers[0][0].url).value("pdserve:kv_dtype_conversions_total") == 3
        assert decode.receiver.reserved_request_ids() == frozenset()
        assert getattr(decode.receiver, "num_staging_bytes_in_use", 0) == 0
    finally:
        stop_cluster(cluster)
    assert_no_leak(reference)


@pytest.mark.skipif(not nixl_available(), reason="nixl_cu12 is not installed")
def test_nixl_refuses_a_dtype_its_handshake_never_declared() -> None:
    """A peer that shook hands as float32 (no staging registered) then claims bfloat16 payloads
    is rejected before any grant: its request ends, nothing is left behind."""
    pool, src = SPEC.pool(1), SPEC.pool(2)
    receiver = make_receiver("nixl", SPEC.layout(pool), pool)
    sender = make_sender("nixl", SPEC.layout(src), src)
    try:
        sender.connect(receiver.address)
        sender.layout = sender.layout.as_dtype("bfloat16")  # what its headers now announce
        receiver.expect("r", [3, 4])
        sender.send_layer("r", 0, [1, 2], [3, 4])
        with pytest.raises(KVTransferError, match="no handshake declared them"):
            asyncio.run(sender.flush("r", 10.0))
        assert isinstance(asyncio.run(drain(receiver, "r"))[-1], KVRejected)
        assert receiver.reserved_request_ids() == frozenset() and sender.pending_request_ids() == frozenset()
        assert torch.equal(pool, SPEC.pool(1))
    finally:
        sender.close()
        receiver.close()
