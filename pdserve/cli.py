"""`pdserve` command line: serve, make-model. Flags mirror vLLM's engine arguments."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

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
    import uvicorn

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
    if ns.role == "colocated":
        client = AsyncLLM(engine)
        app = create_app(client, name)
    else:
        from pdserve.disagg.worker_app import build_worker

        transport = ns.kv_transport or default_kv_transport()
        options = {"host": ns.kv_host, "port": ns.kv_port} if ns.role == "decode" else {}
        app, client, _ = build_worker(engine, ns.role, name, transport, ns.kv_failure_policy, timeout_ms / 1000,
                                      options)
    try:
        # Workers' access logs would only show the router's polling; the router logs client requests.
        uvicorn.run(app, host=ns.host, port=ns.port, log_level=ns.log_level.lower(), access_log=ns.role == "colocated",
                    log_config=None)
    finally:
        client.shutdown()
    return 0


def default_kv_transport() -> str:
    from pdserve.disagg.transport import nixl_available

    return "nixl" if nixl_available() else "tcp"


def _router(ns: argparse.Namespace) -> int:
    import uvicorn

    from pdserve.disagg.router import PDClient, create_router_app
    from pdserve.model.demo_checkpoint import default_model_dir
    from pdserve.model.qwen3_config import Qwen3ModelConfig
    from pdserve.tokenizer import load_tokenizer

    model_dir = ns.model or str(default_model_dir())
    try:
        config = Qwen3ModelConfig.from_dir(model_dir)
        client = PDClient(ns.prefill, ns.decode, load_tokenizer(model_dir), config, model_dir,
                          ns.max_model_len or config.max_position_embeddings)
    except (ValueError, FileNotFoundError) as exc:
        print(f"pdserve: {exc}", file=sys.stderr)
        return 2
    name = ns.served_model_name or (ns.model or "pdserve-demo-tiny")
    uvicorn.run(create_router_app(client, name), host=ns.host, port=ns.port, log_level=ns.log_level.lower(),
                log_config=None)
    return 0


def _make_model(ns: argparse.Namespace) -> int:
    from pdserve.model.demo_checkpoint import PRESETS, write_checkpoint

    out = write_checkpoint(ns.out, PRESETS[ns.preset], seed=ns.seed)
    print(f"wrote random-weight Qwen3 ({ns.preset}) to {out}; its text output is random")
    return 0


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
    router = sub.add_parser("router", help="OpenAI-compatible front of prefill and decode workers")
    router.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill worker URLs")
    router.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode worker URLs")
    router.add_argument("--model", default=None, help="checkpoint dir, for the tokenizer and config")
    router.add_argument("--served-model-name", default=None)
    router.add_argument("--max-model-len", type=int, default=None)
    router.add_argument("--host", default="127.0.0.1")
    router.add_argument("--port", type=int, default=8000)
    router.set_defaults(func=_router)
    up = sub.add_parser("up", help="router + prefill + decode workers on this machine, one command")
    up.add_argument("--prefill", type=int, default=1, help="number of prefill workers")
    up.add_argument("--decode", type=int, default=1, help="number of decode workers")
    up.add_argument("--port", type=int, default=8000, help="the router's port")
    up.add_argument("--kv-transport", choices=["nixl", "tcp"], default=None)
    up.add_argument("--model", default=None)
    up.set_defaults(func=None)
    make = sub.add_parser("make-model", help="write a random-weight Qwen3 checkpoint (HF layout, real tokenizer)")
    make.add_argument("out", type=Path)
    make.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    make.add_argument("--seed", type=int, default=0)
    make.set_defaults(func=_make_model)
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
