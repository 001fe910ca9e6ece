"""`pdserve` command line: serve, router, up, make-model, bench. Flags mirror vLLM's engine arguments.

The engine, worker and router flags are generated from their configs (config.py, config_flags.py);
this module adds only what belongs to a command itself (where to listen, how many workers).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.addresses import parse_member
from pdserve.config import KV_CACHE_DTYPES, EngineArgs
from pdserve.config_flags import add_config_args, config_from_args
from pdserve.disagg.config import RouterConfig, WorkerConfig
from pdserve.ops.serve import DEMO_MODEL_NAME, run_server, validate_worker
from pdserve.ops.serve import serve as serve_command
from pdserve.ops.supervisor import exit_with_supervisor
from pdserve.ops.threads import CorePlan, parse_cpu_list
from pdserve.serving.config import ApiConfig
from pdserve.sizing.commands import add_sizing_commands, guarded

if TYPE_CHECKING:
    from pdserve.disagg.router.core import PDRouter
    from pdserve.ops.up import UpOptions


# NOTE: where the servers listen unless told otherwise (serve, router; up's router)
_HOST = "127.0.0.1"
_PORT = 8000


def _router(ns: argparse.Namespace) -> int:
    from pdserve.disagg.router.app import create_router_app
    from pdserve.model.demo_checkpoint import default_model_dir

    router = config_from_args(RouterConfig, ns)
    api = config_from_args(ApiConfig, ns)
    try:
        router.validate()
        api.validate()
        api.api_keys()
        model_dir = ns.model or str(default_model_dir())
        client = _router_client(router, model_dir, ns.max_model_len)
    except (ValueError, OSError) as exc:
        print(f"pdserve: {exc}", file=sys.stderr)
        return 2
    name = ns.served_model_name or (ns.model or DEMO_MODEL_NAME)
    run_server(create_router_app(client, name, api), ns, on_exit=lambda: setattr(client.pool, "stopping", True))
    return 0


def _balancer(ns: argparse.Namespace) -> int:
    from pdserve.ops.balancer import Balancer, create_balancer_app

    api = config_from_args(ApiConfig, ns)
    try:
        api.validate()
        api.api_keys()
        balancer = Balancer(ns.replica)
    except (ValueError, OSError) as exc:
        print(f"pdserve: {exc}", file=sys.stderr)
        return 2
    run_server(create_balancer_app(balancer, api), ns)
    return 0


def _router_client(router: RouterConfig, model_dir: str, max_model_len: int | None) -> PDRouter:
    from pdserve.disagg.router.core import PDRouter
    from pdserve.model.qwen3_config import Qwen3ModelConfig
    from pdserve.tokenizer import load_tokenizer

    model = Qwen3ModelConfig.from_dir(model_dir)
    return PDRouter.from_config(router, load_tokenizer(model_dir), model, model_dir,
                                max_model_len or model.max_context_len)


def _up(ns: argparse.Namespace, engine_flags: list[str]) -> int:
    from pdserve.logs import configure_logging
    from pdserve.model.qwen3_config import Qwen3ModelConfig
    from pdserve.ops.up import run

    _check_up_counts(ns)
    configure_logging(ns.log_level, ns.log_format, ns.access_log)
    options, router, worker, worker_flags = up_plan(ns, engine_flags)
    autoscale = None
    if ns.autoscale:
        from pdserve.ops.autoscale import AutoscaleConfig

        autoscale = config_from_args(AutoscaleConfig, ns)
    try:
        router.validate()
        options.api.validate()
        options.api.api_keys()
        validate_worker(worker)
        if autoscale is not None:
            autoscale.validate()
        if options.cpus_per_worker is not None:
            CorePlan(options.cpus_per_worker)
        if ns.model:  # NOTE: else every process would fail on it, restarted with backoff until its slot fails
            Qwen3ModelConfig.from_dir(ns.model)
    except (ValueError, OSError) as exc:
        print(f"pdserve up: {exc}", file=sys.stderr)
        return 2
    return run(options, router, worker, worker_flags, autoscale)


def _check_up_counts(ns: argparse.Namespace) -> None:
    """--prefill/--decode (default 1 each) or --colocated N, never both; MIN:MAX only with --autoscale."""
    from pdserve.ops.up import Replicas

    if ns.colocated is not None:
        if ns.num_prefill is not None or ns.num_decode is not None or ns.autoscale:
            ns.up_parser.error("--colocated N runs N colocated replicas: it takes no --prefill, --decode or "
                               "--autoscale")
        if ns.colocated < 1:
            ns.up_parser.error(f"--colocated {ns.colocated}: expected at least 1")
    prefill, decode = ns.num_prefill or Replicas(1, 1), ns.num_decode or Replicas(1, 1)
    if not ns.autoscale and not (prefill.fixed and decode.fixed):
        ns.up_parser.error(f"--prefill {prefill} --decode {decode}: a MIN:MAX range needs --autoscale")


def up_plan(ns: argparse.Namespace, engine_flags: list[str]) -> tuple[UpOptions, RouterConfig, WorkerConfig, list[str]]:
    """What `pdserve up` was told: its own options, the router's and the workers' configs, and the
    flags every worker gets after those (the engine flags it does not know, and --model)."""
    from pdserve.ops.up import Replicas, UpOptions

    options = UpOptions(ns.port, ns.num_prefill or Replicas(1, 1), ns.num_decode or Replicas(1, 1),
                        ns.port + 1 if ns.supervisor_port is None else ns.supervisor_port,
                        ns.prefill_threads, ns.decode_threads, ns.model,
                        ("--log-level", ns.log_level, "--log-format", ns.log_format,
                         "--access-log", "all" if ns.up_access_log else "quiet"), config_from_args(ApiConfig, ns),
                        ns.colocated or 0, ns.cpus_per_worker,
                        tuple((role, dtype) for role in ("prefill", "decode")
                              if (dtype := getattr(ns, f"{role}_kv_cache_dtype")) is not None), ns.host)
    # NOTE: the router's config has no worker URLs: `up`'s workers register with it
    router = config_from_args(RouterConfig, ns, accept_registrations=True)
    worker = config_from_args(WorkerConfig, ns, register=(options.router_url,))
    lora = ["--enable-lora"] if router.enable_lora else []  # NOTE: the router's flag; the workers serve them
    return options, router, worker, [*engine_flags, *lora, *_kv_events_flags(router, engine_flags, options.host),
                                     *(["--model", ns.model] if ns.model else [])]


def _kv_events_flags(router: RouterConfig, engine_flags: list[str], host: str | None) -> list[str]:
    """A router that routes by KV-cache events needs workers that publish them: unless the events
    were configured, every worker publishes on free ports of the address it serves on."""
    if "kv-events" not in (router.decode_policy, router.prefill_policy) or any(
            flag.split("=", 1)[0] == "--kv-events-config" for flag in engine_flags):
        return []
    bind = "127.0.0.1" if host is None else "*" if host in ("0.0.0.0", "::") else host
    return ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                              "endpoint": f"tcp://{bind}:0", "replay_endpoint": f"tcp://{bind}:0"})]


def _make_model(ns: argparse.Namespace) -> int:
    from pdserve.model.demo_checkpoint import PRESETS, QWEN3_SHAPES, ModelVariant, write_checkpoint
    from pdserve.model.fp8 import FP8BlockQuantization

    shape = (PRESETS | QWEN3_SHAPES)[ns.preset]
    # NOTE: the real shapes in shards of 4 GiB, as Hugging Face writes large checkpoints
    shard = 4 << 30 if ns.preset in QWEN3_SHAPES else None
    quantization = None if ns.quantize is None else FP8BlockQuantization((ns.weight_block_size, ns.weight_block_size))
    try:
        rope_scaling = None if ns.rope_scaling is None else json.loads(ns.rope_scaling)
        variant = ModelVariant(rope_scaling=rope_scaling, quantization=quantization)
        shape.config(variant)  # NOTE: read as the engine will, refused before any weight is drawn
    except (ValueError, TypeError, AttributeError) as exc:
        print(f"pdserve make-model: --rope-scaling: {exc}", file=sys.stderr)
        return 2
    out = write_checkpoint(ns.out, shape, seed=ns.seed, device=ns.device, max_shard_bytes=shard, variant=variant)
    kind = "" if quantization is None else f", block-FP8 weights ({ns.weight_block_size}x{ns.weight_block_size})"
    print(f"wrote random-weight Qwen3 ({ns.preset}{kind}) to {out}; its text output is random")
    return 0


def add_bench_command(sub: argparse._SubParsersAction) -> None:
    """`pdserve bench [sweep | compare | capacity]`: the load generator (pdserve/bench/serve/)."""
    from pdserve.bench.serve.command import add_bench_parser

    add_bench_parser(sub).set_defaults(func=lambda ns: guarded("bench", ns.bench_run)(ns))


def _add_listen_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default=_HOST, help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=_PORT, help="port to listen on")


def _add_serve_parser(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible server (colocated prefill + decode)")
    _add_listen_args(serve)
    serve.add_argument("--served-model-name", default=None, help="model id clients send (default: --model)")
    # NOTE: not WorkerConfig.role: "colocated" is no worker role, it means no WorkerConfig at all
    serve.add_argument("--role", choices=["colocated", "prefill", "decode"], default="colocated")
    serve.add_argument("--engine-in-process", action="store_true",
                       help="run the engine (and a prefill or decode worker's KV transport) on threads of the "
                            "API server's process, not in an engine process of its own (also "
                            "PDSERVE_ENGINE_IN_PROCESS=1)")
    serve.add_argument("--cpu-affinity", type=_argparse_type(parse_cpu_list), default=None, metavar="CPUS",
                       help="pin this process to these cores, e.g. 0-3 or 0,2 (one worker = one 'device')")
    add_config_args(serve, EngineArgs, title="engine")
    add_config_args(serve, WorkerConfig, title="worker (prefill and decode roles)", exclude=("role",))
    add_config_args(serve, ApiConfig, title="OpenAI API (colocated role; the router's in PD)")
    serve.set_defaults(func=serve_command)


def _add_router_parser(sub: argparse._SubParsersAction) -> None:
    router = sub.add_parser("router", help="OpenAI-compatible front of prefill and decode workers")
    _add_listen_args(router)
    router.add_argument("--model", default=None, help="checkpoint dir, for the tokenizer and config")
    router.add_argument("--served-model-name", default=None)
    router.add_argument("--max-model-len", type=int, default=None)
    add_config_args(router, RouterConfig, title="router")
    add_config_args(router, ApiConfig, title="OpenAI API")
    router.set_defaults(func=_router)


def _add_balancer_parser(sub: argparse._SubParsersAction) -> None:
    balancer = sub.add_parser("balancer", help="OpenAI endpoint in front of N colocated replicas (pdserve serve): "
                                               "each request to the least busy ready one")
    _add_listen_args(balancer)
    balancer.add_argument("--replica", action="append", required=True, metavar="URL", type=_argparse_type(_replica_url),
                          help="a replica's root URL (repeat for each)")
    add_config_args(balancer, ApiConfig, title="OpenAI API")
    balancer.set_defaults(func=_balancer)


# NOTE: what `up` decides itself: the membership (workers register with its router), the roles
UP_SETS_ROUTER = ("prefill", "decode", "accept_registrations", "dns_server", "dns_interval_s")
UP_SETS_WORKER = ("role", "register", "advertise_url")


def _add_up_parser(sub: argparse._SubParsersAction) -> None:
    from pdserve.ops.autoscale import AutoscaleConfig
    from pdserve.ops.up import Replicas

    up = sub.add_parser("up", help="router + prefill + decode workers on this machine, one command, kept running "
                                   "(restarted when they exit); flags it does not know (engine flags) go to every "
                                   "worker")
    # NOTE: counts here, where `router` takes URLs: other dests, so config_from_args never reads them
    replicas = _argparse_type(Replicas.parse)
    up.add_argument("--prefill", type=replicas, default=None, dest="num_prefill", metavar="N|MIN:MAX",
                    help="prefill workers: N, or MIN:MAX with --autoscale (default 1)")
    up.add_argument("--decode", type=replicas, default=None, dest="num_decode", metavar="N|MIN:MAX",
                    help="decode workers: N, or MIN:MAX with --autoscale (default 1)")
    up.add_argument("--colocated", type=int, default=None, metavar="N",
                    help="instead of prefill and decode workers: N colocated replicas (pdserve serve) behind a "
                         "balancer (pdserve balancer) on the router's port; the baseline PD is measured against")
    up.add_argument("--cpus-per-worker", type=int, default=None, metavar="K",
                    help="pin each worker to K cores of its own (one worker = one 'device'; they wrap round, "
                         "said in the log, when workers x K exceeds the cores); its torch threads default to K")
    up.add_argument("--autoscale", action="store_true",
                    help="grow and shrink each role within its MIN:MAX (starting at MIN) by the autoscaling rules")
    up.add_argument("--host", default=_HOST, help="where the router, the workers and the supervisor's metrics "
                    "listen (0.0.0.0: every interface, e.g. in a container; up reaches them on 127.0.0.1)")
    up.add_argument("--port", type=int, default=_PORT, help="the router's port")
    up.add_argument("--access-log", action="store_true", dest="up_access_log",
                    help="every process's every access line: the supervisor's polls, the workers' heartbeats and "
                         "the readiness probes too (default: a client's requests only)")
    up.add_argument("--supervisor-port", type=int, default=None,
                    help="where the supervisor serves its metrics (restarts, workers by state, autoscaler); "
                         "default: the router's port + 1; 0: not served")
    up.add_argument("--model", default=None)
    up.add_argument("--prefill-threads", type=int, default=None,
                    help="torch threads per prefill worker (default: CPUs // workers when it starts)")
    up.add_argument("--decode-threads", type=int, default=None,
                    help="torch threads per decode worker (default: CPUs // workers when it starts)")
    for role in ("prefill", "decode"):  # the KV hand-off converts between them (docs/MODELS.md, "KV cache dtype")
        up.add_argument(f"--{role}-kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None,
                        help=f"--kv-cache-dtype of the {role} workers only (default: --kv-cache-dtype's)")
    add_config_args(up, RouterConfig, title="router", exclude=UP_SETS_ROUTER)
    add_config_args(up, ApiConfig, title="the router's OpenAI API")
    # the router's group has the queue and cluster secret flags already (both configs read them);
    # prefill and decode roles come from the counts
    add_config_args(up, WorkerConfig, title="workers", exclude=("queue", "cluster_secret_file", *UP_SETS_WORKER))
    add_config_args(up, AutoscaleConfig, title="autoscale (with --autoscale)")
    up.set_defaults(func=None, up_parser=up)


def _replica_url(text: str) -> str:
    member = parse_member(text)
    if not isinstance(member, str):
        raise ValueError(f"expected a replica's root URL, e.g. http://127.0.0.1:8001, got {text!r}")
    return member


def _argparse_type(parse: Callable[[str], object]) -> Callable[[str], object]:
    """`parse` for argparse's `type=`: its ValueError's message becomes the usage error."""
    def convert(text: str) -> object:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def build_parser() -> argparse.ArgumentParser:
    from pdserve.model.demo_checkpoint import PRESETS, QWEN3_SHAPES

    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument("--log-format", default="text", choices=["text", "json"],
                        help="text lines, or one JSON object per line (time, level, logger, request_id, message)")
    parser.add_argument("--access-log", default="requests", choices=["requests", "quiet", "all"],
                        help="HTTP access lines: every request but successful probes (requests), a client's "
                             "requests only, not the deployment's own polls, heartbeats and probes (quiet: what "
                             "`pdserve up` runs with), or every one, workers' too (all)")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve_parser(sub)
    _add_router_parser(sub)
    _add_balancer_parser(sub)
    _add_up_parser(sub)
    make = sub.add_parser("make-model", help="write a random-weight Qwen3 checkpoint (HF layout, real tokenizer)")
    make.add_argument("out", type=Path)
    make.add_argument("--preset", choices=sorted(PRESETS | QWEN3_SHAPES), default="tiny")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--device", default="cpu", help="where the random weights are drawn (cuda: much faster for "
                      "large shapes; the same seed gives other weights than on cpu)")
    make.add_argument("--quantize", choices=["fp8"], default=None,
                      help="write the projection weights in block-wise FP8 (e4m3) with their weight_scale_inv, as "
                           "Qwen's -FP8 checkpoints")
    make.add_argument("--weight-block-size", type=int, default=128, help="--quantize fp8: the square block size")
    make.add_argument("--rope-scaling", default=None,
                      help='config.json\'s rope_scaling, e.g. \'{"rope_type": "yarn", "factor": 4.0, '
                           '"original_max_position_embeddings": 32768}\'')
    make.set_defaults(func=_make_model)
    add_bench_command(sub)
    add_sizing_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # `pdserve up` passes every flag it does not know (engine flags) on to its workers.
    ns, extra = build_parser().parse_known_args(argv)
    if ns.command == "up":
        return _up(ns, extra)
    if extra:
        build_parser().error(f"unrecognized arguments: {' '.join(extra)}")
    from pdserve.logs import configure_logging

    configure_logging(ns.log_level, ns.log_format, ns.access_log)
    exit_with_supervisor()
    return int(ns.func(ns))


if __name__ == "__main__":
    sys.exit(main())
