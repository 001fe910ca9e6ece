"""Block-wise FP8 weights (the `quant_method: fp8` checkpoints Qwen and DeepSeek publish).

A quantized weight W [N, K] is stored as float8_e4m3fn with a float32 `weight_scale_inv` beside it,
one value per block of `weight_block_size` = [bn, bk] elements (edge blocks may be partial):

         K ->  bk      bk     (rest)
    N  +-------+-------+----+
    |  | s00   | s01   | s02|    W[i, j] = fp8[i, j] * scale_inv[i // bn, j // bk]
    bn +-------+-------+----+
       | s10   | s11   | s12|    scale_inv: [ceil(N / bn), ceil(K / bk)]
       +-------+-------+----+

pdserve dequantizes at load, on every device, into the engine's float dtype: the model then runs the
float code paths (and matches transformers on the dequantized weights). Only the checkpoint (disk,
download) is halved; device memory holds the float weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"  # `x.weight` -> `x.weight_scale_inv`


@dataclass(frozen=True, slots=True)
class FP8BlockQuantization:
    block_size: tuple[int, int]

    @classmethod
    def from_config(cls, raw: dict | None) -> FP8BlockQuantization | None:
        """The checkpoint's `quantization_config`: None when it has none; ValueError for any other method."""
        if not raw:
            return None
        method = raw.get("quant_method")
        if method != "fp8":
            raise ValueError(f"unsupported quantization_config.quant_method {method!r}: pdserve loads float "
                             "checkpoints and block-wise FP8 ones (quant_method 'fp8')")
        fmt = raw.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"unsupported fp8 format {fmt!r}: pdserve loads e4m3 FP8 checkpoints")
        block = raw.get("weight_block_size")
        if not (isinstance(block, list | tuple) and len(block) == 2 and all(int(b) > 0 for b in block)):
            raise ValueError(f"fp8 checkpoints must be block-wise (weight_block_size [n, k]), got {block!r}")
        if raw.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError(f"unsupported fp8 activation_scheme {raw.get('activation_scheme')!r}: only 'dynamic'")
        return cls((int(block[0]), int(block[1])))

    def to_config(self) -> dict:
        return {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(self.block_size),
                "activation_scheme": "dynamic"}


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int],
               dtype: torch.dtype) -> torch.Tensor:
    """float8 [N, K] and its block scales -> `dtype` [N, K] (computed in float32)."""
    rows, cols = weight.shape
    bn, bk = block_size
    expected = (-(-rows // bn), -(-cols // bk))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"weight_scale_inv of shape {tuple(scale_inv.shape)} for a weight of {(rows, cols)} "
                         f"in blocks of {block_size}: expected {expected}")
    if rows % bn == 0 and cols % bk == 0:  # whole blocks: each scale broadcast over its block, no expanded copy
        blocks = weight.float().view(expected[0], bn, expected[1], bk) * scale_inv.float()[:, None, :, None]
        return blocks.view(rows, cols).to(dtype)
    scales = scale_inv.float().repeat_interleave(bn, 0)[:rows].repeat_interleave(bk, 1)[:, :cols]
    return (weight.float() * scales).to(dtype)


def quantize(weight: torch.Tensor, block_size: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (float8_e4m3fn [N, K], float32 scale_inv [ceil(N/bn), ceil(K/bk)]): each block
    scaled so that its largest magnitude maps to FP8_MAX."""
    rows, cols = weight.shape
    bn, bk = block_size
    n_blocks, k_blocks = -(-rows // bn), -(-cols // bk)
    padded = weight.float().new_zeros(n_blocks * bn, k_blocks * bk)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(n_blocks, bn, k_blocks, bk)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale_inv = amax / FP8_MAX
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(n_blocks * bn, k_blocks * bk)[:rows, :cols].contiguous(), scale_inv


def quantize_state_dict(weights: dict[str, torch.Tensor], block_size: tuple[int, int]) -> dict[str, torch.Tensor]:
    """What an FP8 checkpoint holds for `weights`: every 2-D projection weight in FP8 with its
    `weight_scale_inv`; embeddings, the LM head, norms and MoE routers stay float (as Qwen's do)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if is_quantized_name(name) and tensor.dim() == 2:
            out[name], out[name + SCALE_SUFFIX] = quantize(tensor, block_size)
        else:
            out[name] = tensor
    return out


def is_quantized_name(name: str) -> bool:
    return name.endswith("_proj.weight")
