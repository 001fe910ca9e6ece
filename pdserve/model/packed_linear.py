"""CPU linear layers with weights prepacked once by oneDNN (the layout its GEMM kernels want).

On the 2-core CPUs we test on this makes the vocabulary projection 2-3x faster at decode batch
sizes and the prefill projections ~20-40% faster, against `F.linear` re-laying out the weight on
every call. The result differs from `F.linear` only by float32 rounding (~1e-6).

NOTE: memory. The kernel keeps, per input row count it has seen, a cached oneDNN primitive and
its buffers (ideep's per-thread LRU cache, 1024 entries): ~0.55 MiB for each new row count of the
tiny model's vocabulary projection. A PD worker sees nearly every row count (batches of chunks of
any length, any number of sampled rows), so its engine thread's heap grew by ~15 MiB a minute
until that cache would fill, hundreds of MiB later. Rows are therefore padded up to one of a few
bucket sizes (`bucket_rows`: at most 1/8 extra rows; 16 + 8 per doubling buckets), which bounds the
cached primitives to a few per linear shape.

Fewer than 4 rows run as 4 (zero rows added): with one thread, oneDNN's kernel for 1 or 2 rows reads
a weight that does not fit the caches 25-40 % slower than its 4-row kernel (AMD EPYC VM, torch
2.13: the `qwen3-0.6b` vocabulary projection 37 / 44 ms at 1 / 2 rows, 28 ms at 4; an 8B-shaped
12288 x 4096 layer 13.0 / 15.0 ms against 9.4), and a decode step is mostly such reads: the
`qwen3-0.6b` decode step at batch 1 / 2 took 174 / 224 ms, 137 / 142 padded, against 146 ms at 4.
"""

from __future__ import annotations

import torch
from torch import nn

_MIN_ROWS = 4  # fewer rows run as this many (see above)
_EXACT_ROWS = 16  # up to this many rows (decode batches) run unpadded, from _MIN_ROWS


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, batch_size_hint: int) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_size_hint)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [rows, in_features] -> [rows, out_features]."""
        rows = x.shape[0]
        padded = bucket_rows(rows)
        if padded != rows:
            x = torch.cat([x, x.new_zeros((padded - rows, x.shape[1]))])
        out = torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed_weight, self.bias, "none", [], "")
        return out if padded == rows else out[:rows]


def bucket_rows(rows: int) -> int:
    """The row count the kernel runs with for `rows` rows: at least `_MIN_ROWS`, exact up to
    `_EXACT_ROWS`, then rounded up to a multiple of 1/8 of the power of two below it (17 -> 18,
    100 -> 104, 1000 -> 1024)."""
    if rows <= _EXACT_ROWS:
        return max(rows, _MIN_ROWS)
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


def pack_linears(module: nn.Module, batch_size_hint: int) -> None:
    """Replace every nn.Linear below `module` by a PackedLinear. A weight shared with another
    module (tied embeddings) stays alive through that module; others are released."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear(child, batch_size_hint))
        else:
            pack_linears(child, batch_size_hint)
