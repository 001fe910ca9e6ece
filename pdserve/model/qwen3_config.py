"""The part of a Hugging Face Qwen3 `config.json` the engine needs, typed and validated."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class Qwen3ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    # NOTE: Qwen3's head_dim is its own field (e.g. 0.6B: hidden 1024, 16 heads, head_dim 128).
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    torch_dtype: torch.dtype
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_dict(cls, raw: dict) -> Qwen3ModelConfig:
        model_type = raw.get("model_type", "qwen3")
        if model_type != "qwen3":
            raise ValueError(f"unsupported model_type {model_type!r}: pdserve serves Qwen3 dense models (qwen3)")
        rope = raw.get("rope_parameters") or {}
        scaling = raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
        if rope_type != "default":
            raise ValueError(f"unsupported rope type {rope_type!r}: only default RoPE is implemented")
        heads = int(raw["num_attention_heads"])
        eos = raw.get("eos_token_id")
        return cls(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 1_000_000.0))),
            max_position_embeddings=int(raw.get("max_position_embeddings", 40960)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            torch_dtype=_TORCH_DTYPES.get(str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"),
                                          torch.bfloat16),
            eos_token_ids=_as_ids(eos),
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Qwen3ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: --model must be a Hugging Face Qwen3 checkpoint directory")
        return cls.from_dict(json.loads(path.read_text()))

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads (GQA)")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even for rotary embeddings")


def _as_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return (int(value),) if isinstance(value, int) else tuple(int(v) for v in value)
