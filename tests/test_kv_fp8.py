"""The FP8 KV cache (`--kv-cache-dtype fp8`, model/kv_scales.py): sizes, scales from the checkpoint,
what the pool stores, how far its tokens drift from a float pool's, and every pool operation
(swap, disk tier) on FP8 bytes. The PD hand-off into and out of FP8 pools: test_kv_dtype.py.

What is exact. A prompt's single chunk attends to its own fresh K/V, never read back from the pool,
so the first token of a one-chunk prompt and its logprobs are the float pool's exactly. Every later
step reads K/V quantized to FP8 (3 mantissa bits for e4m3): its logits drift. The drift is
measured on the teacher-forced logprobs of a float engine's greedy continuation, and bounded."""

from __future__ import annotations

import dataclasses
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import assert_no_leak, generate_token_ids, greedy, random_prompt, token_prompts, with_scales
from safetensors.torch import save_file

from pdserve import LLM, SamplingParams
from pdserve.cli import build_parser
from pdserve.config import EngineArgs, create_engine_config, kv_dtype_description
from pdserve.engine.kv_disk_format import DiskLayout
from pdserve.engine.step_plan import StepPlan
from pdserve.model.facts import dtype_bytes, load_model_facts
from pdserve.model.kv_scales import KVScales, dequantize, quantize
from pdserve.sizing.plan import GIB, PlanInputs, make_plan

BUDGET = 32  # tokens a step: prompts longer than this prefill in chunks that read the pool back
PROMPTS = [random_prompt(n, seed=900 + n) for n in (5, 23, 40)]
NUM_OUTPUT = 110  # x 3 prompts: ~280 teacher-forced positions past the first chunk


# -- configuration ---------------------------------------------------------------------------------
def test_fp8_pools_hold_twice_the_blocks_of_bfloat16(model_dirs: dict[str, Path],
                                                      caplog: pytest.LogCaptureFixture) -> None:
    args = EngineArgs(model=str(model_dirs["tiny"]), dtype="bfloat16", kv_cache_memory="1MiB")
    half = create_engine_config(args)
    with caplog.at_level(logging.WARNING, logger="pdserve.model.kv_scales"):
        fp8 = create_engine_config(dataclasses.replace(args, kv_cache_dtype="fp8"))
    assert "no k_scale/v_scale; using scale 1.0" in caplog.text
    e5m2 = create_engine_config(dataclasses.replace(args, kv_cache_dtype="fp8_e5m2"))
    alias = create_engine_config(dataclasses.replace(args, kv_cache_dtype="fp8_e4m3"))
    assert fp8.kv_dtype == alias.kv_dtype == torch.float8_e4m3fn and e5m2.kv_dtype == torch.float8_e5m2
    assert fp8.kv_bytes_per_block * 2 == half.kv_bytes_per_block
    assert fp8.cache.num_kv_blocks == e5m2.cache.num_kv_blocks == 2 * half.cache.num_kv_blocks
    assert fp8.kv_scales == KVScales.ones(fp8.model.num_hidden_layers) and not fp8.kv_scales.from_checkpoint
    assert half.kv_scales is None


@pytest.mark.parametrize("value", ["fp8_e4m3fn", "int8", "float8", "FP8"])
def test_an_unknown_kv_cache_dtype_is_refused_naming_the_choices(model_dirs: dict[str, Path], value: str) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float32, bfloat16, float16, fp8, "
                                         "fp8_e4m3, fp8_e5m2, got"):
        create_engine_config(EngineArgs(model=str(model_dirs["tiny"]), kv_cache_dtype=value))


def test_plan_sizes_fp8_blocks_as_the_engine_does(model_dirs: dict[str, Path]) -> None:
    """`pdserve plan --kv-dtype fp8` and the engine agree on a block's bytes; the plan's flags name
    the pool type its block count is for."""
    facts = load_model_facts(str(model_dirs["tiny"]))
    plans = {}
    for kv in ("bfloat16", "fp8"):
        plans[kv] = make_plan(PlanInputs(1 * GIB, 1.0, facts, kv_dtype_bytes=dtype_bytes(kv), overhead_bytes=0.25 * GIB,
                                         mean_input_len=100, max_input_len=100, output_len=100, kv_cache_dtype=kv))
        engine = create_engine_config(EngineArgs(model=str(model_dirs["tiny"]), dtype="bfloat16", kv_cache_dtype=kv,
                                                 kv_cache_memory="1MiB"))
        assert plans[kv].kv_bytes_per_block == engine.kv_bytes_per_block
    # half the bytes a block from the same budget: twice the blocks, give or take the floor of each division
    assert plans["fp8"].num_kv_blocks - 2 * plans["bfloat16"].num_kv_blocks in (0, 1)  # type: ignore[operator]
    assert plans["fp8"].flags("decode")[-2:] == ["--kv-cache-dtype", "fp8"]


def test_the_start_up_line_names_the_pool_type_and_its_scales(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """What `pdserve serve` logs beside the KV block count (cli.py), and `up` takes fp8 per role."""
    args = EngineArgs(model=str(model_dirs["tiny"]), dtype="bfloat16", kv_cache_memory="1GiB")
    assert kv_dtype_description(create_engine_config(args)) == "bfloat16"
    fp8 = create_engine_config(dataclasses.replace(args, kv_cache_dtype="fp8"))
    assert kv_dtype_description(fp8) == "float8_e4m3fn (scales 1.0)"
    assert GIB // fp8.kv_bytes_per_block == fp8.cache.num_kv_blocks  # the "(M per GiB)" of a 1 GiB pool
    scaled = with_scales(model_dirs["tiny"], tmp_path / "scaled", [2.0, 2.0], [1.0, 1.0])
    assert kv_dtype_description(create_engine_config(dataclasses.replace(args, model=str(scaled),
                                                                         kv_cache_dtype="fp8_e5m2"))) == (
        "float8_e5m2 (scales from the checkpoint)")
    ns = build_parser().parse_args(["up", "--decode-kv-cache-dtype", "fp8", "--prefill-kv-cache-dtype", "bfloat16"])
    assert (ns.decode_kv_cache_dtype, ns.prefill_kv_cache_dtype) == ("fp8", "bfloat16")


# -- scales from the checkpoint ----------------------------------------------------------------------
def test_checkpoint_scales_are_used_and_the_pool_stores_values_over_them(model_dirs: dict[str, Path],
                                                                         tmp_path: Path) -> None:
    """The same prompt on a float32 pool and on an FP8 pool with the checkpoint's scales: the FP8
    pool's bytes are exactly the float pool's values divided by each layer's scale, cast (the one
    prompt chunk computes its K/V from fresh K/V in both, so the values are the same)."""
    num_layers = create_engine_config(EngineArgs(model=str(model_dirs["tiny"]))).model.num_hidden_layers
    k = [0.5 * (layer + 1) for layer in range(num_layers)]
    v = [0.25 / (layer + 1) for layer in range(num_layers)]
    scaled = with_scales(model_dirs["tiny"], tmp_path / "scaled", k, v)
    config = create_engine_config(EngineArgs(model=str(scaled), kv_cache_dtype="fp8"))
    assert config.kv_scales == KVScales(tuple(k), tuple(v)) and config.kv_scales.from_checkpoint
    plain = LLM(model=str(scaled), dtype="float32", num_kv_blocks=16)  # a float pool ignores the scales
    fp8 = LLM(model=str(scaled), dtype="float32", num_kv_blocks=16, kv_cache_dtype="fp8")
    prompt = token_prompts([PROMPTS[1]])
    [want], [have] = plain.generate(prompt, greedy(1)), fp8.generate(prompt, greedy(1))
    assert have.outputs[0].token_ids == want.outputs[0].token_ids
    pool, values = fp8.engine.runner.kv_cache, plain.engine.runner.kv_cache
    assert values.abs().max() > 0
    for layer in range(num_layers):
        for kv, scale in ((0, k[layer]), (1, v[layer])):
            expected = quantize(values[layer, kv], torch.float8_e4m3fn, scale)
            assert torch.equal(pool[layer, kv].view(torch.uint8), expected.view(torch.uint8)), (layer, kv)
    assert_no_leak(fp8)


@pytest.mark.parametrize(("k", "v", "name", "error"), [
    ([1.0, 1.0], [1.0], "self_attn.{}_scale", "layer 1 has no v_scale"),
    ([1.0, 0.0], [1.0, 1.0], "self_attn.{}_scale", "must be finite and > 0, got 0.0"),
    ([1.0, float("nan")], [1.0, 1.0], "self_attn.{}_scale", "must be finite and > 0, got nan"),
])
def test_bad_checkpoint_scales_are_refused_at_start(model_dirs: dict[str, Path], tmp_path: Path, k: list[float],
                                                    v: list[float], name: str, error: str) -> None:
    shutil.copytree(model_dirs["tiny"], tmp_path / "bad")
    tensors = {f"model.layers.{i}.{name.format('k')}": torch.tensor(s) for i, s in enumerate(k)}
    tensors |= {f"model.layers.{i}.{name.format('v')}": torch.tensor(s) for i, s in enumerate(v)}
    save_file(tensors, str(tmp_path / "bad" / "kv_scales.safetensors"))
    with pytest.raises(ValueError, match=error):
        create_engine_config(EngineArgs(model=str(tmp_path / "bad"), kv_cache_dtype="fp8"))


def test_vllm_older_kv_scale_name_and_per_projection_names_are_read(model_dirs: dict[str, Path],
                                                                    tmp_path: Path) -> None:
    one = with_scales(model_dirs["tiny"], tmp_path / "one", [2.0, 3.0], [2.0, 3.0], name="self_attn.kv_scale")
    # NOTE: one "kv_scale" a layer (no placeholder: the K and V keys are one), for both
    shared = create_engine_config(EngineArgs(model=str(one), kv_cache_dtype="fp8")).kv_scales
    assert shared == KVScales((2.0, 3.0), (2.0, 3.0))
    proj = with_scales(model_dirs["tiny"], tmp_path / "proj", [2.0, 3.0], [4.0, 5.0],
                       name="self_attn.{0}_proj.{0}_scale")
    assert create_engine_config(EngineArgs(model=str(proj), kv_cache_dtype="fp8")).kv_scales == KVScales(
        (2.0, 3.0), (4.0, 5.0))


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_fp8_code_reads_back_as_torch_casts_it_times_the_scale(fp8: torch.dtype, dtype: torch.dtype) -> None:
    """`dequantize` (e4m3 on CPU: by moving bits, not torch's slow cast) against torch's cast, all
    256 codes but NaN; `quantize` clamps to the format's finite range, never to inf or NaN."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8).reshape(16, 16)
    finite = codes.float().isfinite()
    for scale in (1.0, 0.5, 3.7):
        assert torch.equal(dequantize(codes, dtype, scale)[finite], codes.to(dtype).mul(scale)[finite])
    big = quantize(torch.tensor([1e6, -1e6, 3.0]), fp8, 0.5)
    assert big.float().tolist() == [torch.finfo(fp8).max, -torch.finfo(fp8).max, 6.0]


# -- agreement with a float pool ---------------------------------------------------------------------
def teacher_forced(llm: LLM, sequences: list[list[int]]) -> list[float]:
    """Each sequence's logprobs of its own next tokens, past the first chunk (those read the pool)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    return [lp.logprob for out in llm.generate(token_prompts(sequences), params)
            for lp in out.prompt_logprobs[BUDGET + 1:]]  # type: ignore[union-attr, index]


def test_fp8_kv_logprob_drift_against_a_float_pool_is_bounded(llm_factory: Callable[..., LLM]) -> None:
    """Measured on the tiny random model (docs/BENCHMARKS.md, FP8 KV cache): e4m3 drifts ~0.005 nats
    on average, ~0.04 at most; bfloat16 ten times less. Random weights give near-flat logits, so
    free-running greedy text parts from the float pool's after a few tokens (ties flip); the
    first token of a one-chunk prompt is exact."""
    args = {"max_num_batched_tokens": BUDGET}
    full = llm_factory("tiny", **args)
    continued = generate_token_ids(full, PROMPTS, greedy(NUM_OUTPUT))
    sequences = [p + out for p, out in zip(PROMPTS, continued, strict=True)]
    want = teacher_forced(full, sequences)
    drift = {}
    for kv in ("fp8", "bfloat16"):
        llm = llm_factory("tiny", kv_cache_dtype=kv, **args)
        have = teacher_forced(llm, sequences)
        gaps = [abs(a - b) for a, b in zip(want, have, strict=True)]
        drift[kv] = (sum(gaps) / len(gaps), max(gaps))
        assert [t[0] for t in generate_token_ids(llm, PROMPTS, greedy(1))] == [t[0] for t in continued]
        assert_no_leak(llm)
    assert len(want) >= 250
    mean, worst = drift["fp8"]
    assert 0 < mean < 0.015 and worst < 0.1, drift  # measured 0.0047 and 0.036
    assert drift["bfloat16"][0] < mean / 4, drift


# -- pool operations on FP8 bytes ----------------------------------------------------------------------
def test_swap_moves_fp8_blocks_intact(llm_factory: Callable[..., LLM]) -> None:
    """Blocks swapped out to host memory and back in elsewhere hold the same bytes; an engine that
    preempts by swapping serves its batch to the end with nothing left behind. (Its tokens are not
    compared to a roomier pool's: the schedule moves prompt chunk boundaries, and a chunk attends to
    its own fresh K/V but to its earlier chunks' quantized ones.)"""
    tight = llm_factory("tiny", kv_cache_dtype="fp8", max_num_batched_tokens=128, num_kv_blocks=30,
                        preemption_mode="swap", swap_space=0.01)
    runner = tight.engine.runner
    assert runner.swap_cache.dtype == runner.kv_cache.dtype == torch.float8_e4m3fn
    saved = runner.kv_cache.clone()
    runner.kv_cache.copy_(torch.randn(runner.kv_cache.shape))
    blocks = runner.kv_cache[:, :, [3, 5]].clone()
    runner.run(StepPlan(blocks_to_swap_out=[(3, 0), (5, 1)]))
    runner.run(StepPlan(blocks_to_swap_in=[(0, 10), (1, 11)]))
    assert torch.equal(runner.kv_cache[:, :, [10, 11]].view(torch.uint8), blocks.view(torch.uint8))
    runner.kv_cache.copy_(saved)
    prompts = [random_prompt(n, seed=40 + n) for n in (129, 300, 64, 200, 33)]
    before = tight.engine.stats().num_preemptions
    assert all(len(t) == 24 for t in generate_token_ids(tight, prompts, greedy(24)))
    assert tight.engine.stats().num_preemptions > before
    assert_no_leak(tight)


def test_the_disk_tier_keys_fp8_blocks_by_dtype_and_scales(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """An FP8 pool never reads a bfloat16 pool's files, nor those of an FP8 pool with other scales;
    its own files come back token-identical after a restart. A float pool's key is unchanged."""
    args = EngineArgs(model=str(model_dirs["tiny"]), dtype="bfloat16", num_kv_blocks=40)
    layouts = {kv: DiskLayout.of_engine(create_engine_config(dataclasses.replace(args, kv_cache_dtype=kv)))
               for kv in ("bfloat16", "fp8", "fp8_e5m2")}
    rescaled = dataclasses.replace(layouts["fp8"], k_scales=(2.0, 1.0))
    assert len({layout.key for layout in (*layouts.values(), rescaled)}) == 4
    assert "k_scales" not in layouts["bfloat16"].to_dict() and layouts["fp8"].to_dict()["k_scales"] == [1.0, 1.0]

    def tier_llm() -> LLM:
        llm = LLM(model=str(model_dirs["tiny"]), dtype="float32", block_size=4, num_kv_blocks=40,
                  kv_cache_dtype="fp8", kv_disk_dir=str(tmp_path), kv_disk_size="64MiB")
        assert llm.engine.offload is not None
        llm.engine.offload.tier.cost.compute_s_per_token = float("inf")  # every hit from disk
        return llm

    prompts = [random_prompt(61, seed) for seed in range(4)]
    first = tier_llm()
    generate_token_ids(first, prompts, greedy(4))
    assert first.engine.offload is not None
    first.engine.offload.tier.flush()
    cached = generate_token_ids(first, prompts, greedy(4))  # its prefixes, quantized, read back
    restarted = tier_llm()
    assert generate_token_ids(restarted, prompts, greedy(4)) == cached
    stats = restarted.engine.stats().kv_tier
    assert stats is not None and stats.disk.num_hit_blocks == 4 * 15
    assert_no_leak(restarted)


def test_the_benchmark_runs_and_reports_twice_the_blocks(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m pdserve.bench.kv_fp8`, tiny: one row per KV dtype, FP8 at twice bfloat16's blocks."""
    from pdserve.bench import kv_fp8

    monkeypatch.setattr("sys.argv", ["kv_fp8", "--preset", "tiny", "--num-seqs", "2", "--context", "40",
                                     "--steps", "1", "--drift-tokens", "8"])
    kv_fp8.main()
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "KV dtype" not in line}
    assert set(rows) == set(kv_fp8.KV_DTYPES)
    assert rows["fp8"][1] == rows["fp8_e5m2"][1] == "2.00x" and rows["float32"][1] == "0.50x"
    assert float(rows["float32"][4]) == 0.0 < float(rows["fp8"][4])  # drift against the float32 pool itself: none


@pytest.mark.slow
def test_tensor_parallel_ranks_share_an_fp8_pool_and_its_scales(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Two CPU ranks map one shared FP8 pool (each its own heads, the checkpoint's scales per
    layer): the tokens of one rank's engine."""
    scaled = with_scales(model_dirs["tiny"], tmp_path / "scaled", [0.5, 2.0], [0.25, 1.5])
    args = {"model": str(scaled), "dtype": "float32", "num_kv_blocks": 64, "kv_cache_dtype": "fp8",
            "max_num_batched_tokens": BUDGET}
    want = generate_token_ids(LLM(**args), PROMPTS, greedy(12))  # type: ignore[arg-type]
    ranked = LLM(tensor_parallel_size=2, num_threads=1, **args)  # type: ignore[arg-type]
    try:
        assert ranked.engine.runner.kv_cache.dtype == torch.float8_e4m3fn
        assert generate_token_ids(ranked, PROMPTS, greedy(12)) == want
        assert_no_leak(ranked)
    finally:
        ranked.engine.close()
