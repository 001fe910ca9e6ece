"""Which LoRA adapters the engine serves, and where each one's weights are: registered (known by
name and path, checked once), in the host cache (up to `max_cpu_loras`, least recently used
dropped first: read again from disk when needed), in a device slot (up to `max_loras`, least
recently used evicted when a step needs another).

The runner owns it (it turns adapter names into slot indices, as it turns block ids into slots);
the scheduler only counts names, so no step mixes more adapters than there are slots
(`Scheduler.max_loras`). A request names its adapter in `SamplingParams.lora_name`.

Prefix cache: a request's first block hash is chained from its adapter's root (`hash_root`), so
the same prompt under two adapters, or under the base model, never shares a block (the KV differs),
and a block cached by a worker that holds another version of the adapter never matches either.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import torch

from pdserve.config import LoRAConfig
from pdserve.engine.request import Request
from pdserve.model.lora import (
    MODULE_PARTS,
    LoRAAdapter,
    LoRABatch,
    LoRAError,
    LoRALinear,
    SlotShape,
    attach_lora,
    load_adapter,
)
from pdserve.model.qwen3 import Qwen3ForCausalLM

BASE_SLOT = -1  # a row of the base model


@dataclass(frozen=True, slots=True)
class LoRAInfo:
    """A registered adapter as the API lists it and the PD hand-off names it."""

    name: str
    path: str
    digest: str  # adapter_model.safetensors + adapter_config.json (model/lora.py adapter_digest)
    rank: int


def lora_info(value: dict[str, object]) -> LoRAInfo:
    """A `LoRAInfo` from a LoRA command's result (engine/commands.py: a dict, to cross the link)."""
    name, path, digest, rank = value["name"], value["path"], value["digest"], value["rank"]
    if not (isinstance(name, str) and isinstance(path, str) and isinstance(digest, str) and isinstance(rank, int)):
        raise ValueError(f"not a LoRA adapter record: {value!r}")
    return LoRAInfo(name, path, digest, rank)


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """The offline API's adapter choice, as vLLM spells it: `LLM.generate(..., lora_request=
    LoRARequest("sql", 1, "/adapters/sql"))` loads it on first use and runs the prompts under it."""

    lora_name: str
    lora_int_id: int = 0  # vLLM's; pdserve names adapters by lora_name only
    lora_path: str = ""


def lora_name_of(request: Request) -> str | None:
    """The adapter a request runs under (None: the base model). The one place that answers it:
    KV events, metrics and the scheduler ask here."""
    return request.params.lora_name


def hash_root(info: LoRAInfo | None) -> bytes:
    """The parent of a request's first block hash: empty for the base model, else the adapter's
    name and digest folded in (engine/kv_cache_manager.py chains every later block from it)."""
    if info is None:
        return b""
    return hashlib.blake2b(f"lora:{info.name}:{info.digest}".encode(), digest_size=16).digest()


class LoRAManager:
    """Contract: every method runs on the engine thread (between steps); `add` and `remove` are
    all-or-nothing (an adapter that fails its checks leaves nothing registered or loaded)."""

    def __init__(self, config: LoRAConfig, model: Qwen3ForCausalLM, max_tokens: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.config = config
        self.model_cfg = model.cfg
        self.batch = LoRABatch(max_tokens, config.max_loras, device, use_kernel=device.type == "cuda")
        shape = SlotShape(config.max_loras, config.max_lora_rank, dtype, device)
        self.modules: dict[tuple[int, str], LoRALinear] = attach_lora(model, model.cfg, shape, self.batch)
        self.registered: dict[str, LoRAInfo] = {}
        self._host: OrderedDict[str, LoRAAdapter] = OrderedDict()  # least recently used first
        self._slots: OrderedDict[str, int] = OrderedDict()  # adapter -> slot, least recently used first
        self.num_slot_loads = 0
        for name, path in config.modules:
            self.add(name, path)

    def add(self, name: str, path: str) -> LoRAInfo:
        """Read, check and register adapter `name`; raises LoRAError (a ValueError) naming it."""
        if name in self.registered:
            raise LoRAError(f"LoRA adapter {name!r} is already loaded")
        adapter = load_adapter(name, path, self.model_cfg, self.config.max_lora_rank)
        info = LoRAInfo(name, path, adapter.digest, adapter.rank)
        self.registered[name] = info
        self._cache(adapter)
        return info

    def remove(self, name: str) -> None:
        """Forget adapter `name` (its slot is cleared); raises LoRAError when it is not loaded."""
        if self.registered.pop(name, None) is None:
            raise LoRAError(f"LoRA adapter {name!r} is not loaded")
        self._host.pop(name, None)
        slot = self._slots.pop(name, None)
        if slot is not None:
            for module in self.modules.values():
                module.clear_slot(slot)

    def info(self, name: str) -> LoRAInfo:
        if name not in self.registered:
            raise LoRAError(f"LoRA adapter {name!r} is not loaded")
        return self.registered[name]

    @property
    def slot_names(self) -> list[str]:
        return list(self._slots)

    def prepare(self, row_names: list[str | None]) -> None:
        """Give every adapter of this step a slot and point each row at its slot (None: base)."""
        wanted = {name for name in row_names if name is not None}
        if len(wanted) > self.config.max_loras:
            raise ValueError(f"a step mixes {len(wanted)} LoRA adapters, more than --max-loras {self.config.max_loras}")
        slot_of = {name: self._slot(name, wanted) for name in wanted}
        self.batch.set_rows([BASE_SLOT if name is None else slot_of[name] for name in row_names])

    def _slot(self, name: str, keep: set[str]) -> int:
        if name in self._slots:
            self._slots.move_to_end(name)
            return self._slots[name]
        used = set(self._slots.values())
        free = [slot for slot in range(self.config.max_loras) if slot not in used]
        if free:
            slot = free[0]
        else:  # NOTE: the least recently used adapter this step does not need (there is one: len(keep) <= slots)
            victim = next(n for n in self._slots if n not in keep)
            slot = self._slots.pop(victim)
        adapter = self._adapter(name)
        for (layer, module_name), module in self.modules.items():
            parts = [adapter.weights.get((layer, part)) for part in MODULE_PARTS[module_name]]
            module.load_slot(slot, parts, adapter.scaling)
        self._slots[name] = slot
        self.num_slot_loads += 1
        return slot

    def _adapter(self, name: str) -> LoRAAdapter:
        """From the host cache, or read again from disk (it must be the adapter registered)."""
        if name in self._host:
            self._host.move_to_end(name)
            return self._host[name]
        info = self.info(name)
        adapter = load_adapter(name, info.path, self.model_cfg, self.config.max_lora_rank)
        if adapter.digest != info.digest:
            raise LoRAError(f"LoRA adapter {name!r} at {info.path} changed on disk since it was loaded")
        self._cache(adapter)
        return adapter

    def _cache(self, adapter: LoRAAdapter) -> None:
        self._host[adapter.name] = adapter
        while len(self._host) > self.config.max_cpu_loras:
            self._host.popitem(last=False)
