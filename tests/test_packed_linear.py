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
    assert buckets[:16] == [4, 4, 4, *range(4, 17)]  # decode batches run as they are, from 4 rows
    assert all(rows <= b <= max(4, rows * 9 // 8) for rows, b in enumerate(buckets, start=1))
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


@needs_packing
def test_decode_step_benchmark_runs_both_ways_and_restores_the_floor(model_dirs: dict[str, Any],
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m pdserve.bench.decode_step`, tiny: one row per batch with both columns, and the
    kernel sees 4 rows for a batch of 1 only while the floor is on."""
    from pdserve.bench import decode_step
    from pdserve.model import packed_linear

    kernel = torch.ops.mkldnn._linear_pointwise
    seen: list[tuple[int, int]] = []  # (floor then, rows reaching the kernel)

    def spy(x: torch.Tensor, *args: Any) -> torch.Tensor:
        seen.append((packed_linear._MIN_ROWS, x.shape[0]))
        return kernel(x, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    monkeypatch.setattr("sys.argv", ["decode_step", "--model", str(model_dirs["tiny"]), "--batches", "1,4",
                                     "--tokens", "3", "--prompt-len", "5"])
    decode_step.main()
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [row.split("|")[1].strip() for row in table[1:]] == ["1", "4"]
    assert packed_linear._MIN_ROWS == 4
    assert (1, 1) in seen and (4, 4) in seen and (4, 1) not in seen
