"""The rest of the Qwen3 family against transformers (float32): mixture of experts (Qwen3-MoE), the
scaled rope types (YaRN past original_max_position_embeddings, linear, dynamic) and block-FP8
checkpoints (equal to transformers on the dequantized weights); what is not supported is refused
by name. Offline (LLM), through `pdserve serve`, with tensor parallelism and through PD (tcp, nixl).

Models (random weights, real tokenizer):
    moe       make-model's tiny-moe, the official spelling (num_experts, rope_scaling, torch_dtype):
              5 experts, top-2 normalised, layer 1 dense among sparse ones (mlp_only_layers), GQA 4/2
    moe-hf    written by transformers' Qwen3MoeForCausalLM.save_pretrained (num_local_experts,
              rope_parameters, dtype): 7 experts, top-2 not normalised, decoder_sparse_step 2
    yarn      tiny dense, YaRN factor 4 over an original window of 64 positions
    dynamic   tiny dense, dynamic NTK factor 2 over max_position_embeddings 64
    fp8       `moe` in block FP8 (24 x 24 blocks: partial edge blocks), its reference `fp8-ref` the
              dequantized weights in float
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from conftest import HFReference
from helpers import assert_no_leak, greedy, random_prompt, token_prompts
from pd_fixtures import start_cluster, stop_cluster
from safetensors.torch import load_file, save_file
from server_fixtures import start_server

from pdserve import LLM
from pdserve.cli import main as pdserve_main
from pdserve.disagg.transport import nixl_available
from pdserve.model.demo_checkpoint import PRESETS, QWEN3_SHAPES, ModelVariant, quantize_checkpoint, write_checkpoint
from pdserve.model.fp8 import FP8BlockQuantization, dequantize, quantize
from pdserve.model.loader import load_model
from pdserve.model.moe import GroupedExperts
from pdserve.model.qwen3_config import Qwen3ModelConfig
from pdserve.model.rope import RopeConfig
from pdserve.tokenizer import write_qwen3_tokenizer_files

MAX_TOKENS = 12
# 100 + 12 positions: past the yarn model's original 64; one prompt crosses the 32-token chunks
PROMPTS = [random_prompt(n, seed=7000 + n) for n in (1, 17, 100)]
SHORT_PROMPTS = [random_prompt(n, seed=7100 + n) for n in (1, 17, 60)]  # dynamic: generation crosses 64
PROMPTS_OF = {"dynamic": SHORT_PROMPTS}
ENGINE = {"dtype": "float32", "num_kv_blocks": 64, "max_num_batched_tokens": 32}
FP8_BLOCK = (24, 24)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
_NO_NIXL = pytest.mark.skipif(not nixl_available(), reason="nixl_cu12 is not installed")


def _save_transformers_moe(out: Path) -> Path:
    """A Qwen3-MoE as transformers writes it, its random weights re-drawn large enough that routing
    and greedy choices are not near-ties (transformers' own init is std 0.02)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=151936, hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                            num_experts=7, num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=2,
                            tie_word_embeddings=True, max_position_embeddings=1024)
    model = Qwen3MoeForCausalLM(config)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1.0 + 0.1 * noise if "norm" in name else noise * param.shape[-1] ** -0.5)
    model.save_pretrained(out)
    write_qwen3_tokenizer_files(out)
    return out


def _dequantized_copy(fp8_dir: Path, out: Path) -> Path:
    """The float checkpoint transformers reads as the reference for `fp8_dir`: every FP8 weight times
    its block's scale (computed here with kron, independently of pdserve.model.fp8)."""
    out.mkdir()
    tensors = load_file(str(fp8_dir / "model.safetensors"))
    bn, bk = FP8_BLOCK
    floats = {}
    for name, tensor in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        if tensor.dtype == torch.float8_e4m3fn:
            scale = tensors[name + "_scale_inv"]
            rows, cols = tensor.shape
            tensor = tensor.float() * torch.kron(scale, torch.ones(bn, bk))[:rows, :cols]
        floats[name] = tensor.float()
    save_file(floats, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((fp8_dir / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    write_qwen3_tokenizer_files(out)
    return out


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen3-family")
    tiny = PRESETS["tiny"]
    dirs = {
        "moe": write_checkpoint(root / "moe", PRESETS["tiny-moe"], seed=3),
        "moe-hf": _save_transformers_moe(root / "moe-hf"),
        "yarn": write_checkpoint(root / "yarn", dataclasses.replace(tiny, max_position_embeddings=256), seed=4,
                                 variant=ModelVariant(rope_scaling=YARN)),
        "dynamic": write_checkpoint(root / "dynamic", dataclasses.replace(tiny, max_position_embeddings=64), seed=5,
                                    variant=ModelVariant(rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
    }
    dirs["fp8"] = quantize_checkpoint(dirs["moe"], root / "fp8", FP8_BLOCK)
    dirs["fp8-ref"] = _dequantized_copy(dirs["fp8"], root / "fp8-ref")
    return dirs


@pytest.fixture(scope="module")
def reference(family_dirs: dict[str, Path]) -> HFReference:
    return HFReference(family_dirs)


@pytest.fixture(scope="module")
def llms(family_dirs: dict[str, Path]) -> Iterator[dict[str, LLM]]:
    cache: dict[str, LLM] = {}
    yield cache
    cache.clear()


def _llm(llms: dict[str, LLM], family_dirs: dict[str, Path], name: str) -> LLM:
    if name not in llms:
        llms[name] = LLM(model=str(family_dirs[name]), **ENGINE)
    return llms[name]


def _texts(llms: dict[str, LLM], family_dirs: dict[str, Path], name: str, prompts: list[list[int]],
           reference: HFReference, reference_name: str) -> list[str]:
    """What a served answer must say: the offline engine's text, its tokens checked against transformers."""
    outputs = _llm(llms, family_dirs, name).generate(token_prompts(prompts), greedy(MAX_TOKENS))
    assert [o.outputs[0].token_ids for o in outputs] == _expected(reference, reference_name, prompts)
    return [o.outputs[0].text for o in outputs]


def _expected(reference: HFReference, name: str, prompts: list[list[int]]) -> list[list[int]]:
    return [reference.greedy(name, prompt, MAX_TOKENS) for prompt in prompts]


@pytest.mark.parametrize(("name", "reference_name"), [("moe", "moe"), ("moe-hf", "moe-hf"), ("yarn", "yarn"),
                                                      ("dynamic", "dynamic"), ("fp8", "fp8-ref")])
def test_greedy_tokens_and_logprobs_match_transformers(family_dirs: dict[str, Path], reference: HFReference,
                                                       llms: dict[str, LLM], name: str, reference_name: str) -> None:
    llm = _llm(llms, family_dirs, name)
    prompts = PROMPTS_OF.get(name, PROMPTS)
    outputs = llm.generate(token_prompts(prompts), greedy(MAX_TOKENS, logprobs=1))
    for prompt, output, want in zip(prompts, outputs, _expected(reference, reference_name, prompts), strict=True):
        assert output.outputs[0].token_ids == want, f"prompt of {len(prompt)} tokens"
        if name == "dynamic":
            continue  # NOTE: one forward over prompt + output rotates every token for its whole length (rope.py)
        hf_logprobs = reference.logprobs(reference_name, prompt + want)
        for step, (token, logprobs) in enumerate(zip(want, output.outputs[0].logprobs or [], strict=True)):
            assert logprobs is not None
            assert abs(logprobs.logprob - hf_logprobs[len(prompt) - 1 + step, token].item()) < 1e-3
    assert_no_leak(llm)


def test_yarn_prompts_reach_past_the_original_window(family_dirs: dict[str, Path]) -> None:
    cfg = Qwen3ModelConfig.from_dir(family_dirs["yarn"])
    assert max(len(p) for p in PROMPTS) + MAX_TOKENS > YARN["original_max_position_embeddings"]
    assert cfg.rope.rope_type == "yarn" and cfg.max_context_len == 256
    dyn = Qwen3ModelConfig.from_dir(family_dirs["dynamic"])
    assert max(len(p) for p in SHORT_PROMPTS) + MAX_TOKENS > dyn.max_position_embeddings


@pytest.mark.parametrize("scaling", [
    None, YARN, YARN | {"mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2},
    YARN | {"attention_factor": 0.9, "truncate": False}, {"rope_type": "linear", "factor": 2.0},
    {"type": "dynamic", "factor": 3.0}])
def test_rope_tables_equal_transformers_past_the_original_window(scaling: dict | None) -> None:
    """Row p against transformers' rotary embedding called for a sequence of p + 1 tokens (how it
    rotates a generated token), to 4x the original window: bit for bit."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    raw = {"hidden_size": 64, "num_attention_heads": 4, "head_dim": 32, "max_position_embeddings": 64,
           "rope_theta": 10000.0, "rope_scaling": None if scaling is None else dict(scaling)}
    rope = RopeConfig.from_config(raw)
    cos, sin = rope.tables(32, 256, 64)
    hf = Qwen3RotaryEmbedding(Qwen3Config(**raw))
    x = torch.zeros(1, 1, 32)
    for position in range(256):
        want_cos, want_sin = hf(x, torch.tensor([[position]]))
        assert torch.equal(cos[position], want_cos[0, 0]) and torch.equal(sin[position], want_sin[0, 0]), position
    if scaling is not None and "attention_factor" not in scaling:
        assert not torch.equal(cos, RopeConfig.from_config({"rope_theta": 10000.0}).tables(32, 256, 64)[0])


def test_config_spellings_read_alike() -> None:
    official = {"model_type": "qwen3_moe", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96,
                "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                "moe_intermediate_size": 48, "num_experts": 7, "num_experts_per_tok": 2, "norm_topk_prob": True,
                "decoder_sparse_step": 2, "mlp_only_layers": [3], "torch_dtype": "float16",
                "rope_theta": 5000.0, "rope_scaling": {"type": "yarn", "factor": 2.0,
                                                       "original_max_position_embeddings": 512}}
    transformers_5 = {k: v for k, v in official.items() if k not in ("num_experts", "torch_dtype", "rope_theta",
                                                                     "rope_scaling")}
    transformers_5 |= {"num_local_experts": 7, "dtype": "float16",
                       "rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 5000.0,
                                           "original_max_position_embeddings": 512}}
    a, b = Qwen3ModelConfig.from_dict(official), Qwen3ModelConfig.from_dict(transformers_5)
    assert a == b
    assert a.moe is not None and a.torch_dtype == torch.float16 and a.rope.theta == 5000.0
    assert [a.is_sparse(n) for n in range(4)] == [False, True, False, False]  # step 2; layer 3 listed dense


@pytest.mark.parametrize(("change", "named"), [
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "longrope"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "llama3"),
    ({"model_type": "qwen2_moe"}, "qwen2_moe"),
    ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "awq"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "gptq"),
    ({"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}}, "bitsandbytes"),
    ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"}}, "weight_block_size"),
])
def test_unsupported_configs_are_refused_at_start_with_their_name(tmp_path: Path, family_dirs: dict[str, Path],
                                                                  capsys: pytest.CaptureFixture[str],
                                                                  change: dict, named: str) -> None:
    model = tmp_path / "model"
    model.mkdir()
    for path in family_dirs["yarn"].iterdir():
        (model / path.name).write_bytes(path.read_bytes())
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | change))
    with pytest.raises(ValueError, match=named):
        Qwen3ModelConfig.from_dir(model)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:  # NOTE: the CLI installs its own root handler on (captured) stderr
        assert pdserve_main(["serve", "--model", str(model), "--port", "0"]) == 2
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    assert named in capsys.readouterr().err


def test_fp8_checkpoint_holds_fp8_weights_and_a_quantized_weight_without_its_scale_is_refused(
        family_dirs: dict[str, Path], tmp_path: Path) -> None:
    tensors = load_file(str(family_dirs["fp8"] / "model.safetensors"))
    fp8 = [n for n, t in tensors.items() if t.dtype == torch.float8_e4m3fn]
    assert "model.layers.0.mlp.experts.4.down_proj.weight" in fp8 and "model.layers.0.mlp.gate.weight" not in fp8
    assert all(n + "_scale_inv" in tensors for n in fp8) and tensors[fp8[0] + "_scale_inv"].dtype == torch.float32
    # the scales matter: dropping quantization_config (weights taken without their scale) is refused
    broken = tmp_path / "no-config"
    broken.mkdir()
    for path in family_dirs["fp8"].iterdir():
        (broken / path.name).write_bytes(path.read_bytes())
    config = json.loads((broken / "config.json").read_text())
    del config["quantization_config"]
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="weight_scale_inv"):
        load_model(broken, torch.float32, torch.device("cpu"), 64)
    del tensors["model.layers.0.mlp.experts.4.down_proj.weight_scale_inv"]
    save_file(tensors, str(broken / "model.safetensors"))
    (broken / "config.json").write_text(json.dumps(config | {"quantization_config": FP8BlockQuantization(
        FP8_BLOCK).to_config()}))
    with pytest.raises(ValueError, match=r"experts\.4\.down_proj\.weight.*without a weight_scale_inv"):
        load_model(broken, torch.float32, torch.device("cpu"), 64)


def test_fp8_round_trip_error_is_bounded_by_the_block_scale() -> None:
    weight = torch.randn(100, 70) * torch.logspace(-3, 1, 70)  # columns of very different magnitude
    q, scale_inv = quantize(weight, (32, 32))
    assert q.dtype == torch.float8_e4m3fn and scale_inv.shape == (4, 3)
    back = dequantize(q, scale_inv, (32, 32), torch.float32)
    blockwise_max = torch.kron(scale_inv, torch.ones(32, 32))[:100, :70] * 448
    assert ((back - weight).abs() <= blockwise_max * 2**-3).all()  # e4m3: 3 mantissa bits
    with pytest.raises(ValueError, match="expected"):
        dequantize(q, scale_inv[:3], (32, 32), torch.float32)


@pytest.mark.parametrize("grouped_mm", [True, False], ids=["grouped_mm", "expert-loop"])
def test_grouped_experts_equal_a_per_token_loop(monkeypatch: pytest.MonkeyPatch, grouped_mm: bool) -> None:
    """Both grouped paths (torch's grouped GEMM; the per-expert loop CUDA float16/float32 take)."""
    from pdserve.bench.moe import per_token_loop

    monkeypatch.setattr("pdserve.model.moe._has_grouped_mm", lambda x: grouped_mm)
    torch.manual_seed(0)
    experts = GroupedExperts(num_experts=7, hidden_size=16, intermediate_size=8)
    torch.nn.init.normal_(experts.gate_up_proj, std=0.3)
    torch.nn.init.normal_(experts.down_proj, std=0.3)
    x = torch.randn(33, 16)
    ids = torch.stack([torch.randperm(7)[:3] for _ in range(33)])
    ids[ids == 5] = 6  # expert 5 gets no token: an empty group
    weights = torch.rand(33, 3)
    torch.testing.assert_close(experts(x, ids, weights), per_token_loop(experts, x, ids, weights), rtol=1e-5,
                               atol=1e-6)


def test_a_grouped_gemm_that_raises_falls_back_to_the_expert_loop_for_good(monkeypatch: pytest.MonkeyPatch,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    from pdserve.model import moe

    calls = []

    def refuse(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        raise RuntimeError("grouped_mm: unsupported layout")

    monkeypatch.setattr(moe, "_GROUPED_MM_REFUSED", set())
    monkeypatch.setattr(moe.F, "grouped_mm", refuse)
    experts = GroupedExperts(num_experts=3, hidden_size=8, intermediate_size=4)
    torch.nn.init.normal_(experts.gate_up_proj)
    torch.nn.init.normal_(experts.down_proj)
    x, ids, weights = torch.randn(5, 8), torch.tensor([[0, 1]] * 5), torch.rand(5, 2)
    with caplog.at_level("WARNING", logger="pdserve.model.moe"):
        first = experts(x, ids, weights)
        second = experts(x, ids, weights)
    assert len(calls) == 1 and "grouped GEMM refused on cpu" in caplog.text
    torch.testing.assert_close(first, second)
    monkeypatch.undo()
    torch.testing.assert_close(first, experts(x, ids, weights), rtol=1e-5, atol=1e-6)


def test_weight_memory_is_logged_at_start(family_dirs: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="pdserve.model.loader"):
        model = load_model(family_dirs["fp8"], torch.float32, torch.device("cpu"), 64)
    line = next(r.getMessage() for r in caplog.records if "GiB" in r.getMessage())
    assert model.cfg.num_params == 9_884_928  # embeddings (tied) + 3 layers, 5 experts in the sparse ones
    assert f"{model.cfg.num_params * 4 / 1024**3:.3f} GiB in float32" in line
    assert "9.9 M parameters" in line and "block-FP8" in line and "dequantized" in line


@pytest.mark.parametrize("name", ["moe", "yarn"])
def test_pdserve_serve_answers_as_transformers(family_dirs: dict[str, Path], reference: HFReference,
                                               llms: dict[str, LLM], name: str) -> None:
    server = start_server(family_dirs[name], name, **ENGINE)
    try:
        with server.http() as http:
            for prompt in PROMPTS:
                reply = http.post("/v1/completions", json={"model": name, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                           "temperature": 0, "ignore_eos": True, "logprobs": 1})
                assert reply.status_code == 200, reply.text
                choice = reply.json()["choices"][0]
                assert choice["text"] == _texts(llms, family_dirs, name, [prompt], reference, name)[0]
                assert reply.json()["usage"]["completion_tokens"] == MAX_TOKENS
        server.wait_until_idle()
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.parametrize(("name", "reference_name"), [("moe", "moe"), ("fp8", "fp8-ref"), ("yarn", "yarn")])
def test_tensor_parallel_2_matches_transformers(family_dirs: dict[str, Path], reference: HFReference, name: str,
                                                reference_name: str) -> None:
    """Each rank holds half of every expert's intermediate rows (and of the dense layer's); an FP8
    weight is dequantized whole, then sliced."""
    llm = LLM(model=str(family_dirs[name]), tensor_parallel_size=2, num_threads=1, **ENGINE)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(token_prompts(PROMPTS), greedy(MAX_TOKENS))]
        assert got == _expected(reference, reference_name, PROMPTS)
        assert_no_leak(llm)
    finally:
        llm.engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["tcp", pytest.param("nixl", marks=_NO_NIXL)])
@pytest.mark.parametrize("name", ["moe", "yarn", "fp8"])
def test_pd_over_transports_matches_transformers(family_dirs: dict[str, Path], reference: HFReference,
                                                 llms: dict[str, LLM], transport: str, name: str) -> None:
    cluster = start_cluster(family_dirs[name], transport, 1, 1, max_num_batched_tokens=32)
    reference_name = "fp8-ref" if name == "fp8" else name
    try:
        with httpx.Client(base_url=cluster.router.url, timeout=60) as http:
            for prompt in PROMPTS:
                reply = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": MAX_TOKENS,
                                                           "temperature": 0, "ignore_eos": True})
                assert reply.status_code == 200, reply.text
                assert reply.json()["choices"][0]["text"] == _texts(llms, family_dirs, name, [prompt], reference,
                                                                    reference_name)[0]
        cluster.wait_until_idle()
    finally:
        stop_cluster(cluster)


@pytest.mark.slow
@pytest.mark.parametrize(("transport", "prefill_tp", "decode_tp"),
                         [("tcp", 2, 1), pytest.param("nixl", 1, 2, marks=_NO_NIXL)])
def test_moe_pd_hand_off_between_tp_sizes_matches_transformers(family_dirs: dict[str, Path], reference: HFReference,
                                                               llms: dict[str, LLM], transport: str, prefill_tp: int,
                                                               decode_tp: int) -> None:
    engine_options = {"prefill": {"tensor_parallel_size": prefill_tp, "num_threads": 1},
                      "decode": {"tensor_parallel_size": decode_tp, "num_threads": 1}}
    cluster = start_cluster(family_dirs["moe"], transport, 1, 1, max_num_batched_tokens=32,
                            engine_options=engine_options)
    try:
        with httpx.Client(base_url=cluster.router.url, timeout=60) as http:
            for prompt in PROMPTS[1:]:
                reply = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": MAX_TOKENS,
                                                           "temperature": 0, "ignore_eos": True})
                assert reply.status_code == 200, reply.text
                assert reply.json()["choices"][0]["text"] == _texts(llms, family_dirs, "moe", [prompt], reference,
                                                                    "moe")[0]
        cluster.wait_until_idle()
        assert cluster.workers[1][1].engine.stats().num_prefill_tokens > 0  # computed by prefill, handed off
    finally:
        stop_cluster(cluster)


def test_moe_benchmark_runs_and_checks_its_outputs(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m pdserve.bench.moe`, tiny: both tables, greedy outputs equal to transformers."""
    from pdserve.bench import moe

    monkeypatch.setattr("sys.argv", ["moe", "--preset", "tiny-moe", "--num-requests", "2", "--input-len", "4", "8",
                                     "--output-len", "2", "3", "--experts", "5", "--top-k", "2", "--hidden", "16",
                                     "--expert-width", "8", "--tokens", "1", "7", "--reps", "1"])
    moe.main()
    out = capsys.readouterr().out
    assert "| transformers generate" in out and "| 2/2 " in out and "per-token / grouped" in out


def test_sizing_counts_every_expert_for_memory_and_a_tokens_experts_for_flops() -> None:
    from pdserve.model.facts import ModelFacts, load_model_facts
    from pdserve.sizing.devices import device
    from pdserve.sizing.plan import PlanInputs, make_plan
    from pdserve.sizing.profile import BW_EFFICIENCY, FLOPS_EFFICIENCY, STEP_OVERHEAD_S, Limits, Profile, roofline

    moe, dense = load_model_facts("qwen3-30b-a3b"), load_model_facts("qwen3-8b")
    assert round(moe.num_params / 1e9, 1) == 30.5 and round(moe.num_active_params / 1e9, 2) == 3.35  # Qwen's card
    assert round(load_model_facts("qwen3-235b-a22b").num_active_params / 1e9) == 22
    assert dense.num_params == dense.num_active_params
    h200 = device("H200")
    plan = make_plan(PlanInputs(h200.memory_bytes, 0.9, moe, mean_input_len=1000, output_len=100, tp=2))
    assert plan.weights_bytes == moe.num_params * 2 / 2
    profile = roofline(moe, h200, Limits(num_kv_blocks=1000, max_num_seqs=8, max_num_batched_tokens=2048))
    assert profile.step.base_s == pytest.approx(
        STEP_OVERHEAD_S + moe.num_active_params * 2 / (h200.bandwidth_bytes_per_s * BW_EFFICIENCY))
    flops = h200.flops_per_s * FLOPS_EFFICIENCY
    assert profile.step.prefill_token_s == pytest.approx(2.0 * moe.matmul_params / flops)
    assert moe.matmul_params < moe.num_active_params < moe.num_params
    # a saved profile keeps a model's numbers: MoE ones too, tiny-moe's dense layer among sparse ones included
    assert Profile.from_dict(json.loads(json.dumps(profile.to_dict()))) == profile
    for facts in (moe, load_model_facts("tiny-moe")):
        back = ModelFacts.from_dict(json.loads(json.dumps(facts.to_dict())))
        numbers = ("num_params", "num_active_params", "matmul_params", "layer_params", "num_sparse_layers")
        assert back == facts and [getattr(back, n) for n in numbers] == [getattr(facts, n) for n in numbers]


@pytest.mark.parametrize("name", [*PRESETS, *QWEN3_SHAPES])
def test_parameter_count_is_transformers(name: str) -> None:
    """The parameter count sizing and the engine use (one formula, Qwen3ModelConfig.num_params) is
    transformers' own, `sum(p.numel() for p in model.parameters())` (tied embeddings once, every
    norm), of the model built from the config.json `make-model --preset` writes: every preset and
    real Qwen3 shape, built on the meta device (no memory, the 235B included)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pdserve.model.facts import load_model_facts

    config_json = json.loads(json.dumps((PRESETS | QWEN3_SHAPES)[name].config_json()))  # as written: lists
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config_json))
    assert load_model_facts(name).num_params == sum(p.numel() for p in model.parameters())


def test_make_model_writes_moe_fp8_and_scaled_rope_checkpoints(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    yarn = json.dumps(YARN)
    out = tmp_path / "m"
    assert pdserve_main(["make-model", str(out), "--preset", "tiny-moe", "--quantize", "fp8", "--weight-block-size",
                         "32", "--rope-scaling", yarn]) == 0
    cfg = Qwen3ModelConfig.from_dir(out)
    assert cfg.moe is not None and cfg.moe.num_experts == 5 and cfg.moe.mlp_only_layers == (1,)
    assert cfg.quantization == FP8BlockQuantization((32, 32)) and cfg.rope.rope_type == "yarn"
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["model.layers.0.mlp.experts.4.gate_proj.weight"].dtype == torch.float8_e4m3fn
    assert tensors["model.layers.0.mlp.experts.4.gate_proj.weight_scale_inv"].shape == (1, 2)  # [32, 64] in 32x32
    assert pdserve_main(["make-model", str(tmp_path / "x"), "--rope-scaling", '{"rope_type": "longrope"}']) == 2
    assert "longrope" in capsys.readouterr().err
