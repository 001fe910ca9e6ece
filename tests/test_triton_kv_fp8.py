"""An FP8 KV cache on the CUDA backend's path (Triton kernels: on CPU in the interpreter, on a GPU
with its decode CUDA graphs): the
kernels quantize and read the pool with the checkpoint's per-layer scales themselves; no step
gathers and dequantizes a context in torch (model/attention.py), and greedy tokens and the pool's
bytes are those of the torch path with the same pool."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import with_scales

pytest.importorskip("triton")

from pdserve import LLM, SamplingParams  # noqa: E402
from pdserve.model import attention  # noqa: E402

BLOCK_SIZE = 4
CUDA = torch.cuda.is_available()


def _llm(model_dir: Path, fp8: str, device: str = "cpu") -> LLM:
    return LLM(model=str(model_dir), device=device, dtype="float32", num_kv_blocks=64, block_size=BLOCK_SIZE,
               max_num_seqs=8, max_model_len=128, max_num_batched_tokens=16, kv_cache_dtype=fp8)


@pytest.mark.parametrize("fp8", ["fp8", "fp8_e5m2"])
def test_fp8_pool_on_the_triton_path_gives_the_torch_paths_tokens_and_bytes(
        fp8: str, model_dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scaled = with_scales(model_dirs["tiny"], tmp_path / "scaled", [0.5, 2.0], [3.0, 0.25])
    # prefix cache hits, chunked prefill (16-token steps), decodes joining and leaving
    prompts = [{"prompt_token_ids": ids} for ids in (list(range(10, 40)), list(range(10, 40)) + [7, 8, 9],
                                                     list(range(50, 53)))]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    torch_path = _llm(scaled, fp8)
    expected = [o.outputs[0].token_ids for o in torch_path.generate(prompts, params)]

    triton_path = _llm(scaled, fp8, "cuda" if CUDA else "cpu")
    runner = triton_path.engine.runner
    if not CUDA:
        runner.use_paged_step(graphs=True)  # what CUDA runs, decode steps padded to their bucket
    assert runner.step_buffers is not None and runner.step_buffers.kv_quant is not None

    def no_torch_dequantize(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("the Triton path dequantized a context in torch")

    monkeypatch.setattr(attention, "dequantize", no_torch_dequantize)
    got = [o.outputs[0].token_ids for o in triton_path.generate(prompts, params)]
    assert got == expected
    want, have = torch_path.engine.runner.kv_cache.view(torch.uint8), runner.kv_cache.view(torch.uint8).cpu()
    written = (want != 0) | (have != 0)
    assert written.sum() > 1000
    # NOTE: float32 K/V from the fused kernels may round across an FP8 boundary, very rarely
    assert (want == have)[written].float().mean() > 0.999
