"""The part of a Hugging Face Qwen3 `config.json` the engine needs, typed and validated: dense
(`qwen3`) and mixture-of-experts (`qwen3_moe`) models, their rope type, FP8 block quantization.

transformers writes two spellings of several fields; both are read: `num_experts` /
`num_local_experts`, `rope_scaling` + `rope_theta` / `rope_parameters`, `torch_dtype` / `dtype`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.model.fp8 import FP8BlockQuantization
from pdserve.model.rope import RopeConfig

MODEL_TYPES = ("qwen3", "qwen3_moe")
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """Qwen3-MoE's sparse MLP: layer l is sparse unless it is in `mlp_only_layers` or (l + 1) is not
    a multiple of `decoder_sparse_step`; a sparse layer routes each token to `num_experts_per_tok`
    of `num_experts` experts of `moe_intermediate_size` (a dense layer uses `intermediate_size`)."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]

    @classmethod
    def from_config(cls, raw: dict) -> MoEConfig:
        experts = raw.get("num_experts", raw.get("num_local_experts"))
        if experts is None or raw.get("moe_intermediate_size") is None:
            raise ValueError("a qwen3_moe config needs num_experts (or num_local_experts) and moe_intermediate_size")
        moe = cls(int(experts), int(raw.get("num_experts_per_tok", 8)), int(raw["moe_intermediate_size"]),
                  bool(raw.get("norm_topk_prob", False)), int(raw.get("decoder_sparse_step", 1)),
                  tuple(int(n) for n in raw.get("mlp_only_layers") or ()))
        if not 1 <= moe.num_experts_per_tok <= moe.num_experts:
            raise ValueError(f"num_experts_per_tok {moe.num_experts_per_tok} must be in [1, num_experts "
                             f"{moe.num_experts}]")
        if moe.decoder_sparse_step < 1:
            raise ValueError("decoder_sparse_step must be >= 1")
        return moe

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


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
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    torch_dtype: torch.dtype
    eos_token_ids: tuple[int, ...]
    moe: MoEConfig | None = None  # None: dense
    quantization: FP8BlockQuantization | None = None  # the checkpoint's weights; dequantized at load

    @classmethod
    def from_dict(cls, raw: dict) -> Qwen3ModelConfig:
        """ValueError naming what is wrong: a model type not served, a required field missing."""
        missing = [key for key in _REQUIRED if key not in raw]
        if missing:
            raise ValueError(f"config.json lacks {', '.join(missing)}: not a Qwen3 config")
        model_type = raw.get("model_type", "qwen3")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}: pdserve serves Qwen3 dense (qwen3) and "
                             "mixture-of-experts (qwen3_moe) models")
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
            rope=RopeConfig.from_config(raw),
            max_position_embeddings=int(raw.get("max_position_embeddings", 40960)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            torch_dtype=_TORCH_DTYPES.get(str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"),
                                          torch.bfloat16),
            eos_token_ids=_as_ids(eos),
            moe=MoEConfig.from_config(raw) if model_type == "qwen3_moe" else None,
            quantization=FP8BlockQuantization.from_config(raw.get("quantization_config")),
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Qwen3ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: --model must be a Hugging Face Qwen3 checkpoint directory")
        return cls.from_dict(json.loads(path.read_text()))

    @property
    def max_context_len(self) -> int:
        """The longest context this model's positions are meant for (a scaled rope stretches it)."""
        return self.rope.context_len(self.max_position_embeddings)

    def is_sparse(self, layer: int) -> bool:
        return self.moe is not None and self.moe.is_sparse(layer)

    @property
    def num_sparse_layers(self) -> int:
        return sum(self.is_sparse(layer) for layer in range(self.num_hidden_layers))

    @property
    def num_params(self) -> int:
        """Every weight, all experts included (what device memory holds): transformers' count,
        `sum(p.numel() for p in model.parameters())` (tests/test_qwen3_family.py checks it)."""
        h, hd = self.hidden_size, self.head_dim
        norms = 2 * hd + 2 * h  # q_norm and k_norm (per head), input_layernorm, post_attention_layernorm
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h  # + the final norm
        return embeddings + self.num_hidden_layers * (self.num_attention_params + norms) + self.num_mlp_params

    @property
    def num_attention_params(self) -> int:
        """One layer's q, k, v and o projections."""
        return 2 * self.hidden_size * (self.num_attention_heads + self.num_key_value_heads) * self.head_dim

    @property
    def num_mlp_params(self) -> int:
        """The MLP weights of every layer: dense ones, or every expert and the router of sparse ones."""
        h, sparse = self.hidden_size, self.num_sparse_layers
        dense_mlps = (self.num_hidden_layers - sparse) * 3 * h * self.intermediate_size
        if self.moe is None:
            return dense_mlps
        return dense_mlps + sparse * self.moe.num_experts * (3 * h * self.moe.moe_intermediate_size + h)

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads (GQA)")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even for rotary embeddings")


def _as_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return (int(value),) if isinstance(value, int) else tuple(int(v) for v in value)
