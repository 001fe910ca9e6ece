"""`pdserve` command line: serve, router, up, make-model, bench. Flags mirror vLLM's engine arguments."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import FrameType

import uvicorn
from starlette.types import ASGIApp

from pdserve import envs
from pdserve.config import EngineArgs


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    d = EngineArgs()
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="Hugging Face Qwen3 checkpoint directory (default: a random-weight demo model built once)")
    g.add_argument("--dtype", default=d.dtype, help="auto, float32, bfloat16 or float16")
    g.add_argument("--device", default=d.device, help="auto, cpu or cuda[:N]")
    g.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="max sequences running at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget of one step")
    g.add_argument("--max-model-len", type=int, default=None, help="context window (prompt + output)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=d.enable_prefix_caching)
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=d.enable_chunked_prefill)
    g.add_argument("--num-kv-blocks", type=int, default=None, help="override the KV pool size in blocks")
    g.add_argument("--kv-cache-memory", default=None, help="KV pool size, e.g. 2GiB (CPU default 2GiB)")
    g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
    g.add_argument("--swap-space", type=float, default=d.swap_space, help="CPU swap space for preemption, GiB")
    g.add_argument("--preemption-mode", choices=["recompute", "swap"], default=None,
                   help="default: swap when --swap-space > 0, else recompute")
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")


def add_kv_transfer_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("KV transfer (prefill and decode roles)")
    g.add_argument("--kv-transport", choices=["nixl", "tcp"], default=None,
                   help="default: nixl when importable, else tcp")
    g.add_argument("--kv-host", default="127.0.0.1", help="decode role: address the KV receiver binds")
    g.add_argument("--kv-port", type=int, default=0, help="decode role: KV receiver port (0: any free port)")
    g.add_argument("--kv-transfer-timeout-ms", type=int, default=None,
                   help="time a KV hand-off may go without progress (env KV_TRANSFER_TIMEOUT_MS, default 100)")
    g.add_argument("--kv-failure-policy", choices=["recompute", "fail"], default="recompute",
                   help="after a timeout and one retry: prefill on the decode worker, or fail the request")


def add_queue_args(parser: argparse.ArgumentParser, role: str) -> None:
    g = parser.add_argument_group("prefill queue")
    g.add_argument("--queue", default="memory",
                   help="'memory' (the router's own FIFO) or redis://host:port/db (Redis Streams, shared by "
                        "every router and prefill worker)")
    g.add_argument("--queue-deployment", default="default", help="Redis key namespace: one stream per deployment")
    if role != "router":
        g.add_argument("--queue-claim-idle-s", type=float, default=5.0,
                       help="prefill: re-deliver a job whose consumer went silent this long")
        g.add_argument("--queue-max-deliveries", type=int, default=3,
                       help="prefill: dead-letter a job after this many deliveries")


def add_router_args(parser: argparse.ArgumentParser) -> None:
    from pdserve.disagg.router import DECODE_POLICIES

    g = parser.add_argument_group("router")
    g.add_argument("--decode-policy", choices=DECODE_POLICIES, default="least-loaded",
                   help="which decode worker gets a request")
    g.add_argument("--pd-threshold", type=int, default=0,
                   help="prompts whose part not cached on the chosen decode worker is shorter than this many "
                        "tokens are prefilled there (0: always disaggregate)")
    g.add_argument("--max-queued-requests", type=int, default=512,
                   help="requests admitted and waiting for their first token; beyond: 429")
    g.add_argument("--max-queued-tokens", type=int, default=1 << 20, help="their prompt tokens; beyond: 429")
    g.add_argument("--reserve-deadline-s", type=float, default=30.0,
                   help="how long a request waits for KV room on a decode worker before a 503")


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(
        model=ns.model, dtype=ns.dtype, device=ns.device, block_size=ns.block_size, max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens, max_model_len=ns.max_model_len,
        enable_prefix_caching=ns.enable_prefix_caching, enable_chunked_prefill=ns.enable_chunked_prefill,
        num_kv_blocks=ns.num_kv_blocks, kv_cache_memory=ns.kv_cache_memory,
        gpu_memory_utilization=ns.gpu_memory_utilization, swap_space=ns.swap_space,
        preemption_mode=ns.preemption_mode, seed=ns.seed, num_threads=ns.num_threads,
    )


def _serve(ns: argparse.Namespace) -> int:
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.serving.app import create_app
    from pdserve.serving.async_engine import AsyncLLM

    args = engine_args_from(ns)
    try:
        timeout_ms = ns.kv_transfer_timeout_ms or envs.kv_transfer_timeout_ms()
        engine = LLMEngine.from_engine_args(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"pdserve: {exc}", file=sys.stderr)
        return 2
    name = ns.served_model_name or (args.model or "pdserve-demo-tiny")
    cfg = engine.config
    logging.getLogger("pdserve").info(
        "%s worker serving %s on http://%s:%d (%s, %s, %d KV blocks of %d tokens, max_model_len %d)", ns.role, name,
        ns.host, ns.port, cfg.device, str(cfg.dtype).removeprefix("torch."), cfg.cache.num_kv_blocks,
        cfg.cache.block_size, cfg.scheduler.max_model_len)
    on_exit: Callable[[], None] | None = None
    if ns.role == "colocated":
        client = AsyncLLM(engine)
        app = create_app(client, name)
    else:
        from pdserve.disagg.worker_app import build_worker, drain

        transport = ns.kv_transport or default_kv_transport()
        options = {"host": ns.kv_host, "port": ns.kv_port} if ns.role == "decode" else {}
        queue_url = ns.queue if ns.role == "prefill" and ns.queue != "memory" else None
        queue_options = {"deployment": ns.queue_deployment, "claim_idle_s": ns.queue_claim_idle_s,
                         "max_deliveries": ns.queue_max_deliveries}
        app, client, service = build_worker(engine, ns.role, name, transport, ns.kv_failure_policy, timeout_ms / 1000,
                                            options, queue_url, queue_options)
        on_exit = partial(drain, service, getattr(service, "consumer", None))
    try:
        # Workers' access logs would only show the router's polling; the router logs client requests.
        _run_server(app, ns, access_log=ns.role == "colocated", on_exit=on_exit)
    finally:
        client.shutdown()
    return 0


def _run_server(app: ASGIApp, ns: argparse.Namespace, access_log: bool = True,
                on_exit: Callable[[], None] | None = None) -> None:
    # NOTE: log_config=None: uvicorn's records go to the root handler (configure_logging: text or
    # JSON lines, request id), not to uvicorn's own formatters.
    config = uvicorn.Config(app, host=ns.host, port=ns.port, log_level=ns.log_level.lower(),
                            access_log=access_log, log_config=None)
    # NOTE: uvicorn re-raises the signal that stopped it once it has shut down gracefully; with
    # no-op handlers installed first, that ends here and the process exits 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    _DrainingServer(config, on_exit).run()


class _DrainingServer(uvicorn.Server):
    """SIGTERM/SIGINT: first stop taking work (`on_exit`), then uvicorn's graceful shutdown, which
    waits for the requests in flight (decode streams, prefill hand-offs) to finish."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None] | None) -> None:
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._on_exit is not None:
            logging.getLogger("pdserve").info("draining: finishing the requests in flight, taking no new ones")
            self._on_exit()
            self._on_exit = None
        super().handle_exit(sig, frame)


def default_kv_transport() -> str:
    from pdserve.disagg.transport import nixl_available

    return "nixl" if nixl_available() else "tcp"


def _router(ns: argparse.Namespace) -> int:
    from pdserve.disagg.router import PDClient, create_router_app
    from pdserve.model.demo_checkpoint import default_model_dir
    from pdserve.model.qwen3_config import Qwen3ModelConfig
    from pdserve.tokenizer import load_tokenizer

    model_dir = ns.model or str(default_model_dir())
    try:
        from pdserve.disagg.queue import make_queue

        config = Qwen3ModelConfig.from_dir(model_dir)
        queue = make_queue(ns.queue, deployment=ns.queue_deployment) if ns.queue != "memory" else None
        client = PDClient(ns.prefill or [], ns.decode, load_tokenizer(model_dir), config, model_dir,
                          ns.max_model_len or config.max_position_embeddings, ns.reserve_deadline_s, queue=queue,
                          decode_policy=ns.decode_policy, pd_threshold=ns.pd_threshold,
                          max_queued_requests=ns.max_queued_requests, max_queued_tokens=ns.max_queued_tokens)
    except (ValueError, FileNotFoundError) as exc:
        print(f"pdserve: {exc}", file=sys.stderr)
        return 2
    name = ns.served_model_name or (ns.model or "pdserve-demo-tiny")
    _run_server(create_router_app(client, name), ns)
    return 0


def _make_model(ns: argparse.Namespace) -> int:
    from pdserve.model.demo_checkpoint import PRESETS, write_checkpoint

    out = write_checkpoint(ns.out, PRESETS[ns.preset], seed=ns.seed)
    print(f"wrote random-weight Qwen3 ({ns.preset}) to {out}; its text output is random")
    return 0


def add_bench_command(sub: argparse._SubParsersAction) -> None:
    """`pdserve bench [sweep | compare | capacity]`: the load generator (pdserve/bench/serve/)."""
    from pdserve.bench.serve.command import add_bench_parser

    def run(ns: argparse.Namespace) -> int:
        try:
            return int(ns.bench_run(ns))
        except (ValueError, RuntimeError, OSError) as exc:
            print(f"pdserve bench: {exc}", file=sys.stderr)
            return 2

    add_bench_parser(sub).set_defaults(func=run)


def build_parser() -> argparse.ArgumentParser:
    from pdserve.model.demo_checkpoint import PRESETS

    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument("--log-format", default="text", choices=["text", "json"],
                        help="text lines, or one JSON object per line (time, level, logger, request_id, message)")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="OpenAI-compatible server (colocated prefill + decode)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None, help="model id clients send (default: --model)")
    serve.add_argument("--role", choices=["colocated", "prefill", "decode"], default="colocated")
    add_engine_args(serve)
    add_kv_transfer_args(serve)
    serve.set_defaults(func=_serve)
    add_queue_args(serve, role="worker")
    router = sub.add_parser("router", help="OpenAI-compatible front of prefill and decode workers")
    router.add_argument("--prefill", nargs="+", default=[], metavar="URL",
                        help="prefill worker URLs (optional with a Redis queue: its consumers are the prefill pool)")
    router.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode worker URLs")
    router.add_argument("--model", default=None, help="checkpoint dir, for the tokenizer and config")
    router.add_argument("--served-model-name", default=None)
    router.add_argument("--max-model-len", type=int, default=None)
    router.add_argument("--host", default="127.0.0.1")
    router.add_argument("--port", type=int, default=8000)
    add_queue_args(router, role="router")
    add_router_args(router)
    router.set_defaults(func=_router)
    up = sub.add_parser("up", help="router + prefill + decode workers on this machine, one command")
    up.add_argument("--prefill", type=int, default=1, help="number of prefill workers")
    up.add_argument("--decode", type=int, default=1, help="number of decode workers")
    up.add_argument("--port", type=int, default=8000, help="the router's port")
    up.add_argument("--kv-transport", choices=["nixl", "tcp"], default=None)
    up.add_argument("--model", default=None)
    up.add_argument("--prefill-threads", type=int, default=None,
                    help="torch threads per prefill worker (default: CPUs // workers)")
    up.add_argument("--decode-threads", type=int, default=None,
                    help="torch threads per decode worker (default: CPUs // workers)")
    add_queue_args(up, role="up")
    add_router_args(up)
    up.set_defaults(func=None)
    make = sub.add_parser("make-model", help="write a random-weight Qwen3 checkpoint (HF layout, real tokenizer)")
    make.add_argument("out", type=Path)
    make.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    make.add_argument("--seed", type=int, default=0)
    make.set_defaults(func=_make_model)
    add_bench_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # `pdserve up` passes every flag it does not know (engine flags) on to its workers.
    ns, extra = build_parser().parse_known_args(argv)
    if ns.command == "up":
        from pdserve.ops.up import run

        flags = [*extra, *(["--model", ns.model] if ns.model else [])]
        return run(ns, flags)
    if extra:
        build_parser().error(f"unrecognized arguments: {' '.join(extra)}")
    from pdserve.logs import configure_logging

    configure_logging(ns.log_level, ns.log_format)
    return int(ns.func(ns))


if __name__ == "__main__":
    sys.exit(main())
