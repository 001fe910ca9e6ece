"""Capture safety of the decode forward, on CPU (issue 44, item 6): what `DecodeGraphs.capture`
records on a GPU (the model's forward on a padded bucket's persistent step buffers, Triton backend)
traces with torch.compile(fullgraph=True) for a dense and a MoE model, so it holds no graph break
(no host sync, no Python branch on a device value), and one eager run of it calls no op that reads
a device value back to the host. The three attention launches are opaque custom ops here: Triton's
interpreter (CPU) is Python that Dynamo would trace, where on a GPU they are plain launches. The
fused layer kernels (model/triton_fused.py) are custom ops of their own under torch.compile."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from test_decode_attention import decode_plan
from test_moe_capture_safe import FORBIDDEN, _OpNames

pytest.importorskip("triton")

from pdserve import LLM  # noqa: E402
from pdserve.engine.cuda_graphs import pad_decode_plan  # noqa: E402
from pdserve.model import moe  # noqa: E402
from pdserve.model import triton_attention as kernels  # noqa: E402
from pdserve.model.demo_checkpoint import PRESETS, write_checkpoint  # noqa: E402

DECODES = [([3, 4, 5], 12), ([10, 11, 12, 30, 20], 18), ([40, 33, 34, 35], 14)]
ORIGINAL = {name: getattr(kernels, name) for name in ("store_kv", "decode_attention", "prefix_attention")}


@torch.library.custom_op("pdserve_test::store_kv", mutates_args=("layer_cache",))
def _store_kv(k: torch.Tensor, v: torch.Tensor, layer_cache: torch.Tensor, slot_mapping: torch.Tensor,
              kv_scale: list[float]) -> None:
    ORIGINAL["store_kv"](k, v, layer_cache, slot_mapping, kv_scale=tuple(kv_scale))


@torch.library.custom_op("pdserve_test::decode_attention", mutates_args=("out",))
def _decode(q: torch.Tensor, layer_cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
            rows: torch.Tensor, out: torch.Tensor, scale: float, num_splits: int, kv_scale: list[float]) -> None:
    ORIGINAL["decode_attention"](q, layer_cache, tables, lens, rows, out, scale=scale, num_splits=num_splits,
                                 kv_scale=tuple(kv_scale))


@torch.library.custom_op("pdserve_test::prefix_attention", mutates_args=("out",))
def _prefix(q: torch.Tensor, layer_cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
            starts: torch.Tensor, ends: torch.Tensor, out: torch.Tensor, max_query_len: int, scale: float,
            kv_scale: list[float]) -> None:
    ORIGINAL["prefix_attention"](q, layer_cache, tables, lens, starts, ends, out, max_query_len=max_query_len,
                                 scale=scale, kv_scale=tuple(kv_scale))


for _op in (_store_kv, _decode, _prefix):
    _op.register_fake(lambda *args, **kwargs: None)


@pytest.fixture
def opaque_kernels(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(kernels, "store_kv", lambda *a, kv_scale: _store_kv(*a, list(kv_scale)))
    monkeypatch.setattr(kernels, "decode_attention",
                        lambda *a, scale, num_splits, kv_scale: _decode(*a, scale, num_splits, list(kv_scale)))
    monkeypatch.setattr(kernels, "prefix_attention",
                        lambda *a, max_query_len, scale, kv_scale: _prefix(*a, max_query_len, scale, list(kv_scale)))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _bucket_forward(model_dir: Path, dtype: str, kv_cache_dtype: str = "auto"
                    ) -> tuple[torch.nn.Module, tuple[object, ...]]:
    """The model and the inputs a 4-sequence bucket's graph is captured with (3 decodes, 1 padded)."""
    llm = LLM(model=str(model_dir), device="cpu", dtype=dtype, num_kv_blocks=64, block_size=4, max_num_seqs=8,
              max_model_len=128, kv_cache_dtype=kv_cache_dtype)
    runner = llm.engine.runner
    runner.use_paged_step(graphs=True)
    assert runner.step_buffers is not None
    torch.manual_seed(0)
    runner.kv_cache.copy_(torch.randn(runner.kv_cache.shape))  # NOTE: an FP8 pool has no normal_
    input_ids, positions, meta = runner.step_buffers.prepare(pad_decode_plan(decode_plan(DECODES, 4), 4))
    return runner.model, (input_ids, positions, runner.layer_caches, meta)


# NOTE: MoE in bfloat16: the grouped GEMM's meta kernel, which tracing runs, takes bfloat16 only (as on CUDA)
# (an FP8 pool: its per-layer scales are looked up by the cache tensor's address, a constant to the trace)
@pytest.mark.parametrize(("preset", "dtype", "kv_cache_dtype"), [("tiny", "float32", "auto"),
                                                                 ("tiny-moe", "bfloat16", "auto"),
                                                                 ("tiny", "float32", "fp8")])
def test_the_captured_decode_forward_has_no_graph_break_nor_host_sync(
        preset: str, dtype: str, kv_cache_dtype: str, opaque_kernels: None, tmp_path: Path) -> None:
    model, inputs = _bucket_forward(write_checkpoint(tmp_path / preset, PRESETS[preset], seed=3), dtype,
                                    kv_cache_dtype)
    with torch.inference_mode(), _OpNames() as ops:
        want = model(*inputs)
    assert not ops.names & FORBIDDEN, f"host syncs on the decode forward: {ops.names & FORBIDDEN}"
    with torch.inference_mode():
        got = torch.compile(model, fullgraph=True, backend="eager", dynamic=False)(*inputs)
    assert torch.equal(got, want)


def test_the_check_catches_a_host_sync(opaque_kernels: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: the MoE experts' per-expert loop (`.tolist()`, CUDA float16/float32) fails it (the
    trace: `.tolist()` dispatches no aten op, so the op audit alone would miss it)."""
    monkeypatch.setattr(moe, "_has_grouped_mm", lambda x: False)
    model, inputs = _bucket_forward(write_checkpoint(tmp_path / "moe", PRESETS["tiny-moe"], seed=3), "bfloat16")
    with torch.inference_mode(), pytest.raises(Exception, match="(?i)data.dependent|tolist|item"):
        torch.compile(model, fullgraph=True, backend="eager", dynamic=False)(*inputs)
