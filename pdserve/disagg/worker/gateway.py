"""Gateway mode: a decode worker that answers the OpenAI API itself, as its own routing sidecar,
for an endpoint picker that chooses the decode pod first and a prefill pod for it (llm-d's EPP
behind the Gateway API Inference Extension: deploy/k8s/overlays/gie-pd, docs/DEPLOY.md).

One request with the header `x-prefiller-host-port: HOST:PORT` (the picker's choice), the router's
single-request path run against this worker's own engine:
  1. reserve the prompt's blocks here (`DecodeService.reserve`, what POST /pd/reserve does for a router)
  2. the run's prefill job (run_parts.py: the router's job, placed on this reservation, signed with
     the cluster secret) goes to that worker's POST /pd/prefill, on its serving port, without
     router or queue; its KV comes over the configured transport (tcp, nixl). When that worker
     does not do it, the prompt is prefilled here, in the reservation (worker/directed_prefill.py:
     `prefill_here`, the path a router takes for a short uncached prompt)
  3. the reservation's frames (`DecodeService.stream`) become the client's outputs (run_parts.py).
Without the header the engine runs the request whole, as a colocated server's does: a reservation
would only wait for KV that never comes (and a cancelled nixl one keeps its blocks for seconds).

A header that is not HOST:PORT (a bad port, empty) is a 400 in the error envelope; as llm-d's
sidecar does, a comma-separated list (or the header repeated) names candidates, of which the first
is taken. With `--gateway-prefill-allow`, a worker outside the list is not contacted
(worker/prefill_allow.py). `x-gateway-*`, `x-slo-*` and `Prefer` headers are tolerated and ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from http import HTTPStatus
from typing import cast

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.addresses import http_url, parse_host_port
from pdserve.disagg.auth import load_cluster_secret
from pdserve.disagg.client import WorkerClient
from pdserve.disagg.config import WorkerConfig
from pdserve.disagg.control import FrameDecoder, FrameGap, OutputFrame, ReserveReply, ReserveRequest, WireSamplingParams
from pdserve.disagg.request_ids import run_id, transfer_id
from pdserve.disagg.run_parts import placement, prefill_job, request_output
from pdserve.disagg.worker.app import Worker
from pdserve.disagg.worker.decode_service import DecodeService
from pdserve.disagg.worker.directed_prefill import DirectedPrefill, DirectedSetup, PeersCollector, PrefillPeers
from pdserve.disagg.worker.prefill_allow import PrefillAllowlist
from pdserve.engine.output import RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.serving.app import AppExtras, create_app
from pdserve.serving.config import ApiConfig
from pdserve.serving.errors import OpenAIError
from pdserve.serving.lora_routes import engine_lora_admin
from pdserve.serving.metrics import LocalEngine

PREFILLER_HEADER = "x-prefiller-host-port"  # llm-d-router pkg/common/routing: routing.PrefillEndpointHeader
_RESERVE_RETRY_S = 0.05
_RESERVE_DEADLINE_S = 30.0  # KV room may free up meanwhile (as the router's --reserve-deadline-s default)
_CONNECT_TIMEOUT_S = 2.0

# the values of the header on the request being served (set by `PrefillerHeader`, read by `generate`)
_prefiller: ContextVar[tuple[str, ...]] = ContextVar("pdserve_prefiller", default=())


class PrefillerHeader:
    """ASGI: puts the request's `x-prefiller-host-port` values where `Gateway.generate` reads them
    (the OpenAI handlers know nothing of headers)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        name = PREFILLER_HEADER.encode()
        values = tuple(v.decode("latin-1") for k, v in scope["headers"] if k.lower() == name)
        token = _prefiller.set(values)
        try:
            await self.app(scope, receive, send)
        finally:
            _prefiller.reset(token)


@dataclass(frozen=True, slots=True)
class PrefillTarget:
    """The prefill worker a request's header names: its serving port."""

    host: str
    port: int

    @property
    def url(self) -> str:
        return http_url(self.host, self.port)


def prefill_target(values: Sequence[str]) -> PrefillTarget | None:
    """The prefill worker the header values name (None: no header); OpenAIError 400 for one that
    is not HOST:PORT. Candidates, comma-separated or repeated: the first (llm-d's sidecar)."""
    if not values:
        return None
    candidates = [part.strip() for value in values for part in value.split(",")]
    for text in candidates:
        try:
            host, port = parse_host_port(text, 0)
        except ValueError:
            host, port = "", 0
        if not host or f":{port}" not in text:
            raise OpenAIError(f"header {PREFILLER_HEADER}: expected HOST:PORT (e.g. 10.0.0.7:8000), got {text!r}",
                              HTTPStatus.BAD_REQUEST, PREFILLER_HEADER)
    return PrefillTarget(*parse_host_port(candidates[0], 0))


class Gateway:
    """EngineClient (serving/engine_client.py) of a decode worker in gateway mode (module docstring).
    Used from the worker's event loop."""

    def __init__(self, service: DecodeService, engine: LocalEngine, setup: DirectedSetup, self_url: str,
                 allow: PrefillAllowlist | None = None) -> None:
        self.service = service
        self.allow = allow  # the prefill workers a header may name (None: any)
        self.engine = engine
        self.setup = setup
        self.self_url = self_url  # where the prefill worker sends keepalives for the reservation
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self.model_path = engine.model_path

    @property
    def alive(self) -> bool:
        return self.engine.alive

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.engine.validate_request(prompt_token_ids, params)

    async def close(self) -> None:
        await self.setup.client.close()

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        named = prefill_target(_prefiller.get())
        if named is None or not await self._allowed(named):
            if named is None:
                self.setup.peers.local += 1
            outputs = self._prefilled_here(request_id, prompt_token_ids, params)
        else:
            outputs = self._prefilled_there(named, request_id, prompt_token_ids, params)
        async with contextlib.aclosing(outputs) as items:
            async for output in items:
                yield output

    async def _prefilled_here(self, request_id: str, prompt: list[int],
                              params: SamplingParams) -> AsyncGenerator[RequestOutput, None]:
        """The request as a colocated engine runs it: no reservation, so no KV receiver expects it
        (a cancelled nixl reservation keeps its blocks from reuse for seconds: none here). Closing
        early aborts it (the engine client's contract)."""
        if self.service.draining:
            raise OpenAIError("this decode worker is draining", HTTPStatus.SERVICE_UNAVAILABLE,
                              headers={"Retry-After": "1"})
        async with contextlib.aclosing(cast(AsyncGenerator[RequestOutput, None],
                                            self.engine.generate(request_id, prompt, params))) as outputs:
            async for output in outputs:
                yield output

    async def _prefilled_there(self, target: PrefillTarget, request_id: str, prompt: list[int],
                               params: SamplingParams) -> AsyncGenerator[RequestOutput, None]:
        """The router's path: a reservation here, the job placed on it there, the reservation's
        frames as outputs (prefilled here after all if the prefill worker does not do it)."""
        run = run_id(request_id, 0)
        reply = await self._reserve(run, prompt, params)
        where = placement(transfer_id(run, 0), self.self_url, reply)
        directed = DirectedPrefill(self.setup, target.url, prefill_job(self.setup.client.secret, run, prompt,
                                                                       params, where))
        finished = False
        try:
            directed.start()
            async with contextlib.aclosing(self._outputs(request_id, run, prompt, directed)) as outputs:
                async for output in outputs:
                    finished = output.finished
                    yield output
        finally:
            await asyncio.shield(directed.close(abort=not finished))
            if not finished:
                # NOTE: ended early (client gone, an error) wherever it was: before its stream was
                # read too, when only this would free the reservation (a no-op once the stream did)
                await self.service.abort(run)

    async def _allowed(self, target: PrefillTarget) -> bool:
        """Whether the header's prefill worker may get the job (else: counted, prefilled here)."""
        if self.allow is None or await self.allow.permits(target.host):
            return True
        self.setup.peers.fell_back(target.url, "not_allowed", "not in --gateway-prefill-allow")
        return False

    async def _reserve(self, run: str, prompt: list[int], params: SamplingParams) -> ReserveReply:
        """Blocks for the prompt here; waits a while for room (503 with Retry-After past it)."""
        request = ReserveRequest(request_id=run, transfer_id=transfer_id(run, 0), prompt_token_ids=prompt,
                                 params=WireSamplingParams.of(params))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _RESERVE_DEADLINE_S
        while True:
            try:
                reply = await self.service.reserve(request)
            except ValueError as exc:
                raise OpenAIError(str(exc), HTTPStatus.BAD_REQUEST) from exc
            if reply is not None:
                return reply
            if self.service.draining or loop.time() > deadline:
                why = "this decode worker is draining" if self.service.draining else \
                    "No available block: the KV pool has no room for this request now"
                raise OpenAIError(why, HTTPStatus.SERVICE_UNAVAILABLE, headers={"Retry-After": "1"})
            await asyncio.sleep(_RESERVE_RETRY_S)

    async def _outputs(self, request_id: str, run: str, prompt: list[int],
                       directed: DirectedPrefill) -> AsyncGenerator[RequestOutput, None]:
        """The reservation's frames as the client's outputs; closing early aborts the request here."""
        frames_in = FrameDecoder()
        finished = False
        try:
            # NOTE: an async generator (closing it before its end aborts the request here)
            stream = cast(AsyncGenerator[OutputFrame, None], self.service.stream(run))
            async with contextlib.aclosing(stream) as frames:
                async for frame in frames:
                    if frame.kv_retry:  # decode's transfer deadline: the named worker stalled
                        await directed.fall_back("timeout", "the KV transfer stalled")
                        continue
                    output = self._output(request_id, prompt, frame, frames_in)
                    finished = output.finished
                    yield output
        except KeyError as exc:
            raise OpenAIError(f"request {run} ended before its first output", HTTPStatus.SERVICE_UNAVAILABLE) from exc
        if not finished:
            raise OpenAIError(f"the engine ended request {run} early", HTTPStatus.SERVICE_UNAVAILABLE)

    @staticmethod
    def _output(request_id: str, prompt: list[int], frame: OutputFrame, frames_in: FrameDecoder) -> RequestOutput:
        if frame.error is not None:
            raise OpenAIError(frame.error, HTTPStatus.SERVICE_UNAVAILABLE)  # as the router's `kv_failed`
        try:
            frames_in.check(frame)
            return request_output(request_id, prompt, frame, frames_in)
        except FrameGap as exc:
            raise OpenAIError(f"decode's stream of {request_id} is broken: {exc}", HTTPStatus.BAD_GATEWAY) from exc


@dataclass(frozen=True, slots=True)
class GatewaySetup:
    """What gateway mode needs besides the worker: the API's config, the served name, and the URL
    prefill workers reach this worker at (their keepalives for its reservations)."""

    api: ApiConfig
    model_name: str
    self_url: str


def install_gateway(worker: Worker, config: WorkerConfig, setup: GatewaySetup) -> Gateway:
    """Serve the OpenAI API of serving/app.py on a decode worker's app, over a `Gateway` (its
    middleware: client keys, body limit; the worker's /health, /ready, /metrics and /pd/* routes
    stay the worker's). Its series go on the worker's /metrics; its client closes with the app."""
    service = worker.service
    if not isinstance(service, DecodeService):
        raise ValueError("gateway mode is for decode workers")
    client = WorkerClient(timeout_s=None, connect_timeout_s=_CONNECT_TIMEOUT_S,
                          secret=load_cluster_secret(config.cluster_secret_file))
    peers = PrefillPeers()
    gateway = Gateway(service, worker.client, DirectedSetup(service, client, peers, config.gateway_prefill_timeout_s),
                      setup.self_url, PrefillAllowlist.of(config.gateway_prefill_allow))
    extras = AppExtras(lambda _app, served: served, refusals=(HTTPStatus.BAD_GATEWAY,),
                       lora=engine_lora_admin(worker.client))
    api_app = create_app(gateway, setup.model_name, api=setup.api, extras=extras)
    api_app.add_middleware(PrefillerHeader)
    # NOTE: mounted after the worker's own routes, so those answer first; the rest is the API's
    worker.app.mount("/", api_app)
    if worker.metrics is not None:
        worker.metrics.registry.register(PeersCollector(worker.metrics.labels, peers))
    _close_with(worker.app, gateway)
    return gateway


def _close_with(app: FastAPI, gateway: Gateway) -> None:
    """The gateway's client closes when the app stops (inside the worker's own lifespan)."""
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(served: FastAPI) -> AsyncIterator[None]:
        async with inner(served):
            try:
                yield
            finally:
                await gateway.close()

    app.router.lifespan_context = lifespan
