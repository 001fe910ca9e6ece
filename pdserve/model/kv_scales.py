"""The FP8 KV cache's numbers: per-layer K and V scales, and the two casts every FP8 pool access goes
through.

An FP8 pool (`--kv-cache-dtype fp8`, float8_e4m3fn; or fp8_e5m2) stores `value / scale`, clamped to
the format's finite range; what is read back is `element * scale` in the model's dtype:

    write   k (model dtype) -> float32 / k_scale -> clamp(+-max) -> float8        (`quantize`)
    read    float8 -> model dtype * k_scale                                         (`dequantize`)

The quantization runs in float32 whatever the model's dtype, so two engines (or a hand-off's
receiver) that quantize the same K/V values with the same scale store the same bytes. A float pool
(float32/bfloat16/float16) goes through the same two calls with scale 1.0: a plain cast.

Scales are one per layer for K and one for V, as vLLM's (`k_scale` / `v_scale` of each attention
layer of an FP8 checkpoint, read by `read_checkpoint_kv_scales`). A checkpoint without them gets
1.0 everywhere, with a warning, as vLLM does; not calibrated on a first batch: prefill and decode
workers would calibrate on different batches and disagree about what their pools' bytes mean.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

logger = logging.getLogger(__name__)

FP8_DTYPES: frozenset[torch.dtype] = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})

# vLLM's names: `self_attn.k_scale` (also under `attn.`, `k_proj.`/`v_proj.`), and the older
# `kv_scale`, one scale for both
_SCALE_NAME = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(?:attn\.|k_proj\.|v_proj\.)?(k_scale|v_scale|kv_scale)$")


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def is_kv_scale_name(name: str) -> bool:
    """A checkpoint tensor that is a KV cache scale, not a weight (the loader skips it)."""
    return _SCALE_NAME.match(name) is not None


@dataclass(frozen=True, slots=True)
class KVScales:
    """Per layer, what an FP8 pool's K and V elements are multiplied by to give the values."""

    k: tuple[float, ...]
    v: tuple[float, ...]
    from_checkpoint: bool = field(default=False, compare=False)  # else 1.0 everywhere (no scales there)

    def __post_init__(self) -> None:
        if len(self.k) != len(self.v) or not self.k:
            raise ValueError(f"KV scales need one K and one V scale per layer, got {len(self.k)} and {len(self.v)}")
        bad = [s for s in (*self.k, *self.v) if not (math.isfinite(s) and s > 0)]
        if bad:
            raise ValueError(f"KV scales must be finite and > 0, got {bad[0]}")

    @classmethod
    def ones(cls, num_layers: int) -> KVScales:
        return cls((1.0,) * num_layers, (1.0,) * num_layers)

    def layer(self, index: int) -> tuple[float, float]:
        return self.k[index], self.v[index]


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """K or V values -> what a pool of `dtype` stores (see the module docstring)."""
    if not is_fp8(dtype):
        return x.to(dtype)
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-limit, limit).to(dtype)


def dequantize(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """A pool's elements -> K or V values in `dtype` (`x` itself when it is of `dtype`, unscaled)."""
    if x.dtype == torch.float8_e4m3fn and x.device.type == "cpu":
        return _e4m3_as_float16(x).to(dtype).mul_(_E4M3_IN_FLOAT16 * scale)
    return x.to(dtype) if scale == 1.0 else x.to(dtype, copy=True).mul_(scale)


# An e4m3 byte s.eeee.mmm put into float16's bits as s.0eeee.mmm0000000 is the same number divided
# by 2**8 (biases 7 and 15), subnormals included: exact for every finite value.
_E4M3_IN_FLOAT16 = 256.0


def _e4m3_as_float16(x: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn elements / 256 as float16, by moving bits. NOTE: torch's CPU cast from e4m3 has
    no vectorized kernel: ~10x a bfloat16 cast, ~3x these integer passes (measured on 2 vCPUs). The
    NaN code (which no pool holds: writes clamp, and the model's K/V are finite) would read as 480."""
    bits = x.view(torch.uint8).to(torch.int16)
    sign = (bits & 0x80).bitwise_left_shift_(8)
    return (bits & 0x7F).bitwise_left_shift_(7).bitwise_or_(sign).view(torch.float16)


def requantize(values: torch.Tensor, scales: tuple[float, float], dtype: torch.dtype,
               new_scales: tuple[float, float]) -> torch.Tensor:
    """K/V elements [k|v, ...] with `scales` -> elements of `dtype` with `new_scales`, through float32
    values (a PD hand-off between pools of other types or scales; `quantize` as the engine's writes)."""
    out = torch.empty(values.shape, dtype=dtype, device=values.device)
    for index in (0, 1):
        out[index] = quantize(dequantize(values[index], torch.float32, scales[index]), dtype, new_scales[index])
    return out


def read_checkpoint_kv_scales(files: list[Path], num_layers: int) -> KVScales | None:
    """The K/V scales the checkpoint's safetensors `files` carry, None when they carry none.
    Raises ValueError when only some layers have them, or a scale is not a positive number."""
    k: dict[int, float] = {}
    v: dict[int, float] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                match = _SCALE_NAME.match(name)
                if match is None:
                    continue
                layer, kind = int(match.group(1)), match.group(2)
                scale = _scalar(handle.get_tensor(name), name)
                if kind in ("k_scale", "kv_scale"):
                    k[layer] = scale
                if kind in ("v_scale", "kv_scale"):
                    v[layer] = scale
    if not k and not v:
        return None
    missing = sorted(set(range(num_layers)) - (k.keys() & v.keys()))
    if missing:
        raise ValueError(f"the checkpoint has KV cache scales for some layers only: layer {missing[0]} has no "
                         f"{'k_scale' if missing[0] not in k else 'v_scale'}")
    return KVScales(tuple(k[i] for i in range(num_layers)), tuple(v[i] for i in range(num_layers)),
                    from_checkpoint=True)


def fp8_kv_scales(files: list[Path], num_layers: int) -> KVScales:
    """An FP8 pool's scales: the checkpoint's, else 1.0 for every layer (with a warning)."""
    scales = read_checkpoint_kv_scales(files, num_layers)
    if scales is not None:
        return scales
    logger.warning("FP8 KV cache: the checkpoint has no k_scale/v_scale; using scale 1.0 for every layer "
                   "(K/V values beyond the FP8 range are clamped)")
    return KVScales.ones(num_layers)


def _scalar(tensor: torch.Tensor, name: str) -> float:
    if tensor.numel() != 1:
        raise ValueError(f"KV cache scale {name!r} must hold one number, has shape {tuple(tensor.shape)}")
    value = float(tensor.float().item())
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"KV cache scale {name!r} must be finite and > 0, got {value}")
    return value
