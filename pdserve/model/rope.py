"""Rotary position embeddings of the types Qwen3 configs carry: default, linear, dynamic (NTK) and YaRN.

Each type is a rule for the inverse frequencies (and, for YaRN, a scale on cos and sin, the
"attention factor" or mscale), computed exactly as transformers' `modeling_rope_utils` does so that
positions past `original_max_position_embeddings` match it bit for bit. The model reads one
[max_positions, head_dim] table of cos and one of sin, indexed by position:

    row p = cat(p * inv_freq, p * inv_freq).cos() * attention_factor      (and .sin())

NOTE: dynamic NTK. transformers recomputes the frequencies for the sequence length of each forward
pass (`seq_len = max(position) + 1`) and never re-rotates the keys already cached, so a generated
token at position p is rotated with the frequencies of length p + 1. Row p of the table therefore
uses `inv_freq(max(p + 1, max_position_embeddings))`: identical to transformers for every generated
token and for prompts up to `max_position_embeddings`; a prompt longer than that is rotated here
token by token (independent of how it is chunked or batched), where transformers rotates all of it
with the prompt's length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ROPE_TYPES = ("default", "linear", "dynamic", "yarn")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    rope_type: str
    theta: float
    factor: float = 1.0
    # yarn: the pretraining context the factor stretches (transformers defaults it to max_position_embeddings)
    original_max_position_embeddings: int | None = None
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    @classmethod
    def from_config(cls, raw: dict) -> RopeConfig:
        """From a config.json: `rope_parameters` (transformers >= 5) or `rope_scaling` + `rope_theta` (older)."""
        params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_type = str(params.get("rope_type") or params.get("type") or "default")
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope type {rope_type!r}: pdserve implements {', '.join(ROPE_TYPES)}")
        if float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor") or 1.0)) != 1.0:
            raise ValueError("partial_rotary_factor != 1 is not supported (Qwen3 rotates the whole head)")
        theta = float(params.get("rope_theta", raw.get("rope_theta", 1_000_000.0)))
        if rope_type == "default":
            return cls("default", theta)
        factor = params.get("factor")
        original = params.get("original_max_position_embeddings")
        if original is None and rope_type == "yarn":
            original = raw.get("original_max_position_embeddings", raw.get("max_position_embeddings", 40960))
        if factor is None:
            if rope_type != "yarn" or original is None:
                raise ValueError(f"rope type {rope_type!r} needs a 'factor'")
            factor = int(raw.get("max_position_embeddings", 40960)) / int(original)  # transformers' fallback
        if float(factor) < 1.0:
            raise ValueError(f"rope factor must be >= 1, got {factor}")
        return cls(rope_type, theta, float(factor), None if original is None else int(original),
                   None if params.get("attention_factor") is None else float(params["attention_factor"]),
                   float(params.get("beta_fast") or 32.0), float(params.get("beta_slow") or 1.0),
                   params.get("mscale"), params.get("mscale_all_dim"), bool(params.get("truncate", True)))

    def context_len(self, max_position_embeddings: int) -> int:
        """The longest context the scaled embedding is meant for (vLLM's derivation): YaRN stretches
        its original window by `factor`, linear and dynamic stretch `max_position_embeddings`."""
        if self.rope_type == "yarn":
            assert self.original_max_position_embeddings is not None
            return max(max_position_embeddings, int(self.original_max_position_embeddings * self.factor))
        return int(max_position_embeddings * self.factor)

    def tables(self, head_dim: int, max_positions: int, max_position_embeddings: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [max_positions, head_dim] float32."""
        positions = torch.arange(max_positions, dtype=torch.float)
        if self.rope_type == "dynamic":
            freqs = self._dynamic_freqs(head_dim, max_positions, max_position_embeddings)
        else:
            freqs = positions[:, None] * self._inv_freq(head_dim)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = self._attention_factor()
        if scale == 1.0:
            return emb.cos(), emb.sin()
        return emb.cos() * scale, emb.sin() * scale

    def _inv_freq(self, head_dim: int) -> torch.Tensor:
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq = 1.0 / (self.theta ** exponents)
        if self.rope_type == "linear":
            return inv_freq / self.factor
        if self.rope_type == "yarn":
            return self._yarn_inv_freq(head_dim)
        return inv_freq

    def _dynamic_freqs(self, head_dim: int, max_positions: int, max_position_embeddings: int) -> torch.Tensor:
        """[max_positions, head_dim / 2]: row p is p * inv_freq(seq_len = max(p + 1, max_position_embeddings)).
        NOTE: one row at a time with 0-d tensors, as transformers computes each (its sequence length
        is a tensor): vectorized, torch's pow rounds differently in the last bit (~10 us a row)."""
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        short = min(max_positions, max_position_embeddings)
        rows = [torch.arange(short, dtype=torch.float)[:, None] * self._inv_freq(head_dim)[None, :]]
        for position in range(short, max_positions):
            seq_len = torch.tensor(position + 1)
            theta = self.theta * ((self.factor * seq_len / max_position_embeddings) - (self.factor - 1)) ** (
                head_dim / (head_dim - 2))
            rows.append(float(position) * (1.0 / (theta ** exponents))[None, :])
        return torch.cat(rows)

    def _attention_factor(self) -> float:
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return float(_yarn_mscale(self.factor, self.mscale) / _yarn_mscale(self.factor, self.mscale_all_dim))
        return _yarn_mscale(self.factor)

    def _yarn_inv_freq(self, dim: int) -> torch.Tensor:
        assert self.original_max_position_embeddings is not None
        pos_freqs = self.theta ** (torch.arange(0, dim, 2).float() / dim)
        extrapolation = 1.0 / pos_freqs
        interpolation = 1.0 / (self.factor * pos_freqs)
        low, high = _yarn_correction_range(self.beta_fast, self.beta_slow, dim, self.theta,
                                           self.original_max_position_embeddings, self.truncate)
        if low == high:
            high += 0.001  # transformers: prevents a division by zero
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        extrapolation_factor = 1 - ramp
        return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_correction_range(low_rot: float, high_rot: float, dim: int, base: float, max_positions: int,
                           truncate: bool) -> tuple[float, float]:
    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(max_positions / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(low_rot), correction_dim(high_rot)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)
