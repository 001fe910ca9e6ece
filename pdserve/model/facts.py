"""The numbers sizing needs from a Qwen3 model: parameter count, KV bytes per token, FLOPs per token.

They are all derived from the model's `Qwen3ModelConfig` (qwen3_config.py, the one description
of a model, parsed from its config.json); `ModelFacts` only names it and computes.

Mixture-of-experts models (Qwen3-MoE) have two parameter counts: `num_params` (every expert: what
memory holds) and `num_active_params` (a token's top-k experts: what one token multiplies and, at
batch 1, what a step reads). NOTE: a batch of B tokens touches about E x (1 - (1 - k/E)^B) experts
of each layer, so the bandwidth term of a large decode batch is optimistic for MoE.

A model comes from a checkpoint directory, a Hugging Face `config.json` file, a `make-model`
preset (pdserve/model/demo_checkpoint.py) or one of the real Qwen3 shapes there (their
`config.json` numbers on the Hugging Face hub; no weights are needed to size or simulate them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pdserve.model.demo_checkpoint import PRESETS, QWEN3_SHAPES, ModelShape
from pdserve.model.qwen3_config import Qwen3ModelConfig

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "float8": 1,
               "int8": 1}

# What a saved profile keeps of a model (to_dict), in this order; three of them are renamed config.json fields.
_SAVED = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size",
          "tie_word_embeddings", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "num_sparse_layers")
_CONFIG_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
                 "num_kv_heads": "num_key_value_heads"}


@dataclass(frozen=True, slots=True, eq=False)
class ModelFacts:
    name: str
    config: Qwen3ModelConfig

    @classmethod
    def from_shape(cls, name: str, shape: ModelShape) -> ModelFacts:
        return cls(name, shape.config())

    @classmethod
    def from_config(cls, name: str, raw: dict) -> ModelFacts:
        """`raw`: a config.json's content."""
        return cls(name, Qwen3ModelConfig.from_dict(raw))

    def to_dict(self) -> dict:
        """What a profile saves: the numbers sizing reads, not the whole config."""
        return {"name": self.name, **{key: getattr(self, key) for key in _SAVED}}

    @classmethod
    def from_dict(cls, raw: dict) -> ModelFacts:
        """From `to_dict`'s keys (a version-1 profile has no MoE ones: dense). Which layers of a MoE
        model are the dense ones is not saved and sizing does not need it: here the first ones."""
        config = {_CONFIG_NAMES.get(key, key): value for key, value in raw.items() if key in _SAVED}
        if raw.get("num_experts"):
            dense = int(raw["num_layers"]) - int(raw["num_sparse_layers"])
            config |= {"model_type": "qwen3_moe", "mlp_only_layers": list(range(dense))}
        return cls(raw["name"], Qwen3ModelConfig.from_dict(config))

    # NOTE: equal when sizing's numbers are: a model read back from a profile (from_dict) keeps only those.
    def __eq__(self, other: object) -> bool:
        return isinstance(other, ModelFacts) and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(tuple(self.to_dict().items()))

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def intermediate_size(self) -> int:
        return self.config.intermediate_size

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def num_heads(self) -> int:
        return self.config.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return self.config.num_key_value_heads

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def tie_word_embeddings(self) -> bool:
        return self.config.tie_word_embeddings

    @property
    def num_experts(self) -> int:
        """Of each sparse layer (0: dense)."""
        return 0 if self.config.moe is None else self.config.moe.num_experts

    @property
    def num_experts_per_tok(self) -> int:
        return 0 if self.config.moe is None else self.config.moe.num_experts_per_tok

    @property
    def moe_intermediate_size(self) -> int:
        return 0 if self.config.moe is None else self.config.moe.moe_intermediate_size

    @property
    def num_sparse_layers(self) -> int:
        return self.config.num_sparse_layers

    @property
    def idle_expert_params(self) -> int:
        """The expert weights a token does not use: all but its top-k of each sparse layer (0: dense)."""
        idle_experts = self.num_sparse_layers * (self.num_experts - self.num_experts_per_tok)
        return idle_experts * 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def layer_params(self) -> int:
        """One layer's weights a token multiplies (of a MoE model: the mean over its layers)."""
        return self.layers_matmul_params // self.num_layers

    @property
    def layers_matmul_params(self) -> int:
        """The weights of every layer a token multiplies (a sparse layer's top-k experts and router)."""
        return self.num_layers * self.config.num_attention_params + self.config.num_mlp_params - self.idle_expert_params

    @property
    def num_params(self) -> int:
        """Every weight, every expert: what memory holds."""
        return self.config.num_params

    @property
    def num_active_params(self) -> int:
        """The weights one token uses: its top-k experts of each sparse layer (= num_params when dense)."""
        return self.num_params - self.idle_expert_params

    @property
    def matmul_params(self) -> int:
        """Parameters every token multiplies (the input embedding is a lookup, the LM head is not; of
        a sparse layer's experts only the top-k)."""
        return self.layers_matmul_params + self.vocab_size * self.hidden_size

    def kv_bytes_per_token(self, dtype_bytes: int, tp: int = 1) -> int:
        """K and V of every layer for one token, on one of `tp` ranks (KV heads split, at least one each)."""
        kv_heads = max(1, self.num_kv_heads // tp)
        return 2 * self.num_layers * kv_heads * self.head_dim * dtype_bytes

    def attention_flops_per_pair(self, tp: int = 1) -> float:
        """FLOPs of QK^T and AV for one (query token, key token) pair, all layers, one rank."""
        return 4.0 * self.num_layers * self.num_heads * self.head_dim / tp


def load_model_facts(spec: str) -> ModelFacts:
    """`spec`: a preset or Qwen3 shape name, a checkpoint directory, or a config.json path."""
    shapes = PRESETS | QWEN3_SHAPES
    if spec in shapes:
        return ModelFacts.from_shape(spec, shapes[spec])
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"--model {spec!r}: not a checkpoint directory, a config.json or a known shape "
                         f"({', '.join(shapes)})")
    return ModelFacts.from_config(path.parent.name or spec, json.loads(path.read_text()))


def dtype_bytes(name: str) -> int:
    try:
        return DTYPE_BYTES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}: one of {', '.join(DTYPE_BYTES)}") from None
