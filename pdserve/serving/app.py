"""The OpenAI-compatible HTTP app over an `EngineClient`: a colocated worker's engine, or anything
else that runs requests and brings its own metrics (`AppExtras`). Routes only; the work is in the
handlers."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from pdserve.serving.chat import ChatHandler
from pdserve.serving.completions import CompletionHandler
from pdserve.serving.config import ApiConfig
from pdserve.serving.dashboard import install_dashboard
from pdserve.serving.engine_client import EngineClient
from pdserve.serving.errors import EXCEPTION_HANDLERS, OpenAIError, documented_errors
from pdserve.serving.event_stream import EventStreamResponse
from pdserve.serving.limits import check_limits
from pdserve.serving.lora_routes import LoRAAdmin, add_lora_routes, engine_lora_admin
from pdserve.serving.metrics import LocalEngine, instrument_engine_app
from pdserve.serving.middleware import ApiKeyAuth, BodyLimit, CatchAll
from pdserve.serving.openapi import install_openapi
from pdserve.serving.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from pdserve.serving.sse import sse_stream, started, unless_disconnected
from pdserve.serving.utility_routes import add_utility_routes

Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[None]]
# NOTE: a streamed reply (`"stream": true`) is server-sent events, not JSON
_STREAMED = {200: {"content": {"text/event-stream": {"schema": {
    "type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}}}}}


@dataclass(frozen=True, slots=True)
class Probes:
    """What GET /health (liveness: False means restarting the process could help) and GET /ready
    (readiness: why it must get no traffic now, "" when it may) answer; Kubernetes' probes."""

    live: Callable[[], bool]
    unready_reason: Callable[[], str]

    @classmethod
    def of_engine(cls, client: EngineClient) -> Probes:
        """A server whose only part is its engine: alive and ready are the same thing."""
        return cls(lambda: client.alive, lambda: "" if client.alive else "engine dead")


@dataclass(frozen=True, slots=True)
class AppExtras:
    """What an app over a client that is not a local engine brings with it (the PD router's:
    disagg/router/app.py). Without one, a local engine gets the colocated metrics and dashboard,
    any other client none."""

    # puts GET /metrics (and the live dashboard) on the app; returns the client the handlers call
    # (one that feeds those metrics: `client` wrapped)
    instrument: Callable[[FastAPI, EngineClient], EngineClient]
    refusals: tuple[HTTPStatus, ...] = ()  # what else the client refuses requests with (documented)
    lora: LoRAAdmin | None = None  # who serves LoRA adapters (the router: every worker's)


def create_app(client: EngineClient, model_name: str, lifespan: Lifespan | None = None,
               probes: Probes | None = None, api: ApiConfig | None = None,
               extras: AppExtras | None = None) -> FastAPI:
    """`probes`: default `Probes.of_engine(client)`. `api`: client keys and input caps (default
    `ApiConfig()`: no keys). `extras`: the metrics and refusals of a client that is not a local engine.
    LoRA adapters: `extras.lora`'s, else a local engine's with --enable-lora (serving/lora_routes.py)."""
    api = api or ApiConfig()
    lora = extras.lora if extras is not None else engine_lora_admin(client)
    app = FastAPI(title="pdserve", exception_handlers=EXCEPTION_HANDLERS, lifespan=lifespan)
    install_middleware(app, api)
    install_openapi(app, api, client.vocab_size, client.tokenizer.vocab_size)
    if extras is not None:
        client = extras.instrument(app, client)
    elif isinstance(client, LocalEngine):
        install_dashboard(app, instrument_engine_app(app, client, model_name, "colocated"), None)

    models = ServedModels(model_name, lora)
    _add_generation_routes(app, client, models, api, extras.refusals if extras else ())

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        adapters = [] if lora is None else await lora.adapters()
        return ModelList(data=[ModelCard(id=model_name, root=client.model_path, max_model_len=client.max_model_len),
                               *(ModelCard(id=info.name, root=info.path, parent=model_name,
                                           max_model_len=client.max_model_len) for info in adapters)])

    if lora is not None:
        add_lora_routes(app, lora)

    add_utility_routes(app, client, models.check)
    _add_probe_routes(app, probes or Probes.of_engine(client))
    return app


@dataclass(frozen=True, slots=True)
class ServedModels:
    """What a request's `model` may name: the served model, or one of `lora`'s adapters."""

    name: str
    lora: LoRAAdmin | None

    def check(self, requested: str | None) -> str | None:
        """The LoRA adapter `requested` names (None: the base model); 404 for a model not served."""
        if requested is None or requested == self.name:
            return None
        if self.lora is None or requested not in self.lora.names():
            raise OpenAIError(f"The model `{requested}` does not exist. This server serves `{self.name}`.",
                              HTTPStatus.NOT_FOUND, "model")
        return requested

    async def resolve(self, requested: str | None) -> str | None:
        """`check`, after asking `lora` about a name it does not know yet (a router learns its
        workers' adapters by asking them), and with the adapter ready wherever the request may run."""
        if self.lora is not None and requested is not None and requested != self.name:
            await self.lora.lookup(requested)
        lora_name = self.check(requested)
        if lora_name is not None:
            assert self.lora is not None  # NOTE: `check` names its adapters only
            await self.lora.prepare(lora_name)
        return lora_name


def _add_generation_routes(app: FastAPI, client: EngineClient, models: ServedModels, api: ApiConfig,
                           refusals: tuple[HTTPStatus, ...]) -> None:
    """POST /v1/completions and /v1/chat/completions; `refusals`: what else `client` refuses with;
    a `model` that names a LoRA adapter runs under it."""
    model_name = models.name
    # the handlers of each model served, the base model's and each LoRA adapter's (vLLM's answers
    # name the model the request asked for)
    completions = {model_name: CompletionHandler(client, model_name, api.max_tokens_limit)}
    chats = {model_name: ChatHandler(client, model_name, api)}

    def handler_of(body: Any, lora_name: str | None) -> CompletionHandler | ChatHandler:
        name = lora_name or model_name
        if isinstance(body, CompletionRequest):
            if name not in completions:
                completions[name] = CompletionHandler(client, name, api.max_tokens_limit)
            return completions[name]
        if name not in chats:
            chats[name] = ChatHandler(client, name, api)
        return chats[name]

    async def respond(body: Any, raw: Request) -> Any:
        lora_name = await models.resolve(body.model)
        check_limits(body, api)
        handler = handler_of(body, lora_name)
        request_id, jobs = await handler.prepare(body)
        if lora_name is not None:
            jobs = [dataclasses.replace(job, params=dataclasses.replace(job.params, lora_name=lora_name))
                    for job in jobs]
        if body.stream:
            # NOTE: the first chunk is awaited before the response starts, so an error until then
            # (queue full, no worker, no KV room) still gets its own HTTP status, not a 200.
            return EventStreamResponse(sse_stream(await started(raw, handler.stream(body, request_id, jobs))))
        return JSONResponse(await unless_disconnected(raw, handler.full(body, request_id, jobs)))

    generation = _STREAMED | documented_errors(HTTPStatus.BAD_REQUEST, HTTPStatus.NOT_FOUND,
                                                HTTPStatus.INTERNAL_SERVER_ERROR, HTTPStatus.SERVICE_UNAVAILABLE,
                                                *refusals)

    @app.post("/v1/completions", responses=generation)
    async def create_completion(body: CompletionRequest, raw: Request) -> Any:
        return await respond(body, raw)

    @app.post("/v1/chat/completions", responses=generation)
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Any:
        return await respond(body, raw)


def install_middleware(app: FastAPI, api: ApiConfig) -> None:
    """serving/middleware.py's layers; the last added is the outermost."""
    app.add_middleware(BodyLimit, max_bytes=api.max_request_body_bytes)
    keys = api.api_keys()
    if keys:
        app.add_middleware(ApiKeyAuth, keys=keys)
    app.add_middleware(CatchAll)


class ProbeStatus(BaseModel):
    """What /health and /ready answer, 200 or 503 alike."""

    status: str
    reason: str | None = None


def _add_probe_routes(app: FastAPI, probes: Probes) -> None:
    unavailable = int(HTTPStatus.SERVICE_UNAVAILABLE)
    answers: dict[int | str, dict[str, Any]] = {
        status: {"model": ProbeStatus, "description": HTTPStatus(status).phrase} for status in (200, unavailable)}

    @app.get("/health", responses=answers)
    async def health() -> JSONResponse:
        if not probes.live():
            return JSONResponse({"status": "dead"}, status_code=unavailable)
        return JSONResponse({"status": "ok"})

    @app.get("/ready", responses=answers)
    async def ready() -> JSONResponse:
        reason = probes.unready_reason()
        if reason:
            return JSONResponse({"status": "not ready", "reason": reason}, status_code=unavailable)
        return JSONResponse({"status": "ready"})
