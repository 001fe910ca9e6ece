"""The numbers sizing needs from a Qwen3 model: parameter count, KV bytes per token, FLOPs per token.

Mixture-of-experts models (Qwen3-MoE) have two parameter counts: `num_params` (every expert: what
memory holds) and `num_active_params` (a token's top-k experts: what one token multiplies and, at
batch 1, what a step reads). NOTE: a batch of B tokens touches about E x (1 - (1 - k/E)^B) experts
of each layer, so the bandwidth term of a large decode batch is optimistic for MoE.

A model comes from a checkpoint directory, a Hugging Face `config.json` file, a `make-model`
preset (pdserve/model/demo_checkpoint.py) or one of the real Qwen3 shapes below (their
`config.json` numbers on the Hugging Face hub; no weights are needed to size or simulate them).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from pdserve.model.demo_checkpoint import PRESETS, QWEN3_SHAPES, QWEN3_VOCAB_SIZE, ModelShape
from pdserve.model.qwen3_config import Qwen3ModelConfig

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "float8": 1,
               "int8": 1}


@dataclass(frozen=True, slots=True)
class ModelFacts:
    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    # mixture of experts: `num_sparse_layers` of the layers have `num_experts` experts (0: dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_sparse_layers: int = 0

    @classmethod
    def from_shape(cls, name: str, shape: ModelShape) -> ModelFacts:
        return cls(name, shape.hidden_size, shape.intermediate_size, shape.num_hidden_layers,
                   shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim, shape.vocab_size,
                   shape.tie_word_embeddings, shape.num_experts, shape.num_experts_per_tok,
                   shape.moe_intermediate_size, sum(shape.is_sparse(n) for n in range(shape.num_hidden_layers)))

    @classmethod
    def from_config(cls, name: str, raw: dict) -> ModelFacts:
        heads = int(raw["num_attention_heads"])
        layers = int(raw["num_hidden_layers"])
        moe = Qwen3ModelConfig.from_dict(raw).moe if raw.get("model_type") == "qwen3_moe" else None
        return cls(name, int(raw["hidden_size"]), int(raw["intermediate_size"]), layers,
                   heads, int(raw.get("num_key_value_heads") or heads),
                   int(raw.get("head_dim") or int(raw["hidden_size"]) // heads),
                   int(raw.get("vocab_size", QWEN3_VOCAB_SIZE)), bool(raw.get("tie_word_embeddings", False)),
                   *((0, 0, 0, 0) if moe is None else (moe.num_experts, moe.num_experts_per_tok,
                                                       moe.moe_intermediate_size,
                                                       sum(moe.is_sparse(n) for n in range(layers)))))

    def to_dict(self) -> dict:
        return asdict(self)

    def _layers_params(self, experts: int) -> int:
        """Attention and MLP weights of every layer, with `experts` experts counted per sparse layer."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h
        dense_layers = self.num_layers - self.num_sparse_layers
        sparse_mlp = experts * 3 * h * self.moe_intermediate_size + self.num_experts * h  # + the router
        return (self.num_layers * attention + dense_layers * 3 * h * self.intermediate_size
                + self.num_sparse_layers * sparse_mlp)

    @property
    def layer_params(self) -> int:
        """One layer's weights a token multiplies (of a MoE model: the mean over its layers)."""
        return self.layers_matmul_params // self.num_layers

    @property
    def layers_matmul_params(self) -> int:
        """The weights of every layer a token multiplies (a sparse layer's top-k experts and router)."""
        return self._layers_params(self.num_experts_per_tok)

    @property
    def num_params(self) -> int:
        """Every weight, every expert: what memory holds."""
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self._layers_params(self.num_experts) + embeddings

    @property
    def num_active_params(self) -> int:
        """The weights one token uses: its top-k experts of each sparse layer (= num_params when dense)."""
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.layers_matmul_params + embeddings

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
    if spec in PRESETS:
        return ModelFacts.from_shape(spec, PRESETS[spec])
    if spec in QWEN3_SHAPES:
        return ModelFacts.from_shape(spec, QWEN3_SHAPES[spec])
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        names = ", ".join([*PRESETS, *QWEN3_SHAPES])
        raise ValueError(f"--model {spec!r}: not a checkpoint directory, a config.json or a known shape ({names})")
    return ModelFacts.from_config(path.parent.name or spec, json.loads(path.read_text()))


def dtype_bytes(name: str) -> int:
    try:
        return DTYPE_BYTES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}: one of {', '.join(DTYPE_BYTES)}") from None
