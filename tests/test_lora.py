"""LoRA adapters offline: one batch mixing two adapters and the base model equals transformers +
PEFT (each adapter merged with merge_and_unload) token for token, logprobs to float32 rounding;
dense Qwen3 with every target, MoE with attention targets only (expert LoRA is not served). Bad
adapters are refused by name with nothing left registered; slots and the host cache evict least
recently used; the prefix cache never shares KV across adapters; the Triton kernel equals the
torch math (interpreter, float32)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import (
    assert_no_leak,
    assert_scheduler_clean,
    greedy,
    make_request,
    make_scheduler,
    random_prompt,
    run_to_completion,
    token_prompts,
)
from lora_helpers import PeftReference, write_lora_models
from safetensors.torch import load_file, save_file

from pdserve import LLM, LoRARequest
from pdserve.model.lora import LoRAError, load_adapter
from pdserve.model.qwen3_config import Qwen3ModelConfig

MAX_TOKENS = 8
PROMPTS = [random_prompt(n, seed=4700 + n) for n in (5, 19, 45)]  # 45: two chunks of 32
ENGINE = {"dtype": "float32", "num_kv_blocks": 96, "max_num_batched_tokens": 32, "enable_lora": True,
          "max_lora_rank": 16}
@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, Path]]]:
    """kind -> (checkpoint, adapter name -> directory)."""
    return write_lora_models(tmp_path_factory.mktemp("lora"))


@pytest.fixture(scope="module")
def references(models: dict[str, tuple[Path, dict[str, Path]]]) -> Iterator[dict[str, PeftReference]]:
    yield {kind: PeftReference(model_dir) for kind, (model_dir, _) in models.items()}


def _llm(model_dir: Path, adapters: dict[str, Path], **args: object) -> LLM:
    modules = tuple(f"{name}={path}" for name, path in adapters.items())
    return LLM(model=str(model_dir), **{**ENGINE, "lora_modules": modules, "max_loras": 2, **args})


def _check_against_peft(llm: LLM, reference: PeftReference, adapters: dict[str, Path],
                        batch: list[tuple[list[int], str | None]]) -> None:
    """One generate call (one batch) of `batch` (prompt, adapter name or None) equals the reference."""
    loras = [None if name is None else LoRARequest(name) for _, name in batch]
    outputs = llm.generate(token_prompts([p for p, _ in batch]), greedy(MAX_TOKENS, logprobs=0), lora_request=loras)
    base_tokens = {}
    for (prompt, name), output in zip(batch, outputs, strict=True):
        adapter = None if name is None else adapters[name]
        got = output.outputs[0]
        expected = reference.greedy(adapter, prompt, MAX_TOKENS)
        assert got.token_ids == expected, f"adapter {name}: {got.token_ids} != {expected}"
        ref = reference.logprobs(adapter, prompt + expected)
        assert got.logprobs is not None
        for index, (token, entry) in enumerate(zip(expected, got.logprobs, strict=True)):
            assert abs(entry.logprob - float(ref[len(prompt) - 1 + index, token])) < 2e-4, (name, index)
        if name is None:
            base_tokens[tuple(prompt)] = expected
    # the adapters change what is generated (else the test could not tell them from the base model)
    for (prompt, name), output in zip(batch, outputs, strict=True):
        if name is not None and tuple(prompt) in base_tokens:
            assert output.outputs[0].token_ids != base_tokens[tuple(prompt)], name


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_mixed_batch_equals_transformers_peft(kind: str, models: dict[str, tuple[Path, dict[str, Path]]],
                                              references: dict[str, PeftReference]) -> None:
    model_dir, adapters = models[kind]
    llm = _llm(model_dir, adapters)
    batch: list[tuple[list[int], str | None]] = [(PROMPTS[2], None), (PROMPTS[2], "sql"), (PROMPTS[2], "chat"),
                                                  (PROMPTS[0], "sql"), (PROMPTS[1], None), (PROMPTS[1], "chat")]
    _check_against_peft(llm, references[kind], adapters, batch)
    # again, adapters swapped around: the prompts' blocks are cached now, each under its own adapter
    rotated = [(prompt, {None: "sql", "sql": "chat", "chat": None}[name]) for prompt, name in batch]
    _check_against_peft(llm, references[kind], adapters, rotated)
    assert_no_leak(llm)


@pytest.mark.slow
@pytest.mark.parametrize("path", ["triton", "gather"])
def test_other_lora_paths_through_the_model(path: str, models: dict[str, tuple[Path, dict[str, Path]]],
                                            references: dict[str, PeftReference]) -> None:
    """The CUDA path's kernel (here in Triton's interpreter: it reads the persistent per-token slot
    index) and the torch path's gather variant, in place of the segments: the same tokens and logprobs."""
    model_dir, adapters = models["dense"]
    llm = _llm(model_dir, adapters)
    assert llm.engine.lora is not None
    if path == "triton":
        llm.engine.lora.batch.use_kernel = True
    else:
        llm.engine.lora.batch.torch_path = "gather"
    batch: list[tuple[list[int], str | None]] = [(PROMPTS[1], None), (PROMPTS[1], "sql"), (PROMPTS[0], "chat")]
    _check_against_peft(llm, references["dense"], adapters, batch)
    assert_no_leak(llm)


@pytest.mark.slow
def test_one_slot_serves_two_adapters_in_turn(models: dict[str, tuple[Path, dict[str, Path]]],
                                              references: dict[str, PeftReference]) -> None:
    """--max-loras 1, --max-cpu-loras 1: the scheduler never mixes two adapters in a step; each
    takes the slot in turn (the other evicted, read again from disk), the base model runs beside."""
    model_dir, adapters = models["dense"]
    llm = _llm(model_dir, adapters, max_loras=1, max_cpu_loras=1)
    batch: list[tuple[list[int], str | None]] = [(PROMPTS[1], "sql"), (PROMPTS[1], "chat"), (PROMPTS[0], None),
                                                  (PROMPTS[0], "chat"), (PROMPTS[0], "sql")]
    _check_against_peft(llm, references["dense"], adapters, batch)
    manager = llm.engine.lora
    assert manager is not None and manager.num_slot_loads >= 3 and len(manager.slot_names) == 1
    assert_no_leak(llm)


@pytest.mark.slow
def test_prefix_cache_is_keyed_by_adapter(models: dict[str, tuple[Path, dict[str, Path]]]) -> None:
    model_dir, adapters = models["dense"]
    llm = _llm(model_dir, adapters, block_size=4)
    prompt = PROMPTS[1]
    llm.generate(token_prompts([prompt]), greedy(1), lora_request=LoRARequest("sql"))
    engine = llm.engine
    assert engine.num_cached_prefix_tokens(prompt, "sql") == 16
    assert engine.num_cached_prefix_tokens(prompt) == 0 and engine.num_cached_prefix_tokens(prompt, "chat") == 0
    llm.generate(token_prompts([prompt]), greedy(1))
    assert engine.num_cached_prefix_tokens(prompt) == 16
    assert_no_leak(llm)


# -- bad adapters ----------------------------------------------------------------------------------

def _copy_adapter(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for file in src.iterdir():
        (dst / file.name).write_bytes(file.read_bytes())
    return dst


def _bad_adapters(src: Path, root: Path) -> dict[str, tuple[Path, str]]:
    """name -> (directory, what the error must say)."""
    bad: dict[str, tuple[Path, str]] = {}
    big = _copy_adapter(src, root / "big-rank")
    config = json.loads((big / "adapter_config.json").read_text())
    (big / "adapter_config.json").write_text(json.dumps({**config, "r": 32}))
    bad["big-rank"] = (big, "rank 32 is outside [1, --max-lora-rank 16]")
    unknown = _copy_adapter(src, root / "unknown-target")
    (unknown / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj", "lm_head"]}))
    bad["unknown-target"] = (unknown, "targets lm_head")
    shape = _copy_adapter(src, root / "wrong-shape")
    tensors = load_file(str(shape / "adapter_model.safetensors"))
    key = next(k for k in tensors if k.endswith("q_proj.lora_B.weight"))
    tensors[key] = tensors[key][:-1].contiguous()
    save_file(tensors, str(shape / "adapter_model.safetensors"))
    bad["wrong-shape"] = (shape, "has shape")
    corrupt = _copy_adapter(src, root / "corrupt")
    data = (corrupt / "adapter_model.safetensors").read_bytes()
    (corrupt / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    bad["corrupt"] = (corrupt, "cannot be read")
    missing = _copy_adapter(src, root / "missing")
    (missing / "adapter_model.safetensors").unlink()
    bad["missing"] = (missing, "adapter_model.safetensors is missing")
    return bad


@pytest.mark.slow
def test_bad_adapters_are_refused_by_name(models: dict[str, tuple[Path, dict[str, Path]]],
                                          tmp_path: Path) -> None:
    model_dir, adapters = models["dense"]
    cfg = Qwen3ModelConfig.from_dir(model_dir)
    moe_dir, moe_adapters = models["moe"]
    with pytest.raises(LoRAError, match="'experts' at .*mixture of experts"):  # dense MLP targets on a MoE layer
        load_adapter("experts", str(adapters["sql"]), Qwen3ModelConfig.from_dir(moe_dir), 16)
    llm = _llm(model_dir, {"sql": adapters["sql"]})
    engine = llm.engine
    before = [info.name for info in engine.list_loras()]
    for name, (path, reason) in _bad_adapters(adapters["sql"], tmp_path).items():
        with pytest.raises(LoRAError, match=f"'{name}' at .*{re.escape(reason)}"):
            load_adapter(name, str(path), cfg, 16)
        with pytest.raises(LoRAError, match=f"'{name}'"):
            engine.add_lora(name, str(path))
        assert [info.name for info in engine.list_loras()] == before
    with pytest.raises(LoRAError, match="'sql' is already loaded"):
        engine.add_lora("sql", str(adapters["chat"]))
    with pytest.raises(ValueError, match="'nope' is not loaded"):
        llm.generate(token_prompts([PROMPTS[0]]), greedy(2), lora_request=LoRARequest("nope"))
    # still serving: the base model and the good adapter
    outputs = llm.generate(token_prompts([PROMPTS[0]] * 2), greedy(2), lora_request=[None, LoRARequest("sql")])
    assert all(len(o.outputs[0].token_ids) == 2 for o in outputs)
    # loaded at run time by path, unloaded once unused
    llm.generate(token_prompts([PROMPTS[0]]), greedy(2), lora_request=LoRARequest("chat", 2, str(adapters["chat"])))
    assert sorted(info.name for info in engine.list_loras()) == ["chat", "sql"]
    engine.remove_lora("chat")
    with pytest.raises(LoRAError, match="'chat' is not loaded"):
        engine.remove_lora("chat")
    assert moe_adapters  # the MoE adapters themselves load (attention targets), see the parity test
    assert_no_leak(llm)


# -- the Triton kernel -----------------------------------------------------------------------------

def test_triton_kernel_equals_torch_math() -> None:
    from pdserve.model.triton_lora import add_lora

    gen = torch.Generator().manual_seed(5)
    num_tokens, k, n, slots, width = 11, 80, 72, 3, 2 * 16
    x = torch.randn(num_tokens, k, generator=gen)
    out = torch.randn(num_tokens, n, generator=gen)
    lora_a = torch.randn(slots, width, k, generator=gen)
    lora_bt = torch.randn(slots, width, n, generator=gen)
    token_slots = torch.tensor([0, -1, 2, 2, 1, -1, 0, 0, 1, 2, -1], dtype=torch.int32)
    expected = out.clone()
    for t, s in enumerate(token_slots.tolist()):
        if s >= 0:
            expected[t] += (lora_a[s] @ x[t]) @ lora_bt[s]
    add_lora(x, out, lora_a, lora_bt, token_slots)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.slow
def test_the_cost_benchmark_prints_its_rows(capsys: pytest.CaptureFixture[str]) -> None:
    from pdserve.bench import lora

    # NOTE: --threads 1, as conftest set: torch's thread count is process-wide, and a later test's
    # bitwise comparison (test_moe_capture_safe) depends on it
    argv = ["--preset", "tiny", "--num-seqs", "6", "--prompt-len", "8", "--output-len", "4", "--rounds", "1",
            "--threads", "1"]
    assert lora.main(argv) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]
    assert [row[0].strip() for row in rows] == [
        "base model, no LoRA", "LoRA engine, every request on the base", "mixed: 2 adapters + base, segments",
        "mixed: 2 adapters + base, gather"]
    assert all(float(row[1]) > 0 for row in rows) and float(rows[0][2]) == 1.0


# -- the scheduler ---------------------------------------------------------------------------------

def test_no_step_mixes_more_adapters_than_slots() -> None:
    """Scheduler only: requests of 4 adapters and of the base model, 2 slots; every step's adapters
    fit the slots, every request finishes, and nothing is left behind."""
    scheduler = make_scheduler(num_blocks=64, max_num_seqs=8)
    scheduler.max_loras = 2
    names = [None, "a", "b", "c", "d", "a", None, "c", "b", "d"]
    for index, name in enumerate(names):
        scheduler.add_request(make_request(f"r{index}", 6, max_tokens=3, lora_name=name))
    steps = run_to_completion(scheduler)
    mixed = [{c.request.params.lora_name for c in out.chunks} - {None} for out in steps]
    assert max(len(adapters) for adapters in mixed) == 2 and all(len(adapters) <= 2 for adapters in mixed)
    assert len(mixed) > 3  # held back, not dropped: the adapters took turns
    assert_scheduler_clean(scheduler)
