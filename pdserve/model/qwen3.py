"""Qwen3 decoder, dense or mixture-of-experts (moe.py): `forward` returns hidden states,
`compute_logits` is separate so the runner asks for logits only at the rows that sample. Math
mirrors Hugging Face's Qwen3 / Qwen3-MoE (same op order, fp32 RMSNorm, router and RoPE tables) so
greedy outputs match it token for token. The residual add, the norms, RoPE and SiLU-mul go through
`layer_ops` (model/layer_ops.py): torch's ops on CPU, fused Triton kernels on the CUDA backend. The
residual stream is carried beside the hidden states, vLLM-style, so each add fuses into the next norm:

    h, residual = add_rms_norm(x, residual)      x: the previous layer's MLP output (none at layer 0)
    h, residual = add_rms_norm(attn(h), residual)
    x = mlp(h)                                   ... the final norm adds the last layer's x"""

from __future__ import annotations

from collections.abc import Callable

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

    def forward(self, x: torch.Tensor, rope: RopeRows, layer_cache: torch.Tensor, meta: StepMetadata,
                ops: LayerOps) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = ops.qk_norm_rope(q.reshape(-1, self.num_heads, self.head_dim),
                                k.reshape(-1, self.num_kv_heads, self.head_dim), self.q_norm.weight,
                                self.k_norm.weight, self.q_norm.eps, rope)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        out = attend(q, k, v, layer_cache, meta, self.scale)
        out = self.o_proj(out.reshape(-1, self.q_size))
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

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: RopeRows, layer_cache: torch.Tensor,
                meta: StepMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): the add is left to the next norm."""
        ops = layer_ops(meta)
        h, residual = ops.add_rms_norm(x, residual, self.input_layernorm.weight, self.input_layernorm.eps)
        h = self.self_attn(h, rope, layer_cache, meta, ops)
        h, residual = ops.add_rms_norm(h, residual, self.post_attention_layernorm.weight,
                                       self.post_attention_layernorm.eps)
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
        `layer_done(l)` runs once layer l's K/V for this step are in the cache (KV streaming)."""
        x = self.embed_tokens(input_ids) if self.group is None else self._embed_parallel(input_ids)
        rope = self.rope.rows(positions, x.dtype)
        residual: torch.Tensor | None = None
        for index, (layer, layer_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x, residual = layer(x, residual, rope, layer_cache, meta)
            if layer_done is not None:
                layer_done(index)
        return layer_ops(meta).add_rms_norm(x, residual, self.norm.weight, self.norm.eps)[0]

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
