"""LoRA adapters (PEFT format) over the Qwen3 projections, applied per token in a mixed batch.

An adapter is a directory as PEFT's `save_pretrained` writes it: `adapter_config.json` (r,
lora_alpha, use_rslora, target_modules) and `adapter_model.safetensors` (for each adapted
projection P of layer L, `...layers.L.{self_attn|mlp}.P.lora_A.weight` [r, in] and `lora_B.weight`
[out, r]). Its delta on a projection is `scaling * B @ A` (scaling = alpha / r, or alpha / sqrt(r)
with rsLoRA), added to the base projection's output: `y = W x + scaling * B (A x)`.

Slots. Each wrapped projection (`LoRALinear`) holds every adapter slot's weights stacked, sized
once for `max_loras` slots of rank `max_rank`, so what a CUDA graph captured reads the same tensors
whatever is loaded; loading an adapter into a slot copies into them. A fused projection (qkv_proj,
gate_up_proj) stacks its parts' ranks, each part writing only its own output columns:

    lora_a  [slots, parts * R, in]         rows p*R .. p*R + r: part p's A (zeros past its rank r)
    lora_bt [slots, parts * R, out]        rows p*R .. p*R + r, columns of part p: (scaling * B_p)^T,
                                           zeros elsewhere (block diagonal)
    delta[t] = (x[t] @ lora_a[s].T) @ lora_bt[s]       s = the token's slot (-1: the base model, no delta)

Which slot each token uses is the step's `LoRABatch` (the runner fills it, the model only reads it).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from pdserve.model.qwen3_config import Qwen3ModelConfig

# target -> (its block in a decoder layer, the pdserve module holding it, its part of that module)
TARGETS: dict[str, tuple[str, str, int]] = {
    "q_proj": ("self_attn", "qkv_proj", 0),
    "k_proj": ("self_attn", "qkv_proj", 1),
    "v_proj": ("self_attn", "qkv_proj", 2),
    "o_proj": ("self_attn", "o_proj", 0),
    "gate_proj": ("mlp", "gate_up_proj", 0),
    "up_proj": ("mlp", "gate_up_proj", 1),
    "down_proj": ("mlp", "down_proj", 0),
}
MODULE_PARTS: dict[str, tuple[str, ...]] = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
                                            "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


class LoRAError(ValueError):
    """An adapter that cannot be served; the message starts with its name."""


@dataclass(frozen=True, slots=True)
class LoRAAdapter:
    """One adapter read and checked against the model, held on the host (the CPU cache)."""

    name: str
    path: str
    rank: int
    scaling: float
    digest: str  # blake2b of its config and weights files: the same adapter on every worker
    # (layer, target) -> (A [r, in], B [out, r]), float32 on the host
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)


def target_shapes(cfg: Qwen3ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each target on a dense layer of `cfg`."""
    h, q, kv, i = (cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim,
                   cfg.intermediate_size)
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
            "up_proj": (h, i), "down_proj": (i, h)}


def adapter_digest(path: Path) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        digest.update((path / name).read_bytes())
    return digest.hexdigest()


def load_adapter(name: str, path: str, cfg: Qwen3ModelConfig, max_rank: int) -> LoRAAdapter:
    """Read and check adapter `name` at `path` against the model; raises LoRAError naming it."""
    try:
        return _load(name, Path(path), cfg, max_rank)
    except LoRAError:
        raise
    except (OSError, ValueError, SafetensorError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise LoRAError(f"LoRA adapter {name!r} at {path}: cannot be read: {exc}") from exc


def _load(name: str, path: Path, cfg: Qwen3ModelConfig, max_rank: int) -> LoRAAdapter:
    def fail(reason: str) -> LoRAError:
        return LoRAError(f"LoRA adapter {name!r} at {path}: {reason}")

    for file in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (path / file).is_file():
            raise fail(f"{file} is missing")
    config = json.loads((path / ADAPTER_CONFIG).read_text())
    if not isinstance(config, dict):
        raise fail(f"{ADAPTER_CONFIG} is not a JSON object")
    rank, alpha = int(config.get("r") or 0), float(config.get("lora_alpha") or config.get("r") or 0)
    if config.get("peft_type", "LORA") != "LORA":
        raise fail(f"peft_type {config.get('peft_type')!r} is not LORA")
    if not 1 <= rank <= max_rank:
        raise fail(f"rank {rank} is outside [1, --max-lora-rank {max_rank}]")
    unsupported = [key for key in ("use_dora", "fan_in_fan_out", "modules_to_save", "rank_pattern", "alpha_pattern",
                                   "lora_bias") if config.get(key)]
    if config.get("bias", "none") != "none":
        unsupported.append("bias")
    if unsupported:
        raise fail(f"uses {', '.join(unsupported)}, which pdserve does not serve")
    targets = config.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    unknown = sorted(t for t in targets if t not in TARGETS)
    if unknown:
        raise fail(f"targets {', '.join(unknown)}: Qwen3 LoRA targets are {', '.join(TARGETS)}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights = _read_weights(path / ADAPTER_WEIGHTS, cfg, rank, fail)
    return LoRAAdapter(name, str(path), rank, scaling, adapter_digest(path), weights)


def _read_weights(file: Path, cfg: Qwen3ModelConfig, rank: int,
                  fail: Callable[[str], LoRAError]) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    shapes = target_shapes(cfg)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(file), framework="pt") as tensors:
        for key in tensors.keys():  # noqa: SIM118 - safe_open is not a mapping
            layer, target, half = _parse_key(key, cfg, fail)
            in_features, out_features = shapes[target]
            expected = (rank, in_features) if half == "A" else (out_features, rank)
            tensor = tensors.get_tensor(key)
            if tuple(tensor.shape) != expected:
                raise fail(f"tensor {key!r} has shape {tuple(tensor.shape)}, expected {expected}")
            if not torch.isfinite(tensor).all():
                raise fail(f"tensor {key!r} holds NaN or infinite values")
            halves.setdefault((layer, target), {})[half] = tensor.float()
    weights = {}
    for (layer, target), pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise fail(f"layer {layer} {target} has lora_{next(iter(pair))} without its other half")
        weights[(layer, target)] = (pair["A"], pair["B"])
    if not weights:
        raise fail("holds no LoRA weights")
    return weights


def _parse_key(key: str, cfg: Qwen3ModelConfig, fail: Callable[[str], LoRAError]) -> tuple[int, str, str]:
    """(layer, target, "A" | "B") of a PEFT tensor name, checked against the model."""
    match = _KEY.match(key)
    if match is None:
        raise fail(f"unexpected tensor {key!r} (only lora_A/lora_B of {', '.join(TARGETS)})")
    layer, block, target, half = int(match[1]), match[2], match[3], match[4]
    if target not in TARGETS or TARGETS[target][0] != block:
        raise fail(f"tensor {key!r}: {block}.{target} is not a Qwen3 LoRA target")
    if not 0 <= layer < cfg.num_hidden_layers:
        raise fail(f"tensor {key!r}: the model has {cfg.num_hidden_layers} layers")
    if block == "mlp" and cfg.is_sparse(layer):
        raise fail(f"tensor {key!r}: layer {layer}'s MLP is a mixture of experts (expert LoRA is not supported; "
                   "target attention projections)")
    return layer, target, half


@dataclass(frozen=True, slots=True)
class SlotShape:
    """What every projection's slots are sized for."""

    max_loras: int
    max_rank: int
    dtype: torch.dtype
    device: torch.device


class LoRABatch:
    """Which adapter slot each row of the step uses. Filled by the runner (`set_rows`) before the
    forward, read by every `LoRALinear`.

    `token_slots` [max_tokens] int32 keeps its address for the engine's life (a CUDA graph reads
    it); -1 for a row of the base model (and the padding rows of a graph). `use_kernel`: the Triton
    kernel reads `token_slots` (CUDA, capturable); else the torch path runs over `segments`, each
    slot's rows as found on the host this step (no host sync in the forward)."""

    def __init__(self, max_tokens: int, max_loras: int, device: torch.device, use_kernel: bool) -> None:
        self.token_slots = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)
        self.max_loras = max_loras
        self.use_kernel = use_kernel
        # the torch path: "segments" (one matmul pair per adapter over its rows) or "gather" (each
        # row's A and B gathered, one batched matmul pair); bench/lora.py measures both
        self.torch_path = "segments"
        self.segments: list[tuple[int, slice | torch.Tensor]] = []
        self._lora_rows = torch.zeros(0, dtype=torch.long)  # "gather": the rows under an adapter ...
        self._row_slots = torch.zeros(0, dtype=torch.long)  # ... and their slots

    def set_rows(self, slot_of_row: list[int]) -> None:
        """`slot_of_row[r]`: row r's slot, -1 for the base model."""
        if len(slot_of_row) > self.token_slots.shape[0]:
            raise ValueError(f"a step of {len(slot_of_row)} rows exceeds the LoRA index's {self.token_slots.shape[0]}")
        host = torch.full((self.token_slots.shape[0],), -1, dtype=torch.int32)
        host[:len(slot_of_row)] = torch.tensor(slot_of_row, dtype=torch.int32)
        self.token_slots.copy_(host, non_blocking=True)
        self.segments = _segments(slot_of_row)
        rows = [row for row, slot in enumerate(slot_of_row) if slot >= 0]
        self._lora_rows = torch.tensor(rows, dtype=torch.long)
        self._row_slots = torch.tensor([slot_of_row[row] for row in rows], dtype=torch.long)

    def apply(self, x: torch.Tensor, out: torch.Tensor, lora_a: torch.Tensor, lora_bt: torch.Tensor) -> torch.Tensor:
        """out += each row's delta, in place; returns out."""
        if self.use_kernel:
            from pdserve.model.triton_lora import add_lora

            add_lora(x, out, lora_a, lora_bt, self.token_slots[:x.shape[0]])
            return out
        if self.torch_path == "gather":
            if self._lora_rows.numel():
                xs = x.index_select(0, self._lora_rows)[:, None, :]  # [n, 1, K]
                y = torch.bmm(xs, lora_a.index_select(0, self._row_slots).transpose(1, 2))  # [n, 1, R]
                out.index_add_(0, self._lora_rows, torch.bmm(y, lora_bt.index_select(0, self._row_slots))[:, 0])
            return out
        for slot, rows in self.segments:
            a, bt = lora_a[slot], lora_bt[slot]
            if isinstance(rows, slice):
                out[rows] += (x[rows] @ a.T) @ bt
            else:
                out.index_add_(0, rows, (x.index_select(0, rows) @ a.T) @ bt)
        return out


def _segments(slot_of_row: list[int]) -> list[tuple[int, slice | torch.Tensor]]:
    """Each slot used and its rows: a slice when they are adjacent (a prompt chunk), else their ids."""
    rows_of: dict[int, list[int]] = {}
    for row, slot in enumerate(slot_of_row):
        if slot >= 0:
            rows_of.setdefault(slot, []).append(row)
    segments: list[tuple[int, slice | torch.Tensor]] = []
    for slot, rows in rows_of.items():
        adjacent = rows[-1] - rows[0] + 1 == len(rows)
        segments.append((slot, slice(rows[0], rows[-1] + 1) if adjacent else torch.tensor(rows)))
    return segments


class LoRALinear(nn.Module):
    """A projection (nn.Linear or PackedLinear) plus every slot's LoRA delta on its output."""

    lora_a: torch.Tensor
    lora_bt: torch.Tensor

    def __init__(self, base: nn.Module, in_features: int, part_sizes: tuple[int, ...], shape: SlotShape,
                 batch: LoRABatch) -> None:
        super().__init__()
        self.base = base
        self.batch = batch
        self.max_rank = shape.max_rank
        self.part_offsets = [sum(part_sizes[:p]) for p in range(len(part_sizes))]
        self.part_sizes = part_sizes
        width = len(part_sizes) * shape.max_rank
        for name, columns in (("lora_a", in_features), ("lora_bt", sum(part_sizes))):
            self.register_buffer(name, torch.zeros(shape.max_loras, width, columns, dtype=shape.dtype,
                                                   device=shape.device), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.batch.apply(x, self.base(x), self.lora_a, self.lora_bt)

    def load_slot(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None], scaling: float) -> None:
        """Slot `slot` := these parts' (A [r, in], B [out_p, r]); None: that part unadapted."""
        a, bt = self.lora_a[slot], self.lora_bt[slot]
        a.zero_()
        bt.zero_()
        for part, pair in enumerate(parts):
            if pair is None:
                continue
            lora_a, lora_b = pair
            rank, first, size = lora_a.shape[0], part * self.max_rank, self.part_sizes[part]
            offset = self.part_offsets[part]
            a[first:first + rank].copy_(lora_a)
            bt[first:first + rank, offset:offset + size].copy_((lora_b * scaling).T)

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_bt[slot].zero_()


def attach_lora(model: nn.Module, cfg: Qwen3ModelConfig, shape: SlotShape,
                batch: LoRABatch) -> dict[tuple[int, str], LoRALinear]:
    """Wrap every projection an adapter may target in a `LoRALinear`; (layer, module name) -> it.
    MoE layers' experts are left alone (their MLP is no target)."""
    shapes = target_shapes(cfg)
    wrapped: dict[tuple[int, str], LoRALinear] = {}
    for index, layer in enumerate(model.layers):  # type: ignore[arg-type]
        for module_name, parts in MODULE_PARTS.items():
            block = getattr(layer, TARGETS[parts[0]][0])
            base = getattr(block, module_name, None)
            if base is None or (TARGETS[parts[0]][0] == "mlp" and cfg.is_sparse(index)):
                continue
            wrapper = LoRALinear(base, shapes[parts[0]][0], tuple(shapes[p][1] for p in parts), shape, batch)
            setattr(block, module_name, wrapper)
            wrapped[(index, module_name)] = wrapper
    return wrapped
