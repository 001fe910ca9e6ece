"""`pdserve` command line: serve, make-model. Flags mirror vLLM's engine arguments."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

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
        engine = LLMEngine.from_engine_args(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"pdserve: {exc}", file=sys.stderr)
        return 2
    name = ns.served_model_name or (args.model or "pdserve-demo-tiny")
    client = AsyncLLM(engine)
    cfg = engine.config
    logging.getLogger("pdserve").info(
        "serving %s on http://%s:%d (%s, %s, %d KV blocks of %d tokens, max_model_len %d)", name, ns.host, ns.port,
        cfg.device, str(cfg.dtype).removeprefix("torch."), cfg.cache.num_kv_blocks, cfg.cache.block_size,
        cfg.scheduler.max_model_len)
    try:
        uvicorn.run(create_app(client, name), host=ns.host, port=ns.port, log_level=ns.log_level.lower())
    finally:
        client.shutdown()
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
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="OpenAI-compatible server (colocated prefill + decode)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None, help="model id clients send (default: --model)")
    add_engine_args(serve)
    serve.set_defaults(func=_serve)
    make = sub.add_parser("make-model", help="write a random-weight Qwen3 checkpoint (HF layout, real tokenizer)")
    make.add_argument("out", type=Path)
    make.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    make.add_argument("--seed", type=int, default=0)
    make.set_defaults(func=_make_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=ns.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(ns.func(ns))


if __name__ == "__main__":
    sys.exit(main())
