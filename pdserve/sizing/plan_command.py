"""`pdserve plan`: flags, and the table (or JSON) it prints."""

from __future__ import annotations

import argparse
import json
import sys

from pdserve.bench.serve import workloads
from pdserve.config import KV_CACHE_DTYPES
from pdserve.model.demo_checkpoint import PRESETS, QWEN3_SHAPES
from pdserve.model.facts import dtype_bytes, load_model_facts
from pdserve.sizing.devices import DEVICES, device
from pdserve.sizing.plan import GIB, SEED_BUFFER, Plan, PlanInputs, make_plan

_DEFAULT_UTILIZATION = 0.9  # vLLM's --gpu-memory-utilization default, for memory derived from a model


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="size one worker: weights, KV per token/block/request, blocks, --max-num-seqs",
                       description=sys.modules["pdserve.sizing.plan"].__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help=f"checkpoint dir, config.json, preset ({', '.join(PRESETS)}) or Qwen3 "
                                                 f"shape ({', '.join(QWEN3_SHAPES)})")
    p.add_argument("--device", choices=sorted(DEVICES), default=None, help="a known accelerator (memory)")
    p.add_argument("--device-memory-gib", type=float, default=None, help="device memory (instead of --device)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help=f"share of the device usable (default {_DEFAULT_UTILIZATION} with a model; 1.0 with "
                        "--reserved-gib, as the seed counts)")
    p.add_argument("--reserved-gib", type=float, default=None, help="weights + overhead, given instead of derived")
    p.add_argument("--overhead-gib", type=float, default=2.0, help="activations, CUDA graphs, allocator slack")
    p.add_argument("--kv-per-request-gib", type=float, default=None, help="KV of one request, given instead of derived")
    p.add_argument("--dtype", default="bfloat16", help="weight dtype")
    p.add_argument("--kv-dtype", default=None, help="KV cache dtype (default: --dtype); one of the engine's "
                                                    "--kv-cache-dtype values (fp8: 1 byte an element) goes into the "
                                                    "flags")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (weights and KV heads split)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--workload", choices=["seed-mix", "fixed"], default="seed-mix",
                   help="seed-mix: 500/2000/5000-token prompts at 6:3:1 (x --scale), 500 output; fixed: the lengths")
    p.add_argument("--scale", type=float, default=1.0, help="seed-mix: multiply every length")
    p.add_argument("--input-len", type=int, default=2300, help="fixed: prompt tokens")
    p.add_argument("--output-len", type=int, default=None, help="output tokens (default 500, x --scale in seed-mix)")
    p.add_argument("--buffer", type=float, default=SEED_BUFFER, help="share of the fitting requests held back")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    p.set_defaults(func=run)


def plan_inputs(ns: argparse.Namespace) -> PlanInputs:
    if (ns.device is None) == (ns.device_memory_gib is None):
        raise ValueError("give exactly one of --device and --device-memory-gib")
    memory = device(ns.device).memory_bytes if ns.device else ns.device_memory_gib * GIB
    if ns.tp < 1 or ns.block_size < 1:
        raise ValueError("--tp and --block-size must be >= 1")
    model = load_model_facts(ns.model) if ns.model else None
    explicit = ns.reserved_gib is not None
    utilization = ns.gpu_memory_utilization if ns.gpu_memory_utilization is not None else (
        1.0 if explicit else _DEFAULT_UTILIZATION)
    if ns.workload == "seed-mix":
        lens = [workloads.scaled(n, ns.scale) for n in workloads.SEED_MIX_INPUT_LENS]
        mean_in = sum(n * w for n, w in zip(lens, workloads.SEED_MIX_WEIGHTS, strict=True)) / sum(
            workloads.SEED_MIX_WEIGHTS)
        max_in = max(lens)
        out = ns.output_len if ns.output_len is not None else workloads.scaled(workloads.SEED_MIX_OUTPUT_LEN, ns.scale)
    else:
        mean_in, max_in, out = ns.input_len, ns.input_len, ns.output_len if ns.output_len is not None else 500
    weight_bytes = dtype_bytes(ns.dtype)
    return PlanInputs(memory, utilization, model, weight_bytes, dtype_bytes(ns.kv_dtype or ns.dtype), ns.tp,
                      ns.block_size, ns.overhead_gib * GIB, None if not explicit else ns.reserved_gib * GIB,
                      None if ns.kv_per_request_gib is None else ns.kv_per_request_gib * GIB, mean_in, max_in, out,
                      ns.buffer, ns.kv_dtype if ns.kv_dtype in KV_CACHE_DTYPES else None)


def _gib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / GIB:.3f} GiB"


def format_plan(inputs: PlanInputs, plan: Plan) -> str:
    low, high = plan.max_num_seqs_range
    given = inputs.kv_per_request_bytes is not None
    lengths = "" if given else f" ({inputs.mean_input_len:g} in + {inputs.output_len} out)"
    model = inputs.model
    rows = [] if model is None else [("parameters (total / active per token)",
                                      f"{model.num_params / 1e9:.2f} B / {model.num_active_params / 1e9:.2f} B")]
    rows += [
        ("device memory x utilization",
         f"{inputs.device_memory_bytes / GIB:.2f} GiB x {inputs.gpu_memory_utilization:g}"),
        ("weights (one TP rank)", _gib(plan.weights_bytes)),
        ("reserved (weights + overhead)", _gib(plan.reserved_bytes)),
        ("KV budget", _gib(plan.kv_budget_bytes)),
        ("KV per token", "n/a" if plan.kv_bytes_per_token is None else f"{plan.kv_bytes_per_token:,} B"),
        ("KV per block", "n/a" if plan.kv_bytes_per_block is None else
         f"{plan.kv_bytes_per_block:,} B ({inputs.block_size} tokens)"),
        ("KV per request", _gib(plan.kv_per_request_bytes) + lengths),
        ("KV blocks", "n/a" if plan.num_kv_blocks is None else
         f"{plan.num_kv_blocks:,} ({GIB // plan.kv_bytes_per_block:,} per GiB)" if plan.kv_bytes_per_block else
         f"{plan.num_kv_blocks:,}"),
        ("requests that fit", str(plan.requests_fit)),
        (f"--max-num-seqs ({inputs.buffer:.0%} buffer)", f"{plan.max_num_seqs}" + (
            f" (set {low}-{high})" if high != low else "")),
        ("--max-num-batched-tokens prefill/colocated", str(plan.max_num_batched_tokens_prefill)),
        ("--max-num-batched-tokens decode", str(plan.max_num_batched_tokens_decode)),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    lines.append("flags, prefill or colocated: " + " ".join(plan.flags("prefill")))
    lines.append("flags, decode:               " + " ".join(plan.flags("decode")))
    return "\n".join(lines)


def run(ns: argparse.Namespace) -> int:
    inputs = plan_inputs(ns)
    plan = make_plan(inputs)
    if ns.json:
        params = {} if inputs.model is None else {"num_params": inputs.model.num_params,
                                                  "num_active_params": inputs.model.num_active_params}
        print(json.dumps({**plan.to_dict(), **params, "flags_prefill": plan.flags("prefill"),
                          "flags_decode": plan.flags("decode")}, indent=2))
    else:
        print(format_plan(inputs, plan))
    return 0
