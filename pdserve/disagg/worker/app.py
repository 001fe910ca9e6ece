"""HTTP control plane of a prefill or decode worker (the router is its only client).

    GET  /health               200 while the engine thread is alive (liveness)
    GET  /ready                200 while the worker takes work: engine alive, not draining (what
                               /pd/info calls `ready`); else 503 {"status", "reason"} (readiness)
    GET  /pd/info              WorkerInfo: role, model, KV layout, transport address, load
    GET  /pd/stats             counters of what the worker did (hand-offs, timeouts, retries, queue)
    decode:  POST /pd/reserve  ReserveRequest -> ReserveReply | 400 | 503 (no room now; draining: with the
                               x-pdserve-draining header)
             POST /pd/prefix   {"prompt_token_ids": [...]} -> {"num_cached_tokens": n} (prefix affinity)
             GET  /pd/stream/{id}  NDJSON OutputFrames until the request finishes
             GET  /pd/frames/{mux id}  one router's frame stream: `id TAB OutputFrame` lines of
                               every request attached to it, `id TAB` when its frames end | 409
             POST /pd/stream/{id}/via/{mux id}  stream the request's frames there | 404 | 410 (no such stream)
             POST /pd/alive    {"transfer_ids": [...], "ended": [...]}: keepalives from prefill workers
                               computing them; attempts they gave up on (their hand-off timed out)
             POST /pd/retarget/{id}  Retarget: expect a new prefill attempt | 404
             POST /pd/prefill_here/{id}  compute the (short) uncached rest here | 404
             POST /pd/fail/{id}  FailJob: end a request still waiting for KV (for that attempt) with an error | 404
             POST /pd/abort/{id}
    prefill: POST /pd/prefill  PrefillJob -> HandOff once the hand-off ended | 400 | 409 (KV layout
                               mismatch) | 502 (decode unreachable) | 503 (draining); with `Accept:
                               application/x-ndjson`, NDJSON PrefillEvents: the FirstToken once
                               sampled, then the HandOff
             POST /pd/place/{transfer id}  Placement: the decode reservation of a job sent without one
                               (its KV computed so far goes now) | 404 (not running here) | 400 | 409 | 502
             POST /pd/abort/{transfer id}  end the attempt (aborted, its blocks released) wherever it
                               is; one that comes before its job is kept: the job then ends at once
             POST /pd/prefix   as decode's, pool and disk tier (prefix-affinity placement of jobs)

With a cluster secret (--cluster-secret-file / PDSERVE_CLUSTER_SECRET) every /pd/* route but GET
/pd/info and /pd/stats answers 401 unless the call is signed with it (auth.py); the KV port
authenticates peers the same way (transport/handshake.py). Without one the worker warns at start.

Draining (SIGTERM, see `Worker.drain`): /pd/info says `draining`, so routers stop sending work,
new reservations and jobs get 503, and what is in flight finishes. A worker with `--register`
routers announces itself to them while it serves (registrar.py) and leaves when it drains.

`build_worker` wires one worker from its engine and `WorkerConfig`, all in this process: the KV
side, hooked into the engine (kv_side.py's `attach_kv_side`, as an engine process does for its
own), the engine thread, then the service and app (`assemble_worker`, as `start_worker` does over
an engine process); the role's routes are in worker/routes.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from http import HTTPStatus
from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from pdserve.disagg.auth import PeerAuth, load_cluster_secret, warn_if_open
from pdserve.disagg.config import WorkerConfig
from pdserve.disagg.control import ConsumerReport, Role, WorkerInfo, WorkerStatsReply
from pdserve.disagg.kv_layout import KVLayout
from pdserve.disagg.worker.decode_service import DecodeService
from pdserve.disagg.worker.kv_side import KVSideSpec, ReceiverView, SenderHandles, attach_kv_side
from pdserve.disagg.worker.metrics import ServiceCollector
from pdserve.disagg.worker.prefill_service import PrefillService
from pdserve.disagg.worker.registrar import Registrar
from pdserve.disagg.worker.routes import add_decode_routes, add_prefill_routes
from pdserve.engine.async_llm import AsyncLLM
from pdserve.engine.kv_event_publisher import KVEventEndpoints
from pdserve.engine.llm_engine import LLMEngine
from pdserve.serving.app import Lifespan
from pdserve.serving.errors import EXCEPTION_HANDLERS
from pdserve.serving.lora_routes import add_lora_routes, engine_lora_admin
from pdserve.serving.metrics import LocalEngine, ServerMetrics, install_engine_metrics
from pdserve.serving.middleware import CatchAll

if TYPE_CHECKING:
    from pdserve.disagg.worker.queue_consumer import RedisJobConsumer


@dataclass(frozen=True, slots=True)
class Worker:
    """One prefill or decode worker, as `build_worker` wires it."""

    app: FastAPI
    client: LocalEngine  # the engine: a thread of this process, or an engine process of its own
    service: PrefillService | DecodeService
    consumer: RedisJobConsumer | None = None  # prefill with a Redis queue: what feeds `service`
    registrar: Registrar | None = None  # with --register: announces the worker to its routers
    metrics: ServerMetrics | None = None  # what GET /metrics renders (a gateway adds its series: worker/gateway.py)

    def drain(self) -> None:
        """Stop taking work (SIGTERM): routers see `draining` and stop sending; new reservations
        and jobs get 503; a queue consumer stops pulling. What is in flight finishes."""
        self.service.draining = True
        if self.consumer is not None:
            self.consumer.stop()


def build_worker(engine: LLMEngine, config: WorkerConfig, model_name: str, *,
                 sender_options: Mapping[str, object] | None = None) -> Worker:
    """Engine thread + KV transport + control-plane app for one prefill or decode worker, all in
    this process (`--engine-in-process`; the in-process test clusters). `sender_options` go to each
    KV sender (tests: the fake transport's `stall_after_layers`)."""
    kv = attach_kv_side(engine, KVSideSpec.of(config, model_name), sender_options)
    client = AsyncLLM(engine)  # NOTE: starts the engine thread, after the KV side's hooks were set
    events = None if engine.kv_event_publisher is None else engine.kv_event_publisher.endpoints
    return assemble_worker(client, kv.receiver, kv.prefill, WorkerShape(config, model_name, kv.layout,
                                                                        kv.spec.transport, events))


@dataclass(frozen=True, slots=True)
class WorkerShape:
    """What the control plane needs to know of a worker besides its engine."""

    config: WorkerConfig
    model_name: str
    layout: KVLayout
    transport: str
    kv_events: KVEventEndpoints | None = None  # where its engine publishes KV-cache events (None: nowhere)


def assemble_worker(client: LocalEngine, receiver: ReceiverView | None, senders: SenderHandles | None,
                    shape: WorkerShape) -> Worker:
    """The service and the control-plane app of a worker over its engine (on a thread, or in its own
    process) and its engine side's KV receiver (decode) or sender handles (prefill). A prefill
    worker whose queue is Redis pulls its jobs from the shared queue (`RedisJobConsumer`, started
    with the app, drained and awaited when the app stops)."""
    config = shape.config
    metrics = ServerMetrics(shape.model_name, config.role)
    secret = load_cluster_secret(config.cluster_secret_file)
    warn_if_open(secret, f"{config.role} worker")
    service: PrefillService | DecodeService
    consumer = None
    if receiver is not None:
        service = DecodeService(client, receiver, config.kv_failure_policy, config.transfer_timeout_s,
                                on_transfer=metrics.observe_transfer, lease_s=config.reservation_lease_s)
    else:
        assert senders is not None, "a prefill worker needs its sender handles"
        service = PrefillService(client, senders, config.transfer_timeout_s, secret,
                                 placement_timeout_s=config.placement_timeout_s)
        consumer = _queue_consumer(service, config)
    registrar = None
    if config.register:
        if config.advertise_url is None:
            raise ValueError("a worker with --register needs the URL routers reach it at (--advertise-url)")
        registrar = Registrar(config.register, config.role, config.advertise_url, lambda: service.draining,
                              secret=secret)
    app = FastAPI(title=f"pdserve {config.role} worker", exception_handlers=EXCEPTION_HANDLERS,
                  lifespan=_background(consumer, registrar))
    if secret is not None:
        app.add_middleware(PeerAuth, secret=secret)  # inside CatchAll: signed /pd/* calls only
    app.add_middleware(CatchAll)  # no /pd/* route answers a plain-text 500
    install_engine_metrics(app, client, metrics, ServiceCollector(metrics.labels, service.stats))  # GET /metrics
    worker = Worker(app, client, service, consumer, registrar, metrics)
    _add_common_routes(worker, shape)
    lora = engine_lora_admin(client)  # with --enable-lora: /v1/load_lora_adapter, /v1/unload_lora_adapter
    if lora is not None:
        add_lora_routes(app, lora)
    if isinstance(service, DecodeService):
        add_decode_routes(app, service)
    else:
        add_prefill_routes(app, service)
    return worker


def _queue_consumer(service: PrefillService, config: WorkerConfig) -> RedisJobConsumer | None:
    if config.queue.queue == "memory":
        return None
    from pdserve.disagg.worker.queue_consumer import ConsumerOptions, RedisJobConsumer

    options = ConsumerOptions(claim_idle_s=config.queue_claim_idle_s, max_deliveries=config.queue_max_deliveries)
    return RedisJobConsumer(service, config.queue.queue, config.queue.queue_deployment, options)


def _background(consumer: RedisJobConsumer | None, registrar: Registrar | None) -> Lifespan:
    """The app's lifespan: the queue consumer pulls and the registrar announces while the app
    serves; stopping drains the consumer and ends the registrar (which deregisters)."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        consuming = None if consumer is None else asyncio.create_task(consumer.run())
        announcing = None if registrar is None else asyncio.create_task(registrar.run())
        try:
            yield
        finally:
            if announcing is not None:
                announcing.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await announcing
            if consumer is not None and consuming is not None:
                consumer.stop()
                with contextlib.suppress(asyncio.CancelledError):
                    await consuming
                await consumer.close()

    return lifespan


def _add_common_routes(worker: Worker, shape: WorkerShape) -> None:
    client, service, app = worker.client, worker.service, worker.app
    role, model_name, layout, transport = shape.config.role, shape.model_name, shape.layout, shape.transport
    instance_id = uuid.uuid4().hex[:12]
    kv_address = service.receiver.kv_address if isinstance(service, DecodeService) else None
    events = shape.kv_events or KVEventEndpoints(None, None, "")

    @app.get("/health")
    async def health() -> JSONResponse:
        if not client.alive:
            return JSONResponse({"status": "engine dead"}, status_code=int(HTTPStatus.SERVICE_UNAVAILABLE))
        return JSONResponse({"status": "ok", "role": role})

    @app.get("/ready")
    async def ready() -> JSONResponse:
        """Readiness (Kubernetes' probe): the app exists only once the model is loaded and the KV
        receiver listens (decode) or the sender pool is set up (prefill), so what is left to check
        is the engine thread and draining."""
        reason = _unready_reason(worker)
        if reason:
            return JSONResponse({"status": "not ready", "role": role, "reason": reason},
                                status_code=int(HTTPStatus.SERVICE_UNAVAILABLE))
        return JSONResponse({"status": "ready", "role": role})

    @app.get("/pd/info")
    async def info() -> WorkerInfo:
        stats = client.stats()
        return WorkerInfo(role=role, model=model_name, kv_layout=dataclasses.asdict(layout), kv_transport=transport,
                          kv_address=kv_address, ready=not _unready_reason(worker),
                          num_running=stats.num_running, num_waiting=stats.num_waiting,
                          num_free_kv_blocks=stats.num_free_kv_blocks, num_kv_blocks=stats.num_kv_blocks,
                          max_num_batched_tokens=client.config.scheduler.max_num_batched_tokens,
                          draining=service.draining, instance_id=instance_id, max_lora=stats.max_lora,
                          running_lora_adapters=list(stats.running_lora_adapters),
                          waiting_lora_adapters=list(stats.waiting_lora_adapters),
                          kv_events_endpoint=events.publish, kv_events_replay_endpoint=events.replay,
                          kv_events_topic=events.topic)

    @app.get("/pd/stats")
    async def stats() -> JSONResponse:
        """What this worker's service did (counters), and what it holds now."""
        return JSONResponse(_stats_reply(worker, role).model_dump())


def _unready_reason(worker: Worker) -> str:
    """Why this worker must not get work now; "" when it may (GET /ready, /pd/info's `ready`)."""
    if not worker.client.alive:
        return "engine dead"
    if worker.service.draining:
        return "draining"
    return ""


def _stats_reply(worker: Worker, role: Role) -> WorkerStatsReply:
    stats = worker.service.stats()
    queue = None
    if worker.consumer is not None:
        consumed = worker.consumer.stats()
        queue = ConsumerReport(consumer=worker.consumer.name, in_flight=consumed.in_flight,
                               counters=consumed.counters())
    # NOTE: the service's counters that moved, as this route always listed them (the consumer's: all)
    moved = {name: count for name, count in stats.counters().items() if count}
    return WorkerStatsReply(role=role, in_flight=stats.in_flight, draining=worker.service.draining,
                            counters=moved, queue=queue)
