"""oneDNN-prepacked linears: same results as nn.Linear, and a bounded set of row counts reaching the
kernel (it caches a primitive and its buffers per row count seen: one per batch size leaked native
memory on PD workers, whose batches have nearly every size)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from pdserve.model.packed_linear import PackedLinear, bucket_rows, can_pack

needs_packing = pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.float32),
                                   reason="no oneDNN linear prepacking in this torch build")


def test_bucket_rows_pads_little_and_to_few_sizes() -> None:
    buckets = [bucket_rows(rows) for rows in range(1, 8193)]
    assert buckets[:16] == list(range(1, 17))  # decode batches run as they are
    assert all(rows <= b <= rows * 9 // 8 for rows, b in enumerate(buckets, start=1))
    assert buckets == sorted(buckets)
    assert len(set(buckets)) <= 16 + 8 * 9  # 16 exact sizes, then 8 per doubling up to 8192


@needs_packing
def test_kernel_sees_a_bounded_set_of_row_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    packed = PackedLinear(nn.Linear(8, 16), batch_size_hint=8)
    kernel = torch.ops.mkldnn._linear_pointwise
    seen: set[int] = set()

    def spy(x: torch.Tensor, *args: Any) -> torch.Tensor:
        seen.add(x.shape[0])
        return kernel(x, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    with torch.inference_mode():
        for rows in range(1, 301):
            packed(torch.randn(rows, 8))
    assert len(seen) <= 16 + 8 * 5, f"{len(seen)} distinct row counts reached the kernel"


@needs_packing
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 31, 100, 257])
def test_packed_matches_linear(rows: int) -> None:
    torch.manual_seed(rows)
    linear = nn.Linear(24, 40)
    packed = PackedLinear(linear, batch_size_hint=8)
    x = torch.randn(rows, 24)
    with torch.inference_mode():
        out = packed(x)
        expected = linear(x)
    assert out.shape == (rows, 40)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
