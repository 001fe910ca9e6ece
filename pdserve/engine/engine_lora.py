"""The engine's LoRA operations: which adapters it serves, a request's prefix-cache root, the
check a KV hand-off's adapter must pass, and the adapters running and waiting (for
`vllm:lora_requests_info`). `LLMEngine` holds one and delegates to it; the adapters' weights and
slots are the runner's `LoRAManager` (engine/lora_manager.py), None without --enable-lora."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from pdserve.engine.lora_manager import LoRAInfo, LoRAManager, hash_root, lora_name_of
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.model.lora import LoRAError


class EngineLoRA:
    """LoRA as the engine's commands see it. Every method raises `LoRAError` (a ValueError, a 400
    to a client) naming the adapter when it cannot do what it is asked."""

    def __init__(self, manager: LoRAManager | None, scheduler: Scheduler) -> None:
        self.manager = manager
        self.scheduler = scheduler
        if manager is not None:
            scheduler.max_loras = manager.config.max_loras

    @property
    def max_loras(self) -> int:
        return 0 if self.manager is None else self.manager.config.max_loras

    def root(self, params: SamplingParams) -> bytes:
        """The prefix-cache root of a request's adapter (b"": the base model); raises for an
        adapter this engine does not serve."""
        if params.lora_name is None:
            return b""
        if self.manager is None:
            raise LoRAError(f"LoRA adapter {params.lora_name!r} requested, but LoRA is not enabled (--enable-lora)")
        return hash_root(self.manager.info(params.lora_name))

    def serves(self, name: str | None) -> bool:
        return name is None or (self.manager is not None and name in self.manager.registered)

    def add(self, name: str, path: str) -> LoRAInfo:
        """Load and register an adapter (all or nothing)."""
        return self._enabled().add(name, path)

    def remove(self, name: str) -> None:
        """Unregister an adapter no unfinished request runs under."""
        manager = self._enabled()
        manager.info(name)
        users = [r.request_id for r in self.scheduler.requests.values() if lora_name_of(r) == name]
        if users:
            raise LoRAError(f"LoRA adapter {name!r} is in use by {len(users)} request(s); unload it once they end")
        manager.remove(name)

    def list(self) -> list[LoRAInfo]:
        return [] if self.manager is None else list(self.manager.registered.values())

    def check_handoff(self, request: Request, name: str | None, digest: str) -> None:
        """Raises when KV computed under adapter `name` (weights `digest`) is not what this
        request's adapter here would have computed."""
        expected = lora_name_of(request)
        if name != expected:
            raise LoRAError(f"the prompt's KV was computed under LoRA adapter {name!r}, the request runs under "
                            f"{expected!r}")
        if expected is not None and self.manager is not None:
            here = self.manager.info(expected).digest
            if digest != here:
                raise LoRAError(f"LoRA adapter {expected!r} differs between the prefill worker (weights digest "
                                f"{digest or 'unknown'}) and this decode worker ({here}): load the same adapter "
                                "on both")

    def requests_info(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """vllm:lora_requests_info's labels: the adapters of running and of waiting requests."""
        if self.manager is None:
            return (), ()
        sched = self.scheduler

        def names(requests: Iterable[Request]) -> tuple[str, ...]:
            return tuple(sorted({name for r in requests if (name := lora_name_of(r)) is not None}))

        waiting = itertools.chain(sched.waiting, sched.remote.values(), sched.loading.values())
        return names(sched.running), names(waiting)

    def _enabled(self) -> LoRAManager:
        if self.manager is None:
            raise LoRAError("LoRA is not enabled on this engine (--enable-lora)")
        return self.manager
