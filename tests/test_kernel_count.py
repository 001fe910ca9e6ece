"""Kernels per decode layer on the CUDA backend's path, counted on CPU so the count cannot grow back.

What a CUDA graph of a decode bucket captures (engine/cuda_graphs.py) is the model's forward on the
persistent step buffers through the Triton backend; here that forward runs eagerly on CPU (Triton's
interpreter) while a dispatch counter records, inside one decoder layer:
- every aten op that launches a kernel: views and allocations (`empty`) launch none and are not
  counted; a GEMM is one op (`mm`);
- every Triton kernel launch, counted where Triton runs a kernel (the counter pauses inside it: the
  interpreter's own tensor copies are not kernels on a GPU).

The count is of one layer past the first (whose input norm has no residual to add). Run as a script
(`python tests/test_kernel_count.py`) it prints the per-layer breakdown.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # NOTE: before triton is imported (conftest does it too)
DEVICE = "cuda" if CUDA else "cpu"  # with a GPU, the kernels are compiled for it and count the same

triton = pytest.importorskip("triton")

from test_decode_attention import decode_plan  # noqa: E402

from pdserve import LLM  # noqa: E402
from pdserve.engine.cuda_graphs import pad_decode_plan  # noqa: E402
from pdserve.model import triton_attention  # noqa: E402
from pdserve.model.demo_checkpoint import PRESETS, ModelShape, write_checkpoint  # noqa: E402

MAX_KERNELS_PER_DECODE_LAYER = 15
BLOCK_SIZE = 4
# (block table, context length) of each decode: a 4-sequence bucket, 3 real and 1 padded row
DECODES = [([3, 4, 5], 12), ([10, 11, 12, 30, 20], 18), ([40, 33, 34, 35], 14)]


def _is_kernel(func: torch._ops.OpOverload, args: Any, out: Any) -> bool:
    """An op that writes its input in place is a kernel; one whose outputs all share an input's
    storage is a view (or a no-op `to`), and an allocation (`empty`) launches none."""
    if func.overloadpacket in _ALLOCATIONS:
        return False
    if any(r.alias_info is not None and r.alias_info.is_write for r in func._schema.returns):
        return True
    inputs = {_storage(t) for t in _tensors(args)}
    outputs = _tensors(out)
    return not outputs or any(_storage(t) not in inputs for t in outputs)


def _storage(t: torch.Tensor) -> int | None:
    """Where its data lives; None for an opaque tensor (a CPU GEMM's prepacked weight)."""
    try:
        return t.untyped_storage().data_ptr()
    except NotImplementedError:
        return None


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return []


_ALLOCATIONS = {torch.ops.aten.empty, torch.ops.aten.empty_like, torch.ops.aten.empty_strided,
                torch.ops.aten.new_empty, torch.ops.aten.new_empty_strided}


class KernelCounter(TorchDispatchMode):
    """Counts kernel-launching aten ops and Triton launches while `active`."""

    def __init__(self) -> None:
        super().__init__()
        self.active = False
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: torch._ops.OpOverload, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.active and _is_kernel(func, args, out):
            self.ops[f"aten.{func.overloadpacket.__name__}"] += 1
        return out

    @property
    def total(self) -> int:
        return sum(self.ops.values())


@contextmanager
def counting_triton(counter: KernelCounter) -> Iterator[None]:
    """Each Triton kernel run counts once, and runs with the dispatch counter paused."""
    kernel_type = type(triton_attention._decode_split_kernel)  # the interpreter's, or the JIT's on a GPU
    original = kernel_type.run

    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        if counter.active:
            counter.ops[f"triton.{self.fn.__name__ if hasattr(self, 'fn') else self.__name__}"] += 1
        with _disable_current_modes():
            return original(self, *args, **kwargs)

    kernel_type.run = run  # type: ignore[method-assign]
    try:
        yield
    finally:
        kernel_type.run = original  # type: ignore[method-assign]


def count_decode_layer(model_dir: Path, dtype: str = "float32", layer: int = 1) -> KernelCounter:
    """The kernels of decoder layer `layer` in one padded decode step on the Triton path."""
    llm = LLM(model=str(model_dir), device=DEVICE, dtype=dtype, enforce_eager=True, num_kv_blocks=64,
              block_size=BLOCK_SIZE, max_num_seqs=8, max_model_len=128)
    runner = llm.engine.runner
    runner.use_paged_step(graphs=True)
    assert runner.step_buffers is not None
    input_ids, positions, meta = runner.step_buffers.prepare(pad_decode_plan(decode_plan(DECODES, BLOCK_SIZE), 4))
    counter = KernelCounter()
    target = runner.model.layers[layer]

    pre_attention, post_attention = target.pre_attention, target.post_attention

    def start(*args: Any) -> Any:  # the layer runs from its pre-attention piece to its post-attention one
        counter.active = True
        return pre_attention(*args)

    def stop(*args: Any) -> Any:
        out = post_attention(*args)
        counter.active = False
        return out

    target.pre_attention, target.post_attention = start, stop
    try:
        with torch.inference_mode(), counting_triton(counter), counter:
            runner.model(input_ids, positions, runner.layer_caches, meta)
    finally:
        del target.pre_attention, target.post_attention
    return counter


GEMMS = ("aten.mm", "aten.addmm", "aten.linear", "aten._linear_pointwise")  # CPU float32: oneDNN's linear


# NOTE: bfloat16, the GPU's dtype (its casts are kernels); the interpreter's bfloat16 values are wrong,
# its launches are not
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_decode_layer_launches_at_most_15_kernels(dtype: str, tmp_path: Path) -> None:
    counter = count_decode_layer(write_checkpoint(tmp_path / "tiny", PRESETS["tiny"], seed=3), dtype)
    ops = dict(counter.ops)
    assert counter.total <= MAX_KERNELS_PER_DECODE_LAYER, ops
    assert sum(counter.ops[name] for name in GEMMS) == 4, ops  # qkv, o, gate|up, down: the count saw the layer
    assert counter.ops["triton._decode_split_kernel"] == 1, ops


def test_one_split_launches_no_merge(tmp_path: Path) -> None:
    """Control for the counter: a decode at 1 split is one kernel; at 2 splits, split + merge."""
    counter = KernelCounter()
    pool = torch.randn((2, 4, 4, 1, 32), device=DEVICE)
    q, tables = torch.randn((1, 2, 32), device=DEVICE), torch.tensor([[0, 1, 2]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([9], dtype=torch.int32, device=DEVICE)
    rows = torch.tensor([0], dtype=torch.int32, device=DEVICE)
    counter.active = True
    with counting_triton(counter), counter:
        for splits in (1, 2):
            triton_attention.decode_attention(q, pool, tables, lens, rows, torch.empty_like(q), scale=0.1,
                                              num_splits=splits)
    assert counter.ops["triton._decode_split_kernel"] == 2 and counter.ops["triton._merge_splits_kernel"] == 1


if __name__ == "__main__":
    import tempfile

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as root:
        # argv: [dtype [head_dim-128 shape]]
        dtype = sys.argv[1] if len(sys.argv) > 1 else "float32"
        shape = PRESETS["tiny"] if len(sys.argv) < 3 else ModelShape(
            hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=128, tie_word_embeddings=True)
        found = count_decode_layer(write_checkpoint(Path(root) / "m", shape, seed=3), dtype)
        for name, count in sorted(found.ops.items()):
            print(f"{count:3d}  {name}")
        print(f"{found.total:3d}  kernels in one decode layer")
