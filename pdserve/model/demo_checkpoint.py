"""Random-weight Qwen3 checkpoints in Hugging Face layout, for demos, tests and benchmarks.

Their text is random: they exercise every code path with the real Qwen3 tokenizer and real
shapes, but say nothing. Point `--model` at a downloaded Qwen3 directory for real answers.

A `ModelShape` is only what a checkpoint is written from: it turns into the config.json it writes
(`config_json`), and everything else, the weights drawn here included, reads the model from that
config.json as the engine does (`Qwen3ModelConfig`, qwen3_config.py: the one description).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from pdserve import envs
from pdserve.model.fp8 import FP8BlockQuantization, quantize_state_dict
from pdserve.model.qwen3_config import Qwen3ModelConfig

QWEN3_VOCAB_SIZE = 151936


@dataclass(frozen=True, slots=True)
class ModelVariant:
    """What a demo checkpoint's config.json says beside its shape: the weights' dtype, `rope_scaling`
    (e.g. {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}), and
    `quantization`: the projection weights in block FP8 with their scales (fp8.py)."""

    dtype: torch.dtype = torch.bfloat16
    rope_scaling: dict | None = None
    quantization: FP8BlockQuantization | None = None


@dataclass(frozen=True, slots=True)
class ModelShape:
    """config.json's shape fields, under their config.json names."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    tie_word_embeddings: bool
    max_position_embeddings: int = 4096
    rope_theta: float = 1_000_000.0
    vocab_size: int = QWEN3_VOCAB_SIZE
    # mixture of experts (Qwen3-MoE) when num_experts > 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def config_json(self, variant: ModelVariant = ModelVariant()) -> dict:
        """The config.json of a checkpoint of this shape, in the official checkpoints' spelling:
        `num_experts`, `rope_scaling` + `rope_theta`, `torch_dtype`."""
        fields = asdict(self)
        if not self.is_moe:
            fields = {k: v for k, v in fields.items() if k not in _MOE_FIELDS}
        quantization = variant.quantization
        quant = {} if quantization is None else {"quantization_config": quantization.to_config()}
        return {
            "architectures": ["Qwen3MoeForCausalLM" if self.is_moe else "Qwen3ForCausalLM"],
            "model_type": "qwen3_moe" if self.is_moe else "qwen3",
            **fields,
            **quant,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "rope_scaling": variant.rope_scaling,
            "bos_token_id": 151643,
            "eos_token_id": 151645,
            "torch_dtype": str(variant.dtype).removeprefix("torch."),
            "use_cache": True,
            "use_sliding_window": False,
        }

    def config(self, variant: ModelVariant = ModelVariant()) -> Qwen3ModelConfig:
        """The model as the engine reads that config.json."""
        return Qwen3ModelConfig.from_dict(self.config_json(variant))


_MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
               "mlp_only_layers")


PRESETS: dict[str, ModelShape] = {
    # head_dim differs from hidden/heads on purpose, as in real Qwen3 checkpoints.
    "tiny": ModelShape(64, 128, 2, 4, 2, 32, tie_word_embeddings=True),
    "small": ModelShape(256, 768, 4, 8, 2, 64, tie_word_embeddings=False),
    "qwen3-0.6b": ModelShape(1024, 3072, 28, 16, 8, 128, tie_word_embeddings=True,
                             max_position_embeddings=40960),
    # an odd number of experts, top-2, layer 1 dense among sparse ones (mlp_only_layers), GQA 4/2
    "tiny-moe": ModelShape(64, 128, 3, 4, 2, 32, tie_word_embeddings=True, num_experts=5, num_experts_per_tok=2,
                           moe_intermediate_size=32, mlp_only_layers=(1,)),
    # benchmarks (bench/moe.py): 16 experts, top-4, every layer sparse
    "small-moe": ModelShape(256, 768, 4, 8, 2, 64, tie_word_embeddings=False, num_experts=16, num_experts_per_tok=4,
                            moe_intermediate_size=192),
}

# Qwen/Qwen3-{1.7B,4B,8B,14B,32B} config.json (hidden, intermediate, layers, heads, KV heads, head_dim): sizing
# uses their numbers; `make-model --preset qwen3-8b` writes random weights of that shape (16 GB in bf16).
QWEN3_SHAPES: dict[str, ModelShape] = {
    # Qwen/Qwen3-1.7B: the smallest real shape whose layers outweigh its vocabulary by ~4.5x (0.6B: 2.8x)
    "qwen3-1.7b": ModelShape(2048, 6144, 28, 16, 8, 128, tie_word_embeddings=True, max_position_embeddings=40960),
    "qwen3-4b": ModelShape(2560, 9728, 36, 32, 8, 128, tie_word_embeddings=True, max_position_embeddings=40960),
    "qwen3-8b": ModelShape(4096, 12288, 36, 32, 8, 128, tie_word_embeddings=False, max_position_embeddings=40960),
    "qwen3-14b": ModelShape(5120, 17408, 40, 40, 8, 128, tie_word_embeddings=False, max_position_embeddings=40960),
    "qwen3-32b": ModelShape(5120, 25600, 64, 64, 8, 128, tie_word_embeddings=False, max_position_embeddings=40960),
    # Qwen/Qwen3-30B-A3B and Qwen3-235B-A22B config.json: 128 experts, 8 per token, every layer sparse
    "qwen3-30b-a3b": ModelShape(2048, 6144, 48, 32, 4, 128, tie_word_embeddings=False, max_position_embeddings=40960,
                                num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768),
    "qwen3-235b-a22b": ModelShape(4096, 12288, 94, 64, 4, 128, tie_word_embeddings=False,
                                  max_position_embeddings=40960, num_experts=128, num_experts_per_tok=8,
                                  moe_intermediate_size=1536),
}


def _random_weights(model: Qwen3ModelConfig, dtype: torch.dtype, seed: int,
                    device: str = "cpu") -> dict[str, torch.Tensor]:
    """Drawn on `device` (a GPU writes a large model's weights in seconds; other values than on CPU)."""
    gen = torch.Generator(device).manual_seed(seed)

    def normal(*size: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*size, generator=gen, device=device) * std).to(dtype).cpu()

    def norm_weight(size: int) -> torch.Tensor:
        return (1.0 + torch.randn(size, generator=gen, device=device) * 0.1).to(dtype).cpu()

    h = model.hidden_size
    q_size = model.num_attention_heads * model.head_dim
    kv_size = model.num_key_value_heads * model.head_dim
    weights = {"model.embed_tokens.weight": normal(model.vocab_size, h)}
    for n in range(model.num_hidden_layers):
        p = f"model.layers.{n}."
        weights |= {
            p + "self_attn.q_proj.weight": normal(q_size, h, std=h**-0.5),
            p + "self_attn.k_proj.weight": normal(kv_size, h, std=h**-0.5),
            p + "self_attn.v_proj.weight": normal(kv_size, h, std=h**-0.5),
            p + "self_attn.o_proj.weight": normal(h, q_size, std=q_size**-0.5),
            p + "self_attn.q_norm.weight": norm_weight(model.head_dim),
            p + "self_attn.k_norm.weight": norm_weight(model.head_dim),
            **_mlp_weights(model, n, normal),
            p + "input_layernorm.weight": norm_weight(h),
            p + "post_attention_layernorm.weight": norm_weight(h),
        }
    weights["model.norm.weight"] = norm_weight(h)
    if not model.tie_word_embeddings:
        weights["lm_head.weight"] = normal(model.vocab_size, h)
    return weights


def _mlp_weights(model: Qwen3ModelConfig, layer: int, normal: Callable[..., torch.Tensor]
                 ) -> dict[str, torch.Tensor]:
    """A dense MLP, or a router and per-expert MLPs (`mlp.experts.{e}.gate_proj.weight`, as Qwen's)."""
    h, p, moe = model.hidden_size, f"model.layers.{layer}.mlp.", model.moe
    if moe is None or not moe.is_sparse(layer):
        i = model.intermediate_size
        return {p + "gate_proj.weight": normal(i, h, std=h**-0.5), p + "up_proj.weight": normal(i, h, std=h**-0.5),
                p + "down_proj.weight": normal(h, i, std=i**-0.5)}
    i = moe.moe_intermediate_size
    weights = {p + "gate.weight": normal(moe.num_experts, h, std=h**-0.5)}
    for e in range(moe.num_experts):
        weights |= {f"{p}experts.{e}.gate_proj.weight": normal(i, h, std=h**-0.5),
                    f"{p}experts.{e}.up_proj.weight": normal(i, h, std=h**-0.5),
                    f"{p}experts.{e}.down_proj.weight": normal(h, i, std=i**-0.5)}
    return weights


def _save_shards(weights: dict[str, torch.Tensor], out: Path, max_shard_bytes: int | None) -> None:
    if max_shard_bytes is None:
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in weights.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    weight_map: dict[str, str] = {}
    for index, shard in enumerate(shards, start=1):
        file_name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file_name), metadata={"format": "pt"})
        weight_map |= {name: file_name for name in shard}
    total = sum(t.numel() * t.element_size() for t in weights.values())
    index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2))


def write_checkpoint(out_dir: str | Path, shape: ModelShape, *, seed: int = 0, max_shard_bytes: int | None = None,
                     device: str = "cpu", variant: ModelVariant = ModelVariant()) -> Path:
    """Write config.json, generation_config.json, safetensors weights and the Qwen3 tokenizer."""
    config, quantization = shape.config_json(variant), variant.quantization
    weights = _random_weights(Qwen3ModelConfig.from_dict(config), variant.dtype, seed, device)
    return write_weights(out_dir, config,
                         weights if quantization is None else quantize_state_dict(weights, quantization.block_size),
                         max_shard_bytes)


def write_weights(out_dir: str | Path, config: dict, weights: dict[str, torch.Tensor],
                  max_shard_bytes: int | None = None) -> Path:
    """A checkpoint directory of `config` (config.json's content) and `weights`, with the Qwen3 tokenizer."""
    from pdserve.tokenizer import write_qwen3_tokenizer_files

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    generation = {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    _save_shards(weights, out, max_shard_bytes)
    write_qwen3_tokenizer_files(out)
    return out


def quantize_checkpoint(src_dir: str | Path, out_dir: str | Path, block_size: tuple[int, int] = (128, 128)) -> Path:
    """A block-FP8 copy of the float checkpoint in `src_dir` (config.json gains its quantization_config)."""
    from safetensors.torch import load_file

    from pdserve.model.loader import safetensors_files

    src = Path(src_dir)
    weights: dict[str, torch.Tensor] = {}
    for path in safetensors_files(src):
        weights |= load_file(str(path))
    config = json.loads((src / "config.json").read_text())
    if config.get("quantization_config"):
        raise ValueError(f"{src} is already quantized ({config['quantization_config'].get('quant_method')})")
    config["quantization_config"] = FP8BlockQuantization(block_size).to_config()
    return write_weights(out_dir, config, quantize_state_dict(weights, block_size))


def default_model_dir(preset: str = "tiny") -> Path:
    """The embedded default: built once into a cache directory, reused afterwards."""
    cache = Path(envs.cache_dir(str(Path.home() / ".cache" / "pdserve")))
    out = cache / f"demo-{preset}"
    if not (out / "config.json").is_file() or not (out / "tokenizer.json").is_file():
        # NOTE: written aside then renamed, so concurrent first starts never see half a checkpoint.
        tmp = cache / f".demo-{preset}.tmp{os.getpid()}"
        write_checkpoint(tmp, PRESETS[preset])
        if out.exists():
            shutil.rmtree(tmp)
        else:
            tmp.rename(out)
    return out
