"""`pdserve serve`: one engine behind its HTTP API (colocated, or a prefill or decode worker), and
the uvicorn server every command's app runs in (`run_server`: serve, router, balancer)."""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Generator
from dataclasses import dataclass, replace
from types import FrameType
from typing import TYPE_CHECKING, cast

import uvicorn
from starlette.types import ASGIApp

from pdserve import envs
from pdserve.addresses import http_url
from pdserve.config import EngineArgs, EngineConfig, kv_dtype_description
from pdserve.config_flags import config_from_args
from pdserve.disagg.config import WorkerConfig
from pdserve.serving.config import ApiConfig

if TYPE_CHECKING:
    from pdserve.disagg.worker.app import Worker
    from pdserve.engine.async_llm import AsyncLLM
    from pdserve.engine.core_client import EngineCoreClient
    from pdserve.engine.llm_engine import LLMEngine

DEMO_MODEL_NAME = "pdserve-demo-tiny"  # the served model id when no --model (or name) is given
ENGINE_FAILED = 3  # exit status of a server whose engine thread died

_Served = tuple[ASGIApp, Callable[[], None] | None, "AsyncLLM | EngineCoreClient"]  # app, on_exit (drain), engine


@dataclass(frozen=True, slots=True)
class _ServeConfigs:
    """What `pdserve serve`'s flags configure: the engine, the worker side (None: colocated), the API."""

    args: EngineArgs
    worker: WorkerConfig | None
    api: ApiConfig
    in_process: bool  # the engine in this process (--engine-in-process, PDSERVE_ENGINE_IN_PROCESS=1)


@dataclass(frozen=True, slots=True)
class _Started:
    """The engine `serve` started: in this process (`engine`), or in its own (`core`, and with a
    worker side `built`, the worker around it)."""

    engine: LLMEngine | None = None
    core: EngineCoreClient | None = None
    built: Worker | None = None

    @property
    def config(self) -> EngineConfig:
        cfg = self.engine.config if self.engine is not None else self.core.config if self.core is not None else None
        assert cfg is not None
        return cfg


def serve(ns: argparse.Namespace) -> int:
    from pdserve.engine.core_client import EngineStartError

    configs = _serve_configs(ns)
    try:
        started = _start(ns, configs)
    except (ValueError, OSError, EngineStartError) as exc:
        print(f"pdserve: {exc}", file=sys.stderr)
        return 2
    name = ns.served_model_name or (configs.args.model or DEMO_MODEL_NAME)
    _log_serving(ns, name, started)
    app, on_exit, client = _served_app(started, configs, name)
    client.on_fatal = _drain_after_engine_failure
    try:
        # Workers' access logs would only show the router's polling; the router logs client requests.
        run_server(app, ns, access_log=configs.worker is None or ns.access_log == "all", on_exit=on_exit)
    finally:
        client.shutdown()
    return ENGINE_FAILED if client.failure is not None else 0


def _serve_configs(ns: argparse.Namespace) -> _ServeConfigs:
    args = config_from_args(EngineArgs, ns)
    worker = None if ns.role == "colocated" else config_from_args(WorkerConfig, ns, role=ns.role)
    # NOTE: a gateway's prefill workers send their keepalives there too
    if worker is not None and (worker.register or _gateway_on(worker)) and worker.advertise_url is None:
        worker = replace(worker, advertise_url=_advertise_url(ns.host, ns.port))
    api = config_from_args(ApiConfig, ns)
    return _ServeConfigs(args, worker, api, ns.engine_in_process or envs.engine_in_process())


def _start(ns: argparse.Namespace, configs: _ServeConfigs) -> _Started:
    """Check the configs, then build the engine; raises ValueError, OSError or EngineStartError."""
    from pdserve.engine.core_client import EngineCoreClient
    from pdserve.engine.core_proc import inject_model_step_failure
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.ops.threads import pin_to

    args, worker = configs.args, configs.worker
    if ns.cpu_affinity is not None:  # NOTE: before torch's threads and the engine process, which inherit it
        pin_to(ns.cpu_affinity)
    validate_worker(worker)
    configs.api.validate()
    configs.api.api_keys()  # NOTE: an unreadable --api-key-file fails here, before the engine loads
    if configs.in_process:
        engine = LLMEngine.from_engine_args(args)
        inject_model_step_failure(engine)
        return _Started(engine=engine)
    if worker is not None:
        from pdserve.disagg.worker.core import start_worker

        built = start_worker(args, worker, ns.served_model_name or (args.model or DEMO_MODEL_NAME))
        return _Started(core=cast("EngineCoreClient", built.client), built=built)
    return _Started(core=EngineCoreClient.start(args))


def _log_serving(ns: argparse.Namespace, name: str, started: _Started) -> None:
    cfg = started.config
    logging.getLogger("pdserve").info(
        "%s worker serving %s on http://%s:%d (%s, %s, KV %s, %d KV blocks of %d tokens (%d per GiB), "
        "max_model_len %d; engine %s)", ns.role, name, ns.host, ns.port, cfg.device,
        str(cfg.dtype).removeprefix("torch."), kv_dtype_description(cfg), cfg.cache.num_kv_blocks,
        cfg.cache.block_size, 1024**3 // cfg.kv_bytes_per_block, cfg.scheduler.max_model_len,
        "in this process" if started.core is None else "in its own process")


def _served_app(started: _Started, configs: _ServeConfigs, name: str) -> _Served:
    if started.built is not None:
        _maybe_gateway(started.built, configs, name)
        return started.built.app, started.built.drain, started.built.client
    if started.core is not None:
        from pdserve.serving.app import create_app

        return create_app(started.core, name, api=configs.api), None, started.core
    assert started.engine is not None
    if configs.worker is None:
        return _colocated_app(started.engine, name, configs.api)
    return _worker_app(started.engine, configs, name)


def _drain_after_engine_failure(exc: BaseException) -> None:
    """The engine thread died (its requests already got errors): drain as on SIGTERM (a queue
    consumer stops pulling, the registrar leaves), then exit non-zero so a supervisor restarts us."""
    logging.getLogger("pdserve").error("the engine failed (%r): draining, then exiting %d", exc, ENGINE_FAILED)
    os.kill(os.getpid(), signal.SIGTERM)


def _advertise_url(host: str, port: int) -> str:
    """Where routers reach a worker listening on host:port: that address, or for a wildcard
    (0.0.0.0, ::) this machine's name's address (a Kubernetes pod's IP)."""
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostbyname(socket.gethostname())
    return http_url(host, port)


def validate_worker(worker: WorkerConfig | None) -> None:
    """Validate a worker's config, the transfer timeout's environment variable included, so that a
    bad value fails before the engine loads."""
    if worker is not None:
        worker.validate()
        _ = worker.transfer_timeout_s  # reads KV_TRANSFER_TIMEOUT_MS when the flag is unset


def _colocated_app(engine: LLMEngine, name: str, api: ApiConfig) -> _Served:
    from pdserve.engine.async_llm import AsyncLLM
    from pdserve.serving.app import create_app

    client = AsyncLLM(engine)
    return create_app(client, name, api=api), None, client


def _worker_app(engine: LLMEngine, configs: _ServeConfigs, name: str) -> _Served:
    from pdserve.disagg.worker.app import build_worker

    assert configs.worker is not None
    worker = build_worker(engine, configs.worker, name)
    _maybe_gateway(worker, configs, name)
    return worker.app, worker.drain, worker.client


def _gateway_on(config: WorkerConfig) -> bool:
    return config.role == "decode" and config.gateway


def _maybe_gateway(worker: Worker, configs: _ServeConfigs, name: str) -> None:
    """A decode worker with --gateway (the default) answers the OpenAI API too (worker/gateway.py)."""
    config = configs.worker
    if config is None or not _gateway_on(config):
        return
    from pdserve.disagg.worker.gateway import GatewaySetup, install_gateway

    assert config.advertise_url is not None  # NOTE: _serve_configs sets it
    install_gateway(worker, config, GatewaySetup(configs.api, name, config.advertise_url))


def run_server(app: ASGIApp, ns: argparse.Namespace, access_log: bool = True,
               on_exit: Callable[[], None] | None = None) -> None:
    # NOTE: log_config=None: uvicorn's records go to the root handler (configure_logging: text or
    # JSON lines, request id), not to uvicorn's own formatters.
    config = uvicorn.Config(app, host=ns.host, port=ns.port, log_level=ns.log_level.lower(),
                            access_log=access_log, log_config=None)
    server = _DrainingServer(config, on_exit)
    # NOTE: uvicorn re-raises the signal that stopped it once it has shut down gracefully; with
    # non-fatal handlers installed first, that ends here and the process exits 0. Until uvicorn
    # takes the signals over they are kept, not dropped: a supervisor's SIGTERM landing here (a
    # worker drained while it still started) once left the worker serving, "draining" for good.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, server.note_early_signal)
    # NOTE: everything allocated so far (modules, the model, the tokenizer) lives as long as the
    # process: out of the collector's sight, a full collection scans only what requests made since.
    # Left in, each one took 85-220 ms on a 2-core VM, stalling whatever request it landed in.
    gc.collect()
    gc.freeze()
    envs.serving_switch_interval()
    server.run()


class _DrainingServer(uvicorn.Server):
    """SIGTERM/SIGINT: first stop taking work (`on_exit`), then uvicorn's graceful shutdown, which
    waits for the requests in flight (decode streams, prefill hand-offs) to finish. One that came
    before uvicorn listened for signals is acted on as soon as it does (the server then stops
    right after its start-up)."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None] | None) -> None:
        super().__init__(config)
        self._on_exit = on_exit
        self._early_signals: list[int] = []

    def note_early_signal(self, sig: int, frame: FrameType | None) -> None:
        """Before `run` (and again after it: uvicorn's re-raised signal, then of no consequence)."""
        self._early_signals.append(sig)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        with super().capture_signals():
            early, self._early_signals = self._early_signals, []
            for sig in early:
                self.handle_exit(sig, None)
            yield

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._on_exit is not None:
            logging.getLogger("pdserve").info("draining: finishing the requests in flight, taking no new ones")
            self._on_exit()
            self._on_exit = None
        super().handle_exit(sig, frame)
