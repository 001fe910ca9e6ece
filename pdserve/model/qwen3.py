"""Qwen3 decoder, dense or mixture-of-experts (moe.py): `forward` returns hidden states,
`compute_logits` is separate so the runner asks for logits only at the rows that sample. Math
mirrors Hugging Face's Qwen3 / Qwen3-MoE (same op order, fp32 RMSNorm, router and RoPE tables) so
greedy outputs match it token for token. The residual add, the norms, RoPE and SiLU-mul go through
`layer_ops` (model/layer_ops.py): torch's ops on CPU, fused Triton kernels on the CUDA backend. The
residual stream is carried beside the hidden states, vLLM-style, so each add fuses into the next norm:

    h, residual = add_rms_norm(x, residual)      x: the previous layer's MLP output (none at layer 0)
    h, residual = add_rms_norm(attn(h), residual)
    x = mlp(h)                                   ... the final norm adds the last layer's x

The forward is cut at each attention into pieces, which piecewise CUDA graphs capture
(engine/piecewise_graphs.py); the attentions, which read the step's metadata, run between them:

    first_piece      embed, RoPE rows, layer 0: add_rms_norm, qkv_proj, qk_norm_rope
    attention(0)     store K/V, decode / prefix / fresh-prompt attention          (eager)
    middle_piece(0)  layer 0: o_proj, add_rms_norm, MLP; layer 1: add_rms_norm, qkv_proj, qk_norm_rope
    ...              attention(L-1)
    last_piece       layer L-1: o_proj, add_rms_norm, MLP; the final norm -> hidden states"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, cast

import torch
from torch import nn

from pdserve.model.attention_backend import StepMetadata, attend
from pdserve.model.layer_ops import TORCH_OPS, LayerOps, RopeRows, layer_ops, rms_norm
from pdserve.model.moe import SparseMoeBlock, capture_safe
from pdserve.model.parallel import ParallelGroup
from pdserve.model.qwen3_config import Qwen3ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    cos: torch.Tensor  # [max_positions, head_dim] buffers, declared for the type checker
    sin: torch.Tensor

    def __init__(self, cfg: Qwen3ModelConfig, max_positions: int) -> None:
        super().__init__()
        cos, sin = cfg.rope.tables(cfg.head_dim, max_positions, cfg.max_position_embeddings)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def rows(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeRows:
        """The step's rows, once a step for every layer (a gather and a cast each of cos and sin)."""
        return RopeRows(self.cos[positions].to(dtype), self.sin[positions].to(dtype))


class LayerInputs(NamedTuple):
    """What a layer's attention takes (q, k, v), the residual stream the layer adds to after it, and
    the step's RoPE rows (gathered once, in the first piece)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    residual: torch.Tensor
    rope: RopeRows


class Qwen3Attention(nn.Module):
    """With a `group`, `cfg` is this rank's share (parallel.py): its heads, a row-parallel o_proj."""

    def __init__(self, cfg: Qwen3ModelConfig, group: ParallelGroup | None = None) -> None:
        super().__init__()
        self.group = group
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.scale = self.head_dim**-0.5

    def project(self, x: torch.Tensor, rope: RopeRows, ops: LayerOps
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Attention's inputs: q [tokens, heads, head_dim], k and v [tokens, kv_heads, head_dim]."""
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = ops.qk_norm_rope(q.reshape(-1, self.num_heads, self.head_dim),
                                k.reshape(-1, self.num_kv_heads, self.head_dim), self.q_norm.weight,
                                self.k_norm.weight, self.q_norm.eps, rope)
        return q, k, v.reshape(-1, self.num_kv_heads, self.head_dim)

    def output(self, attn_out: torch.Tensor) -> torch.Tensor:
        """[tokens, heads, head_dim] -> [tokens, hidden] (summed over the ranks)."""
        out = self.o_proj(attn_out.reshape(-1, self.q_size))
        return out if self.group is None else self.group.all_reduce(out)


class Qwen3MLP(nn.Module):
    def __init__(self, cfg: Qwen3ModelConfig, group: ParallelGroup | None = None) -> None:
        super().__init__()
        self.group = group
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ops: LayerOps = TORCH_OPS) -> torch.Tensor:
        out = self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))
        return out if self.group is None else self.group.all_reduce(out)


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3ModelConfig, index: int, group: ParallelGroup | None = None) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(cfg, group)
        self.mlp: Qwen3MLP | SparseMoeBlock = (SparseMoeBlock(cfg, group) if cfg.moe is not None and
                                               cfg.moe.is_sparse(index) else Qwen3MLP(cfg, group))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def pre_attention(self, x: torch.Tensor, residual: torch.Tensor | None, rope: RopeRows, ops: LayerOps
                      ) -> LayerInputs:
        """The previous layer's output (added to the residual stream) up to this layer's attention."""
        h, residual = ops.add_rms_norm(x, residual, self.input_layernorm.weight, self.input_layernorm.eps)
        q, k, v = self.self_attn.project(h, rope, ops)
        return LayerInputs(q, k, v, residual, rope)

    def post_attention(self, attn_out: torch.Tensor, inputs: LayerInputs, ops: LayerOps
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): the add is left to the next norm."""
        h, residual = ops.add_rms_norm(self.self_attn.output(attn_out), inputs.residual,
                                       self.post_attention_layernorm.weight, self.post_attention_layernorm.eps)
        return (self.mlp(h, ops) if isinstance(self.mlp, Qwen3MLP) else self.mlp(h)), residual


class Qwen3ForCausalLM(nn.Module):
    """Parameter names follow the checkpoint's except the fused `qkv_proj` and `gate_up_proj`
    (see `loader.py` for the mapping). With a `group` (tensor parallelism), `cfg` is this rank's
    share of the model (`TPShard.local_config`) and `vocab_start` its first vocabulary row."""

    def __init__(self, cfg: Qwen3ModelConfig, max_positions: int, group: ParallelGroup | None = None,
                 vocab_start: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.group = group
        self.vocab_start = vocab_start
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg, index, group) for index in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = RotaryEmbedding(cfg, max_positions)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: StepMetadata, layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden_size].
        `layer_done(l)` runs once layer l's K/V for this step are in the cache (KV streaming).
        The pieces between the attentions are what piecewise CUDA graphs capture
        (engine/piecewise_graphs.py): one implementation, eager or replayed."""
        ops = layer_ops(meta)
        inputs = self.first_piece(input_ids, positions, ops)
        last = len(self.layers) - 1
        for index, layer_cache in enumerate(kv_caches):
            attn_out = self.attention(index, inputs, layer_cache, meta)
            if layer_done is not None:
                layer_done(index)
            if index < last:
                inputs = self.middle_piece(index, attn_out, inputs, ops)
        return self.last_piece(attn_out, inputs, ops)

    def first_piece(self, input_ids: torch.Tensor, positions: torch.Tensor, ops: LayerOps) -> LayerInputs:
        """The embedding, the step's RoPE rows, layer 0 up to its attention."""
        x = self.embed_tokens(input_ids) if self.group is None else self._embed_parallel(input_ids)
        return self._layer(0).pre_attention(x, None, self.rope.rows(positions, x.dtype), ops)

    def attention(self, index: int, inputs: LayerInputs, layer_cache: torch.Tensor, meta: StepMetadata
                  ) -> torch.Tensor:
        """Layer `index`'s attention (writes the step's K/V into `layer_cache`): the part that
        reads the step's metadata, outside any piece."""
        attn = self._layer(index).self_attn
        return attend(inputs.q, inputs.k, inputs.v, layer_cache, meta, attn.scale)

    def middle_piece(self, index: int, attn_out: torch.Tensor, inputs: LayerInputs, ops: LayerOps) -> LayerInputs:
        """Layer `index` after its attention, then layer `index + 1` up to its attention."""
        x, residual = self._layer(index).post_attention(attn_out, inputs, ops)
        return self._layer(index + 1).pre_attention(x, residual, inputs.rope, ops)

    def last_piece(self, attn_out: torch.Tensor, inputs: LayerInputs, ops: LayerOps) -> torch.Tensor:
        """The last layer after its attention and the final norm: the hidden states."""
        x, residual = self._layer(-1).post_attention(attn_out, inputs, ops)
        return ops.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)[0]

    def _layer(self, index: int) -> Qwen3DecoderLayer:
        return cast(Qwen3DecoderLayer, self.layers[index])

    def capture_safe(self) -> bool:
        """Whether a CUDA graph can capture the forward: no host sync in it (the MoE experts' per-expert
        loop, CUDA float16/float32, has one per layer)."""
        return self.cfg.moe is None or capture_safe(self.embed_tokens.weight)

    def _embed_parallel(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Each token's row lives on one rank; the others contribute zeros to the all-reduce."""
        assert self.group is not None
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.cfg.vocab_size)
        x = self.embed_tokens(local.masked_fill(outside, 0))
        return self.group.all_reduce(x.masked_fill_(outside[:, None], 0.0))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] -> [rows, vocab] float32 (every rank gets the whole vocabulary)."""
        logits = self.lm_head(hidden).float()
        return logits if self.group is None else self.group.all_gather(logits)
