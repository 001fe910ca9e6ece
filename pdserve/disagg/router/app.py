"""The router's HTTP app: the OpenAI API of serving/app.py over the PD router (with its metrics
and live dashboard), plus GET /workers (the pool), GET /router/stats (queue and counters) and
POST /pd/register, /pd/deregister (workers joining and leaving; with --accept-registrations; signed
with the cluster secret when the router has one, else 401)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from http import HTTPStatus

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from pdserve.disagg.auth import PeerAuth
from pdserve.disagg.control import Registration
from pdserve.disagg.router.core import PDRouter
from pdserve.disagg.router.lora import RouterLoRAAdmin
from pdserve.disagg.router.metrics import instrument_router_app
from pdserve.disagg.router.stats import RouterStats
from pdserve.serving.app import AppExtras, Probes, create_app
from pdserve.serving.config import ApiConfig
from pdserve.serving.errors import error_response


def create_router_app(router: PDRouter, model_name: str, api: ApiConfig | None = None) -> FastAPI:
    """The app; its lifespan polls the pool (until shutdown), then closes the router. `api`: client
    keys (which /workers and /router/stats need too) and input caps.

    GET /health (liveness) is 200 while the router polls its pool: a router whose workers are all
    gone is alive (restarting it would bring none back). GET /ready (readiness) is 200 only while
    a request would not get a 503 for want of a queue or a ready worker (`PDRouter.unready_reason`)."""
    watcher: asyncio.Task[None] | None = None

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        nonlocal watcher
        router.pool.expect_first_workers(router.config.startup_window_s)
        await router.refresh()
        watcher = asyncio.create_task(router.watch())
        try:
            yield
        finally:
            watcher.cancel()
            await router.close()

    probes = Probes(live=lambda: watcher is not None and not watcher.done(),
                    unready_reason=lambda: router.unready_reason)
    # NOTE: besides serving's own refusals: a full queue (429), a worker that broke off (502)
    lora = RouterLoRAAdmin(router.workers) if router.config.enable_lora else None
    if lora is not None:
        router.lora_infos = lora.info  # NOTE: a prompt under an adapter is hashed from its root (kv-events)
    extras = AppExtras(lambda served, client: instrument_router_app(served, client, router, model_name),
                       refusals=(HTTPStatus.TOO_MANY_REQUESTS, HTTPStatus.BAD_GATEWAY), lora=lora)
    app = create_app(router, model_name, lifespan, probes, api, extras)

    @app.get("/workers")
    async def workers() -> JSONResponse:
        return JSONResponse([dataclasses.asdict(w) for w in router.workers()])

    @app.get("/router/stats")
    async def stats() -> JSONResponse:
        return JSONResponse(stats_json(router.stats()))

    _add_registration_routes(app, router)
    if router.client.secret is not None:
        app.add_middleware(PeerAuth, secret=router.client.secret)
    return app


def _add_registration_routes(app: FastAPI, router: PDRouter) -> None:
    registry = router.membership.registry
    refused = ("this router does not accept registrations (start it with --accept-registrations)",
               HTTPStatus.FORBIDDEN)

    # NOTE: the workers' plane, not the clients': out of the public document
    @app.post("/pd/register", include_in_schema=False)
    async def register(body: Registration) -> Response:
        if registry is None:
            return error_response(*refused)
        registry.register(body.role, body.url)
        return JSONResponse({"registered": body.url})

    @app.post("/pd/deregister", include_in_schema=False)
    async def deregister(body: Registration) -> Response:
        if registry is None:
            return error_response(*refused)
        gone = registry.deregister(body.url)
        if gone:
            router.pool.leaving(body.url)
        return JSONResponse({"deregistered": gone})


def stats_json(stats: RouterStats) -> dict[str, object]:
    """GET /router/stats' body. NOTE: `counters` lists only the counters that moved (as it always
    has: it was a Counter), named `rejected_<reason>` and by event."""
    counters = {f"rejected_{reason}": n for reason, n in dataclasses.asdict(stats.rejections).items()}
    counters |= dataclasses.asdict(stats.events)
    return {"queued_requests": stats.queued_requests, "queued_tokens": stats.queued_tokens,
            "dispatch_pending": stats.dispatch_pending, "queue": stats.queue,
            "live_queue_consumers": stats.live_queue_consumers, "queue_error": stats.queue_error,
            "counters": {name: n for name, n in counters.items() if n}}
