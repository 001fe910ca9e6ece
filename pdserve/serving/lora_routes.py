"""LoRA adapters over HTTP, in vLLM's shapes and status codes:

    POST /v1/load_lora_adapter    {"lora_name", "lora_path"}
        200 text "Success: LoRA adapter 'x' added successfully."
        400 both fields are needed; the name is loaded already; the adapter is refused (its reason)
    POST /v1/unload_lora_adapter  {"lora_name"}
        200 text "Success: LoRA adapter 'x' removed successfully."
        404 no adapter of that name; 400 requests still run under it
    GET /v1/lora_adapters  pdserve's: {"data": [{"name", "path", "digest", "rank"}]}
    GET /v1/models lists each adapter beside the base model, `parent` = the base model's id; a
    request's `model` naming an adapter runs under it (engine/lora_manager.py).

A `LoRAAdmin` does the work: the engine's (`EngineLoRAAdmin`: commands to the engine thread or
engine-core process) or the PD router's (every worker of both roles, disagg/router).
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
from http import HTTPStatus

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from pdserve.engine.async_llm import EngineClient as CommandClient
from pdserve.engine.commands import AddLoRA, ListLoRAs, RemoveLoRA
from pdserve.engine.lora_manager import LoRAInfo, lora_info
from pdserve.serving.errors import OpenAIError, documented_errors


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str = ""
    lora_path: str = ""


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str = ""
    lora_int_id: int | None = None  # vLLM's; adapters are named by lora_name


class LoRAAdmin(abc.ABC):
    """Contract: called on the event loop. `names` is what is served now (read synchronously by the
    model check of every request); `load` and `unload` raise ValueError with the reason when the
    adapter is refused, leaving what is served unchanged, and `LookupError` for an unknown name."""

    @abc.abstractmethod
    def names(self) -> frozenset[str]: ...

    @abc.abstractmethod
    async def adapters(self) -> list[LoRAInfo]: ...

    @abc.abstractmethod
    async def load(self, name: str, path: str) -> LoRAInfo: ...

    @abc.abstractmethod
    async def unload(self, name: str) -> None: ...

    async def lookup(self, name: str) -> None:  # noqa: B027 - a hook with nothing to do by default
        """A request names `name`, which may not be in `names` yet: learn of it if it exists (a PD
        router asks its workers). One engine: `names` is always current."""

    async def prepare(self, name: str) -> None:  # noqa: B027 - a hook with nothing to do by default
        """Before a request under adapter `name` runs (it is in `names`): make sure wherever it
        may run holds it (a PD router: a worker that joined since). One engine: nothing to do."""


class EngineLoRAAdmin(LoRAAdmin):
    """The adapters of one engine (colocated serving, a PD worker)."""

    def __init__(self, client: CommandClient, names: tuple[str, ...]) -> None:
        self._client = client
        self._names = frozenset(names)  # the start-up adapters (the engine refused to start without them)
        self._lock = asyncio.Lock()  # NOTE: one change at a time, so `names` follows the engine's order

    def names(self) -> frozenset[str]:
        return self._names

    async def adapters(self) -> list[LoRAInfo]:
        return [lora_info(v) for v in await self._client.send(ListLoRAs())]

    async def load(self, name: str, path: str) -> LoRAInfo:
        async with self._lock:
            info = lora_info(await self._client.send(AddLoRA(name, path)))
            self._names = self._names | {name}
            return info

    async def unload(self, name: str) -> None:
        async with self._lock:
            if name not in self._names:
                raise LookupError(f"The lora adapter '{name}' cannot be found.")
            await self._client.send(RemoveLoRA(name))
            self._names = self._names - {name}


def engine_lora_admin(client: object) -> EngineLoRAAdmin | None:
    """The admin of a local engine's adapters (None: not a local engine, or LoRA off)."""
    from pdserve.engine.async_llm import AsyncLLM
    from pdserve.engine.core_client import EngineCoreClient

    if not isinstance(client, AsyncLLM | EngineCoreClient) or client.config.lora is None:
        return None
    return EngineLoRAAdmin(client, tuple(name for name, _ in client.config.lora.modules))


def add_lora_routes(app: FastAPI, admin: LoRAAdmin) -> None:
    errors = documented_errors(HTTPStatus.BAD_REQUEST, HTTPStatus.NOT_FOUND)

    @app.get("/v1/lora_adapters")
    async def lora_adapters() -> dict[str, list[dict[str, object]]]:
        """pdserve's: every adapter served, with its path, weights digest and rank (what a PD router
        compares across its workers)."""
        return {"data": [dataclasses.asdict(info) for info in await admin.adapters()]}

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=errors)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> str:
        if not body.lora_name or not body.lora_path:
            raise OpenAIError("Both 'lora_name' and 'lora_path' must be provided.", HTTPStatus.BAD_REQUEST)
        if body.lora_name in admin.names():
            raise OpenAIError(f"The lora adapter '{body.lora_name}' has already been loaded.", HTTPStatus.BAD_REQUEST)
        try:
            await admin.load(body.lora_name, body.lora_path)
        except ValueError as exc:
            raise OpenAIError(str(exc), HTTPStatus.BAD_REQUEST) from exc
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=errors)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> str:
        if not body.lora_name:
            raise OpenAIError("'lora_name' needs to be provided to unload a LoRA adapter.", HTTPStatus.BAD_REQUEST)
        try:
            await admin.unload(body.lora_name)
        except LookupError as exc:
            raise OpenAIError(str(exc.args[0]), HTTPStatus.NOT_FOUND) from exc
        except ValueError as exc:
            raise OpenAIError(str(exc), HTTPStatus.BAD_REQUEST) from exc
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
