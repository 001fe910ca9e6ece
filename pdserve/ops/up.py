"""`pdserve up`: the router and the prefill and decode workers as processes on this machine, one
command, kept running.

Starts the router (it accepts registrations), then the workers, each of which registers with it
once it is serving; splits the CPU threads over the workers; waits until one request has gone
through end to end; prints the URL and a curl line. From then on the supervisor (supervisor.py)
restarts whatever exits unexpectedly, with backoff, and never stops the rest because one died;
with `--autoscale` the autoscaler adds and drains workers within each role's bounds. Ctrl-C (or
SIGTERM) stops everything: workers drain, and a second one hurries that without orphaning any.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIServer

import httpx
from prometheus_client import CollectorRegistry, start_http_server

from pdserve.addresses import http_url
from pdserve.config_flags import to_argv
from pdserve.disagg.config import RouterConfig, WorkerConfig
from pdserve.logs import UP_PROBE_QUERY
from pdserve.ops.supervisor import HOST, PoolEntry, ProcessHost, SlotRole, Supervisor, free_port, reach_host
from pdserve.ops.threads import CorePlan, CoreShare, format_cpu_list, num_cpus, threads_per_worker
from pdserve.serving.config import ApiConfig

if TYPE_CHECKING:
    from pdserve.ops.autoscale import AutoscaleConfig
    from pdserve.ops.scaling import AutoscaleLoop

logger = logging.getLogger(__name__)

_READY_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class Replicas:
    """A role's size: `N` (fixed) or `MIN:MAX` (what `--autoscale` may do)."""

    min: int
    max: int

    @classmethod
    def parse(cls, text: str) -> Replicas:
        low, colon, high = text.partition(":")
        try:
            replicas = cls(int(low), int(high) if colon else int(low))
        except ValueError:
            raise ValueError(f"{text!r}: expected N or MIN:MAX") from None
        if not 0 < replicas.min <= replicas.max:
            raise ValueError(f"{text!r}: expected 0 < MIN <= MAX")
        return replicas

    @property
    def fixed(self) -> bool:
        return self.min == self.max

    def __str__(self) -> str:
        return str(self.min) if self.fixed else f"{self.min}:{self.max}"


@dataclass(frozen=True, slots=True)
class UpOptions:
    """What `pdserve up` itself was told (the router's and workers' configs travel apart)."""

    port: int  # the router's
    prefill: Replicas
    decode: Replicas
    supervisor_port: int  # the supervisor's metrics; 0: none
    prefill_threads: int | None = None  # None: CPUs // workers
    decode_threads: int | None = None
    model: str | None = None
    log_flags: tuple[str, ...] = ()  # --log-level / --log-format, for every process
    api: ApiConfig = field(default_factory=ApiConfig)  # the router's client keys and caps
    colocated: int = 0  # > 0: that many colocated replicas behind a balancer, no prefill or decode workers
    cpus_per_worker: int | None = None  # each worker pinned to its own cores (None: not pinned)
    kv_cache_dtypes: tuple[tuple[str, str], ...] = ()  # (role, --kv-cache-dtype): over the engine flags'
    host: str = HOST  # where the router, the workers and the supervisor's metrics listen (0.0.0.0: everywhere)

    @property
    def reach(self) -> str:
        """Where this machine reaches them (the loopback address for a wildcard --host)."""
        return reach_host(self.host)

    @property
    def router_url(self) -> str:
        return http_url(self.reach, self.port)

    @property
    def router_headers(self) -> dict[str, str]:
        """What the supervisor sends its router (GET /workers, the readiness completion): a client key."""
        keys = self.api.api_keys()
        return {"Authorization": f"Bearer {keys[0]}"} if keys else {}

    def router_env(self) -> dict[str, str]:
        """The router's environment besides up's own. NOTE: --api-key values travel in it, not in
        argv, so no key shows in `ps`; --api-key-file travels as the path it is."""
        from pdserve import envs

        keys = (*self.api.api_key, *envs.api_keys())
        return {envs.API_KEY: ",".join(keys)} if keys else {}


def cluster_secret_env(router: RouterConfig) -> dict[str, str]:
    """`up` always runs its cluster with a secret: --cluster-secret-file (every child gets the path),
    else PDSERVE_CLUSTER_SECRET as given, else a random one made here. NOTE: it travels in the
    children's environment (readable by this user only), never in argv."""
    from pdserve import envs
    from pdserve.disagg.auth import new_secret

    if router.cluster_secret_file is not None or envs.cluster_secret() is not None:
        return {}
    return {envs.CLUSTER_SECRET: new_secret()}


@dataclass(frozen=True, slots=True)
class CommandLines:
    """The command line of each process `up` starts; a worker's thread count is the split of the
    pool as it is when that worker starts (`--prefill-threads` / `--decode-threads` override it,
    and a `--num-threads` among the engine flags overrides both)."""

    options: UpOptions
    router: RouterConfig  # no worker URLs, accepts registrations: any worker can come and go
    worker: WorkerConfig  # registers with the router (its role is each slot's)
    engine_flags: tuple[str, ...]  # every worker's, after up's own (so they win); --model included
    cpus: int
    replica_urls: list[str] = field(default_factory=list)  # up --colocated: the balancer's replicas
    cores: CorePlan | None = None  # up --cpus-per-worker

    def __call__(self, role: SlotRole, port: int, num_workers: int) -> list[str]:
        head = [sys.executable, "-m", "pdserve.cli", *self.options.log_flags]
        listen = ["--host", self.options.host]
        api = to_argv(self.options.api, exclude=("api_key",))
        if role == "router" and self.options.colocated:
            return [*head, "balancer", *listen, "--port", str(port), *(f"--replica={url}" for url in self.replica_urls),
                    *api]
        if role == "router":
            model = ["--model", self.options.model] if self.options.model else []
            return [*head, "router", *listen, "--port", str(port), *to_argv(self.router), *api, *model]
        explicit = {"prefill": self.options.prefill_threads, "decode": self.options.decode_threads}.get(role)
        # NOTE: --num-threads is per tensor-parallel rank: a worker's share of the cores is split over its ranks
        share = self.options.cpus_per_worker or threads_per_worker(num_workers, self.cpus)
        threads = explicit or max(1, share // _tensor_parallel_size(self.engine_flags))
        pin = [] if self.cores is None else ["--cpu-affinity", format_cpu_list(self.cores.for_worker(port))]
        if role == "replica":  # a colocated server: the client API is its own
            return [*head, "serve", "--num-threads", str(threads), *pin, *api, *self.engine_flags, *listen, "--port",
                    str(port)]
        # NOTE: later flags win: the engine flags over --num-threads and over the worker config; the
        # role and port over anything in the engine flags
        kv_dtype = [f"--kv-cache-dtype={dtype}" for of, dtype in self.options.kv_cache_dtypes if of == role]
        # NOTE: a worker listening everywhere registers the address up reaches it at, not the pod's IP
        advertise = ["--advertise-url", http_url(self.options.reach, port)] if self.options.reach != self.options.host \
            else []
        return [*head, "serve", "--num-threads", str(threads), *pin, *to_argv(self.worker, exclude=("role",)),
                *self.engine_flags, *kv_dtype, *listen, *advertise, "--role", role, "--port", str(port)]


def _tensor_parallel_size(engine_flags: tuple[str, ...]) -> int:
    """The workers' --tensor-parallel-size among the engine flags (the last one wins), else 1."""
    size = 1
    for at, flag in enumerate(engine_flags):
        if flag == "--tensor-parallel-size" and at + 1 < len(engine_flags):
            size = int(engine_flags[at + 1])
        elif flag.startswith("--tensor-parallel-size="):
            size = int(flag.split("=", 1)[1])
    return max(1, size)


def read_pool(http: httpx.Client, router_url: str) -> list[PoolEntry] | None:
    """The router's GET /workers as the supervisor needs it; None when the router does not answer."""
    try:
        reply = http.get(f"{router_url}/workers")
        reply.raise_for_status()
        listed: list[dict[str, Any]] = reply.json()
    except (httpx.HTTPError, ValueError):
        return None
    return [PoolEntry(w["url"], bool(w["ready"]), int(w["in_flight"]) + _engine_work(w.get("load"))) for w in listed]


def _engine_work(load: dict[str, Any] | None) -> int:
    return 0 if load is None else int(load["num_running"]) + int(load["num_waiting"])


@dataclass(frozen=True, slots=True)
class RouterEndpoint:
    """Where the monitor reads the router's pool, and the headers it sends (a client key)."""

    url: str
    headers: dict[str, str] | None = None


class Monitor:
    """The loop that keeps the deployment going, on a thread of its own (signals reach only the main
    thread, so a Ctrl-C never lands between starting a process and recording it): ticks the
    supervisor, reads the router's pool and runs the autoscaler once a second."""

    def __init__(self, supervisor: Supervisor, router: RouterEndpoint, cores: CoreShare,
                 autoscale: AutoscaleLoop | None = None, period_s: float = 0.2, poll_s: float = 1.0) -> None:
        self._supervisor = supervisor
        self._router_url = router.url
        self._headers = router.headers or {}
        self._cores = cores
        self._autoscale = autoscale
        self._period_s = period_s
        self._poll_s = poll_s
        self._next_poll = 0.0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdserve-up-monitor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Returns once the loop has ended: nothing is started after this."""
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        with httpx.Client(timeout=1.0, headers=self._headers) as http:
            while not self._done.is_set():
                try:
                    self.step(http)
                except Exception:  # noqa: BLE001 - the loop must outlive a bad round
                    logger.exception("pdserve up: supervisor round failed")
                self._done.wait(self._period_s)

    def step(self, http: httpx.Client) -> None:
        self._cores.note(self._supervisor.num_workers())
        self._supervisor.tick()
        if time.monotonic() < self._next_poll:
            return
        self._next_poll = time.monotonic() + self._poll_s
        self._supervisor.observe_pool(read_pool(http, self._router_url))
        if self._autoscale is not None:
            self._autoscale.tick()


def wait_ready(supervisor: Supervisor, router_url: str, timeout_s: float = _READY_TIMEOUT_S,
               headers: dict[str, str] | None = None) -> None:
    """Until the router is ready (GET /ready) and a completion goes through it (RuntimeError if a
    role can no longer start). NOTE: the completion is sent only once the router says it is ready,
    so it gets no 503s to log; it names itself (UP_PROBE_QUERY): a quiet access log leaves it out."""
    deadline = time.monotonic() + timeout_s
    body = {"prompt": "Hello", "max_tokens": 2}
    with httpx.Client(timeout=30, headers=headers) as http:
        while time.monotonic() < deadline:
            if why := supervisor.hopeless():
                raise RuntimeError(why)
            try:
                if http.get(f"{router_url}/ready").status_code == 200 and http.post(
                        f"{router_url}/v1/completions?{UP_PROBE_QUERY}", json=body).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    raise RuntimeError(f"no request went through within {timeout_s:.0f} s")


class _Interrupts:
    """Ctrl-C / SIGTERM: the first unwinds the main thread to the cleanup (KeyboardInterrupt); any
    later one only hurries the cleanup, which it must never interrupt (that would orphan workers)."""

    def __init__(self) -> None:
        self.stopping = False
        self.hurry = False
        # NOTE: SIGINT explicitly too: a shell that starts us in the background leaves it ignored
        signal.signal(signal.SIGINT, self._handle)
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, *_: object) -> None:
        if self.stopping:
            self.hurry = True
            return
        self.stopping = True
        raise KeyboardInterrupt


def _banner(options: UpOptions, metrics_url: str | None) -> None:
    url = options.router_url
    workers = (f"{options.colocated} colocated replicas" if options.colocated
               else f"{options.prefill} prefill + {options.decode} decode workers")
    pinned = f", {options.cpus_per_worker} core(s) each" if options.cpus_per_worker else ""
    print(f"\npdserve is up: {workers}{pinned} behind {url}")
    print(f"  workers: curl -s {url}/workers")
    if metrics_url:
        print(f"  supervisor: curl -s {metrics_url}")
    print(f"  try:     curl -s {url}/v1/chat/completions -H 'content-type: application/json' "
          "-d '{\"messages\":[{\"role\":\"user\",\"content\":\"Hello!\"}],\"max_tokens\":32}'")
    print("Ctrl-C stops everything.", flush=True)


def start_pool(options: UpOptions, router: RouterConfig, worker: WorkerConfig, engine_flags: list[str],
               registry: CollectorRegistry) -> Supervisor:
    """The supervisor with the router's slot and each role's minimum (started by its first tick)."""
    cpus = num_cpus()
    cores = None if options.cpus_per_worker is None else CorePlan(options.cpus_per_worker)
    commands = CommandLines(options, router, worker, tuple(engine_flags), cpus, cores=cores)
    host = ProcessHost(new_port=lambda: free_port(options.host or "0.0.0.0"))
    supervisor = Supervisor(commands, registry=registry, reserved_ports=(options.supervisor_port,), host=host,
                            reach=options.reach)
    supervisor.add("router", options.port)
    if options.colocated:  # NOTE: the balancer's command line is made at its first start, after these
        commands.replica_urls.extend(supervisor.add("replica").url for _ in range(options.colocated))
        return supervisor
    for _ in range(options.decode.min):
        supervisor.add("decode")
    for _ in range(options.prefill.min):
        supervisor.add("prefill")
    return supervisor


def run(options: UpOptions, router: RouterConfig, worker: WorkerConfig, engine_flags: list[str],
        autoscale: AutoscaleConfig | None = None) -> int:
    # Build the demo checkpoint once here, not concurrently in every worker.
    if options.model is None:
        from pdserve.model.demo_checkpoint import default_model_dir

        default_model_dir()
    # NOTE: every child inherits it; only the router reads it (workers serve no client API)
    os.environ.update(options.router_env())
    os.environ.update(cluster_secret_env(router))
    registry = CollectorRegistry()
    supervisor = start_pool(options, router, worker, engine_flags, registry)
    try:
        scaler = None if autoscale is None else _autoscale_loop(autoscale, options, supervisor, registry)
    except ValueError as exc:  # e.g. a pre-warm above a role's maximum
        print(f"pdserve up: {exc}", file=sys.stderr)
        return 2
    monitor = Monitor(supervisor, RouterEndpoint(options.router_url, options.router_headers), CoreShare(), scaler)
    metrics = None
    # NOTE: no process runs before the monitor starts, inside the try: the cleanup reaches every one
    interrupts = _Interrupts()
    try:
        metrics = _serve_metrics(registry, options.supervisor_port, options.host)
        monitor.start()
        wait_ready(supervisor, options.router_url, headers=options.router_headers)
        _banner(options, http_url(options.reach, options.supervisor_port) + "/metrics" if metrics else None)
        _serve_until_interrupted(supervisor)
        return 0
    except RuntimeError as exc:
        print(f"pdserve up: {exc}; stopping", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        interrupts.stopping = True
        monitor.stop()
        supervisor.stop(hurried=lambda: interrupts.hurry)
        if metrics is not None:
            metrics.shutdown()


def _serve_until_interrupted(supervisor: Supervisor) -> None:
    """Sleep: the monitor does the work. A role whose every slot failed is said once, and the rest
    stays up (the autoscaler, if on, starts new slots up to the role's minimum)."""
    said = None
    while True:
        if (why := supervisor.hopeless()) and why != said:
            logger.error("pdserve up: %s: the deployment cannot serve until that is fixed (Ctrl-C stops it)", why)
        said = why
        time.sleep(0.5)


def _serve_metrics(registry: CollectorRegistry, port: int, host: str) -> WSGIServer | None:
    """The supervisor's metrics on http://HOST:PORT/metrics (port 0: not served)."""
    if not port:
        return None
    try:
        return start_http_server(port, addr=host, registry=registry)[0]
    except OSError as exc:
        raise RuntimeError(f"cannot serve the supervisor's metrics on port {port} ({exc}); "
                           "choose another with --supervisor-port, or 0 for none") from exc


def _autoscale_loop(config: AutoscaleConfig, options: UpOptions, supervisor: Supervisor,
                    registry: CollectorRegistry) -> AutoscaleLoop:
    from pdserve.ops.autoscale import Autoscaler, Role
    from pdserve.ops.scaling import AutoscaleLoop

    bounds: dict[Role, tuple[int, int]] = {"prefill": (options.prefill.min, options.prefill.max),
                                           "decode": (options.decode.min, options.decode.max)}
    return AutoscaleLoop(Autoscaler(config, bounds, registry=registry), supervisor, options.router_url)
