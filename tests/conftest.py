"""Session fixtures: random Qwen3 checkpoints (written once), cached LLM instances, and a cached
Hugging Face reference for greedy outputs and logits."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve import LLM
from pdserve.model.demo_checkpoint import PRESETS, ModelShape, write_checkpoint

# NOTE: tiny matmuls on two OpenMP threads are ~100x slower than on one in small VMs (thread
# wake-ups dominate); one thread keeps the suite fast and changes no result (fp32, same kernels
# for pdserve and the reference).
torch.set_num_threads(1)
# NOTE: without a GPU, Triton kernels (the CUDA attention backend's) run in Triton's interpreter on CPU
# tensors; it is chosen when a kernel is defined, so before any test module imports one
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# name -> (shape, weight seed, max_shard_bytes)
MODEL_SPECS: dict[str, tuple[ModelShape, int, int | None]] = {
    # tied embeddings, head_dim 32 != hidden / heads = 16, GQA 4 query heads / 2 KV heads, one file
    "tiny": (PRESETS["tiny"], 1, None),
    # untied head, a single KV head (GQA 4/1), head_dim 48 != 128 / 4, written in several shards
    "untied": (ModelShape(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                          num_key_value_heads=1, head_dim=48, tie_word_embeddings=False), 2, 20_000_000),
}
MODEL_NAMES = tuple(MODEL_SPECS)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    dirs = {}
    for name, (shape, seed, max_shard_bytes) in MODEL_SPECS.items():
        dirs[name] = write_checkpoint(root / name, shape, seed=seed, max_shard_bytes=max_shard_bytes)
    assert len(list(dirs["untied"].glob("model-*-of-*.safetensors"))) > 1, "the untied checkpoint must be sharded"
    return dirs


_CACHED_LLMS = 6


@pytest.fixture(scope="session")
def llm_factory(model_dirs: dict[str, Path]) -> Iterator[Callable[..., LLM]]:
    """`llm_factory("tiny", block_size=32)`: one LLM per (model, settings), the last few kept for
    the session (each holds its weights and buffers: caching every one the suite asks for took the
    test process past 14 GiB). Defaults: float32 and a 512-block pool (the default pool is 2 GiB)."""
    cache: OrderedDict[tuple[str, tuple[tuple[str, Any], ...]], LLM] = OrderedDict()

    def get(name: str, **engine_args: Any) -> LLM:
        args = {"dtype": "float32", "num_kv_blocks": 512, **engine_args}
        key = (name, tuple(sorted(args.items())))
        if key not in cache:
            cache[key] = LLM(model=str(model_dirs[name]), **args)
            while len(cache) > _CACHED_LLMS:
                cache.popitem(last=False)
        cache.move_to_end(key)
        return cache[key]

    yield get
    cache.clear()


@pytest.fixture(scope="session")
def colocated(llm_factory: Callable[..., LLM]) -> LLM:
    """The colocated engine on the `tiny` model: the reference every PD and router test compares to."""
    return llm_factory("tiny")


# NOTE: on a machine with a GPU, pdserve's `device auto` runs the engine there; the reference runs on
# the same device, so the suite then checks the CUDA path against transformers on CUDA.
REFERENCE_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


class HFReference:
    """transformers' Qwen3 in float32: greedy continuations and logits, cached per (model, prompt)."""

    def __init__(self, model_dirs: dict[str, Path]) -> None:
        self._dirs = model_dirs
        self._models: dict[str, Any] = {}
        self._greedy: dict[tuple[str, tuple[int, ...], int], list[int]] = {}

    def model(self, name: str) -> Any:
        if name not in self._models:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(str(self._dirs[name]), dtype=torch.float32)
            model = model.to(REFERENCE_DEVICE).eval()
            # NOTE: never stop early; pdserve runs these with ignore_eos.
            model.generation_config.eos_token_id = None
            model.generation_config.pad_token_id = 0
            self._models[name] = model
        return self._models[name]

    def greedy(self, name: str, prompt: list[int], max_new_tokens: int) -> list[int]:
        key = (name, tuple(prompt), max_new_tokens)
        if key not in self._greedy:
            with torch.inference_mode():
                prompt_ids = torch.tensor([prompt], device=REFERENCE_DEVICE)
                out = self.model(name).generate(prompt_ids, max_new_tokens=max_new_tokens, do_sample=False,
                                                eos_token_id=None)
            tokens = out[0, len(prompt):].tolist()
            assert len(tokens) == max_new_tokens
            self._greedy[key] = tokens
        return self._greedy[key]

    def logprobs(self, name: str, token_ids: list[int]) -> torch.Tensor:
        """[len(token_ids), vocab] log-softmax of the next-token logits after each position."""
        with torch.inference_mode():
            logits = self.model(name)(torch.tensor([token_ids], device=REFERENCE_DEVICE)).logits[0].float().cpu()
        return torch.log_softmax(logits, dim=-1)


@pytest.fixture(scope="session")
def hf_reference(model_dirs: dict[str, Path]) -> HFReference:
    return HFReference(model_dirs)


@pytest.fixture(autouse=True, scope="module")
def _release_memory_after_each_module() -> Iterator[None]:
    """Engines, tokenizers and clusters a module made are garbage once it ends: collect the cycles
    they sit in (threads, callbacks) and hand the freed heap back, so a ~1,000-test run in one
    process stays within a small CI machine's memory."""
    yield
    gc.collect()
    if sys.platform == "linux":
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)
