"""LoRA test helpers: tiny random adapters written by PEFT itself, and transformers + PEFT (the
adapter merged with `merge_and_unload`) as the reference for greedy tokens and logprobs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from conftest import REFERENCE_DEVICE

from pdserve.model.demo_checkpoint import PRESETS, write_checkpoint


def write_adapter(model_dir: Path, out: Path, targets: list[str], rank: int, *, alpha: float = 16.0,
                  rslora: bool = False, seed: int = 0, scale: float = 0.3) -> Path:
    """A PEFT LoRA adapter over the checkpoint at `model_dir`, its A and B drawn at random (PEFT
    initialises B to zero: the adapter would change nothing) large enough to change greedy tokens."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                                            lora_dropout=0.0))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * scale * param.shape[-1] ** -0.5)
    model.save_pretrained(str(out))
    return out


# name -> (targets, rank, rslora): every target on dense Qwen3, attention targets only on MoE
DENSE_ADAPTERS = {"sql": (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 8, False),
                  "chat": (["q_proj", "v_proj", "o_proj", "down_proj"], 16, True)}
MOE_ADAPTERS = {"sql": (["q_proj", "k_proj", "v_proj", "o_proj"], 8, False), "chat": (["q_proj", "o_proj"], 4, True)}


def write_lora_models(root: Path) -> dict[str, tuple[Path, dict[str, Path]]]:
    """kind ("dense": tiny, "moe": tiny-moe) -> (checkpoint, adapter name -> directory)."""
    out = {}
    for kind, preset, specs in (("dense", "tiny", DENSE_ADAPTERS), ("moe", "tiny-moe", MOE_ADAPTERS)):
        model_dir = write_checkpoint(root / kind, PRESETS[preset], seed=21)
        adapters = {name: write_adapter(model_dir, root / f"{kind}-{name}", targets, rank, rslora=rslora, seed=seed)
                    for seed, (name, (targets, rank, rslora)) in enumerate(specs.items())}
        out[kind] = (model_dir, adapters)
    return out


class PeftReference:
    """transformers' model with one adapter merged in (or none), float32, per adapter directory."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self._models: dict[Path | None, Any] = {}

    def model(self, adapter: Path | None) -> Any:
        if adapter not in self._models:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(str(self.model_dir), dtype=torch.float32)
            if adapter is not None:
                from peft import PeftModel

                model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
            model = model.to(REFERENCE_DEVICE).eval()
            model.generation_config.eos_token_id = None
            model.generation_config.pad_token_id = 0
            self._models[adapter] = model
        return self._models[adapter]

    def greedy(self, adapter: Path | None, prompt: list[int], max_new_tokens: int) -> list[int]:
        with torch.inference_mode():
            ids = torch.tensor([prompt], device=REFERENCE_DEVICE)
            out = self.model(adapter).generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None)
        return out[0, len(prompt):].tolist()

    def logprobs(self, adapter: Path | None, token_ids: list[int]) -> torch.Tensor:
        """[len(token_ids), vocab] log-softmax of the next-token logits after each position."""
        with torch.inference_mode():
            logits = self.model(adapter)(torch.tensor([token_ids], device=REFERENCE_DEVICE)).logits[0]
        return torch.log_softmax(logits.float().cpu(), dim=-1)
