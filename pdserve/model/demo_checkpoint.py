"""Random-weight Qwen3 checkpoints in Hugging Face layout, for demos, tests and benchmarks.

Their text is random: they exercise every code path with the real Qwen3 tokenizer and real
shapes, but say nothing. Point `--model` at a downloaded Qwen3 directory for real answers.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from pdserve import envs

QWEN3_VOCAB_SIZE = 151936


@dataclass(frozen=True, slots=True)
class ModelShape:
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


PRESETS: dict[str, ModelShape] = {
    # head_dim differs from hidden/heads on purpose, as in real Qwen3 checkpoints.
    "tiny": ModelShape(64, 128, 2, 4, 2, 32, tie_word_embeddings=True),
    "small": ModelShape(256, 768, 4, 8, 2, 64, tie_word_embeddings=False),
    "qwen3-0.6b": ModelShape(1024, 3072, 28, 16, 8, 128, tie_word_embeddings=True,
                             max_position_embeddings=40960),
}

# Qwen/Qwen3-{8B,14B,32B} config.json (hidden, intermediate, layers, heads, KV heads, head_dim): sizing
# uses their numbers; `make-model --preset qwen3-8b` writes random weights of that shape (16 GB in bf16).
QWEN3_SHAPES: dict[str, ModelShape] = {
    "qwen3-8b": ModelShape(4096, 12288, 36, 32, 8, 128, tie_word_embeddings=False, max_position_embeddings=40960),
    "qwen3-14b": ModelShape(5120, 17408, 40, 40, 8, 128, tie_word_embeddings=False, max_position_embeddings=40960),
    "qwen3-32b": ModelShape(5120, 25600, 64, 64, 8, 128, tie_word_embeddings=False, max_position_embeddings=40960),
}


def _config_json(shape: ModelShape, dtype: torch.dtype) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        **asdict(shape),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
        "use_sliding_window": False,
    }


def _random_weights(shape: ModelShape, dtype: torch.dtype, seed: int,
                    device: str = "cpu") -> dict[str, torch.Tensor]:
    """Drawn on `device` (a GPU writes a large model's weights in seconds; other values than on CPU)."""
    gen = torch.Generator(device).manual_seed(seed)

    def normal(*size: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*size, generator=gen, device=device) * std).to(dtype).cpu()

    def norm_weight(size: int) -> torch.Tensor:
        return (1.0 + torch.randn(size, generator=gen, device=device) * 0.1).to(dtype).cpu()

    h, i = shape.hidden_size, shape.intermediate_size
    q_size = shape.num_attention_heads * shape.head_dim
    kv_size = shape.num_key_value_heads * shape.head_dim
    weights = {"model.embed_tokens.weight": normal(shape.vocab_size, h)}
    for n in range(shape.num_hidden_layers):
        p = f"model.layers.{n}."
        weights |= {
            p + "self_attn.q_proj.weight": normal(q_size, h, std=h**-0.5),
            p + "self_attn.k_proj.weight": normal(kv_size, h, std=h**-0.5),
            p + "self_attn.v_proj.weight": normal(kv_size, h, std=h**-0.5),
            p + "self_attn.o_proj.weight": normal(h, q_size, std=q_size**-0.5),
            p + "self_attn.q_norm.weight": norm_weight(shape.head_dim),
            p + "self_attn.k_norm.weight": norm_weight(shape.head_dim),
            p + "mlp.gate_proj.weight": normal(i, h, std=h**-0.5),
            p + "mlp.up_proj.weight": normal(i, h, std=h**-0.5),
            p + "mlp.down_proj.weight": normal(h, i, std=i**-0.5),
            p + "input_layernorm.weight": norm_weight(h),
            p + "post_attention_layernorm.weight": norm_weight(h),
        }
    weights["model.norm.weight"] = norm_weight(h)
    if not shape.tie_word_embeddings:
        weights["lm_head.weight"] = normal(shape.vocab_size, h)
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


def write_checkpoint(out_dir: str | Path, shape: ModelShape, *, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                     max_shard_bytes: int | None = None, device: str = "cpu") -> Path:
    """Write config.json, generation_config.json, safetensors weights and the Qwen3 tokenizer."""
    from pdserve.tokenizer import write_qwen3_tokenizer_files

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(_config_json(shape, dtype), indent=2))
    generation = {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    _save_shards(_random_weights(shape, dtype, seed, device), out, max_shard_bytes)
    write_qwen3_tokenizer_files(out)
    return out


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
