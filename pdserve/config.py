"""Engine configuration: built once at the edge (CLI, `LLM(...)`), validated, frozen, passed down.

Knob names follow vLLM's so users' habits carry over. `knob` declares a field with its help (the
CLI flags come from the fields: config_flags.py). The configs of the layers above live beside the
code they configure: the router's, the workers' and the queue's in disagg/config.py, the API's in
serving/config.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from pdserve.engine.kv_events import KVEventsConfig
from pdserve.model.kv_scales import KVScales, fp8_kv_scales, is_fp8
from pdserve.model.parallel import check_tp_size
from pdserve.model.qwen3_config import Qwen3ModelConfig

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

# FP8 KV pools (model/kv_scales.py): "fp8" is vLLM's name for e4m3
FP8_KV_DTYPES: dict[str, torch.dtype] = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                                         "fp8_e5m2": torch.float8_e5m2}
# What --kv-cache-dtype accepts: the pool's element type ("auto": the model's compute dtype). Any two
# of these map at the PD hand-off (the receiver converts, disagg/kv_layout.py).
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16", *FP8_KV_DTYPES)

_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
               "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4,
               "tb": 1000**4, "tib": 1024**4}


def parse_size_bytes(text: str | int | float) -> int:
    """'2GiB' -> 2147483648, '512MB' -> 512000000, 1024 -> 1024."""
    if isinstance(text, (int, float)):
        return int(text)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"cannot parse size {text!r}: use a number with an optional unit like 2GiB or 512MB")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def resolve_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """'auto' keeps the checkpoint's dtype on CUDA; on CPU it uses float32 for half-precision
    checkpoints because CPU half matmuls are slow and inexact."""
    if name == "auto":
        if device.type == "cpu" and model_dtype in (torch.float16, torch.bfloat16):
            return torch.float32
        return model_dtype
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose auto, {', '.join(sorted(set(DTYPES)))}")
    return DTYPES[name]


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int
    num_kv_blocks: int
    num_swap_blocks: int
    enable_prefix_caching: bool
    prefault: bool = False  # CPU: the pool's pages committed at start-up, not as blocks are first written


@dataclass(frozen=True, slots=True)
class KVDiskConfig:
    """The disk tier under the prefix cache (engine/kv_disk_tier.py)."""

    directory: str
    capacity_bytes: int


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool
    preemption_mode: Literal["recompute", "swap"]


def knob(default: Any, help: str) -> Any:  # noqa: A002 - argparse's name for it
    """A config field whose `help` becomes its CLI flag's help (config_flags.py generates the flags)."""
    if isinstance(default, (list, dict, set)):
        raise TypeError("mutable defaults are not allowed: use a tuple")
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True, slots=True)
class EngineArgs:
    """What a user may set; `EngineConfig` is what the engine runs with once sizes are resolved."""

    model: str | None = knob(None, "Hugging Face Qwen3 checkpoint directory (default: a random-weight demo model "
                                   "built once)")
    dtype: str = knob("auto", "auto, float32, bfloat16 or float16")
    kv_cache_dtype: str = knob("auto", "element type of the KV pool: auto (the model's --dtype), float32, bfloat16, "
                                       "float16, or fp8 (= fp8_e4m3) / fp8_e5m2 with the checkpoint's per-layer "
                                       "k_scale/v_scale (else 1.0); attention reads KV in it and computes in --dtype")
    device: str = knob("auto", "auto, cpu or cuda[:N]")
    block_size: int = knob(16, "tokens per KV block")
    max_num_seqs: int = knob(256, "max sequences running at once")
    max_num_batched_tokens: int | None = knob(None, "token budget of one step")
    max_model_len: int | None = knob(None, "context window (prompt + output)")
    enable_prefix_caching: bool = knob(True, "reuse the KV blocks of prompt prefixes seen before")
    enable_chunked_prefill: bool = knob(True, "split long prompts over several steps, next to running decodes")
    num_kv_blocks: int | None = knob(None, "override the KV pool size in blocks")
    kv_cache_memory: str | int | None = knob(None, "KV pool size, e.g. 2GiB (CPU default 2GiB)")
    kv_cache_prefault: bool = knob(False, "CPU: commit the KV pool's pages at start-up (as a zero-filled pool "
                                          "would) rather than as blocks are first written: slower start, the "
                                          "pool resident from the start, and no step stalls on first-touch page "
                                          "faults (slow on a fresh VM)")
    gpu_memory_utilization: float = knob(0.9, "share of the GPU's memory this engine may use (CUDA only)")
    swap_space: float = knob(0.0, "CPU swap space for preemption, GiB")
    preemption_mode: Literal["recompute", "swap"] | None = knob(
        None, "default: swap when --swap-space > 0, else recompute")
    seed: int = knob(0, "seed of the sampler for requests that bring no seed of their own")
    num_threads: int | None = knob(None, "torch CPU threads (per tensor-parallel rank; default: the cores / ranks)")
    tensor_parallel_size: int = knob(1, "ranks (processes) the model is split over: heads, MLP rows and vocabulary; "
                                        "gloo on CPU, NCCL on CUDA")
    kv_disk_dir: str | None = knob(None, "disk tier under the prefix cache: full KV blocks are kept in this directory "
                                         "(e.g. /kvcache; shareable by workers of one node) and loaded on prefix hits")
    kv_disk_size: str | int = knob("20GiB", "most bytes the disk tier keeps (least recently used files go first)")
    enforce_eager: bool = knob(False, "CUDA: run every step eagerly (no decode or piecewise CUDA graphs, no "
                                      "capture at start-up)")
    kv_events_config: str | None = knob(None, "publish KV-cache events as vLLM does (ZMQ, msgpack): vLLM's JSON, "
                                              "e.g. '{\"enable_kv_cache_events\": true, "
                                              "\"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\", "
                                              "\"topic\": \"kv@pod@model\"}' "
                                              "(port 0: any free port); prefix scorers must use this --block-size")
    enable_lora: bool = knob(False, "serve LoRA adapters (PEFT format) over the base model; a request picks one by "
                                    "its `model`")
    lora_modules: tuple[str, ...] = knob((), "adapters to load at start-up, as name=path (PEFT directory)")
    max_loras: int = knob(1, "LoRA adapters one step may mix (device slots, preallocated)")
    max_lora_rank: int = knob(16, "largest LoRA rank served (slots are sized for it)")
    max_cpu_loras: int | None = knob(None, "LoRA adapters kept in host memory (default: --max-loras); more are "
                                           "read again from disk when used")

    def validate(self) -> None:
        checks = [
            (self.block_size in (1, 2, 4, 8, 16, 32, 64, 128), "block_size must be a power of two in [1, 128]"),
            (self.max_num_seqs >= 1, "max_num_seqs must be >= 1"),
            (self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
             "max_num_batched_tokens must be >= 1"),
            (self.max_model_len is None or self.max_model_len >= 1, "max_model_len must be >= 1"),
            (self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks must be >= 1"),
            (0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization must be in (0, 1]"),
            (self.swap_space >= 0, "swap_space must be >= 0 (GiB)"),
            (self.tensor_parallel_size >= 1, "tensor_parallel_size must be >= 1"),
            (self.preemption_mode in (None, "recompute", "swap"), "preemption_mode must be recompute or swap"),
            (self.device in ("auto", "cpu") or self.device.startswith("cuda"), "device must be auto, cpu or cuda[:N]"),
            (self.kv_disk_dir is None or self.enable_prefix_caching, "kv_disk_dir needs prefix caching"),
            (self.kv_cache_dtype in KV_CACHE_DTYPES,
             f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"),
            (self.kv_disk_dir is None or parse_size_bytes(self.kv_disk_size) > 0, "kv_disk_size must be > 0"),
            (self.max_loras >= 1 and self.max_lora_rank >= 1, "max_loras and max_lora_rank must be >= 1"),
            (self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras, "max_cpu_loras must be >= max_loras"),
            (self.enable_lora or not self.lora_modules, "lora_modules needs enable_lora"),
            (not self.enable_lora or self.tensor_parallel_size == 1,
             "LoRA adapters are not served with tensor parallelism yet (enable_lora needs tensor_parallel_size 1)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """LoRA serving (engine/lora_manager.py): device slots, host cache, start-up adapters."""

    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int
    modules: tuple[tuple[str, str], ...]  # (name, path) loaded at start-up

    @classmethod
    def of(cls, args: EngineArgs) -> LoRAConfig | None:
        if not args.enable_lora:
            return None
        modules = []
        for spec in args.lora_modules:
            name, sep, path = spec.partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ValueError(f"lora_modules takes name=path, got {spec!r}")
            modules.append((name.strip(), path.strip()))
        names = [name for name, _ in modules]
        if len(set(names)) != len(names):
            raise ValueError(f"lora_modules names an adapter twice: {', '.join(names)}")
        return cls(args.max_loras, args.max_lora_rank, args.max_cpu_loras or args.max_loras, tuple(modules))


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model_path: str
    model: Qwen3ModelConfig
    dtype: torch.dtype
    device: torch.device
    cache: CacheConfig
    scheduler: SchedulerConfig
    seed: int
    num_threads: int | None
    kv_disk: KVDiskConfig | None = None
    tensor_parallel_size: int = 1
    kv_cache_dtype: torch.dtype | None = None  # the pool's element type; None: `dtype`
    enforce_eager: bool = False  # CUDA: no decode or piecewise CUDA graphs (engine/cuda_graphs.py, piecewise_graphs.py)
    kv_scales: KVScales | None = None  # an FP8 pool's per-layer K/V scales (model/kv_scales.py); else None
    kv_events: KVEventsConfig | None = None  # --kv-events-config (engine/kv_events.py); None: no events
    lora: LoRAConfig | None = None  # None: no LoRA adapters (--enable-lora off)

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV pool's element type (attention reads it, computes in `dtype`)."""
        return self.kv_cache_dtype or self.dtype

    @property
    def kv_bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.model, self.cache.block_size, self.kv_dtype)


def kv_dtype_description(config: EngineConfig) -> str:
    """The pool's element type as the start-up line names it: 'bfloat16', 'float8_e4m3fn (scales from
    the checkpoint)', 'float8_e4m3fn (scales 1.0)'."""
    name = str(config.kv_dtype).removeprefix("torch.")
    if config.kv_scales is None:
        return name
    return f"{name} (scales {'from the checkpoint' if config.kv_scales.from_checkpoint else '1.0'})"


def kv_bytes_per_block(model: Qwen3ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element_bytes = torch.empty((), dtype=dtype).element_size()
    return 2 * model.num_hidden_layers * block_size * model.num_key_value_heads * model.head_dim * element_bytes


_DEFAULT_CPU_KV_BYTES = 2 * 1024**3
_DEFAULT_MAX_BATCHED_TOKENS = 2048
# prompt-logprobs rows whose [rows, vocab] logits exist at once: a step's prompt tokens beyond it
# are computed in chunks (engine/model_runner.py), so a long prompt's logits never take the device
PROMPT_LOGITS_ROWS = 512


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return torch.device(name)


def _num_kv_blocks(args: EngineArgs, model: Qwen3ModelConfig, dtype: torch.dtype, kv_dtype: torch.dtype,
                   device: torch.device, max_batched_tokens: int) -> int:
    block_bytes = kv_bytes_per_block(model, args.block_size, kv_dtype)
    if args.num_kv_blocks is not None:
        return args.num_kv_blocks
    if args.kv_cache_memory is not None:
        budget = parse_size_bytes(args.kv_cache_memory)
    elif device.type == "cuda":
        budget = _cuda_kv_budget(args, model, dtype, device, max_batched_tokens)
    else:
        budget = _DEFAULT_CPU_KV_BYTES
    num_blocks = budget // block_bytes
    if num_blocks < 1:
        raise ValueError(f"KV cache budget of {budget} bytes holds no block of {block_bytes} bytes")
    return int(num_blocks)


def _cuda_kv_budget(args: EngineArgs, model: Qwen3ModelConfig, dtype: torch.dtype, device: torch.device,
                    max_batched_tokens: int) -> int:
    """gpu_memory_utilization x device memory (no more than is free now: other processes, e.g. the
    other role's worker on the same GPU, keep theirs), minus weights and activations of the largest step."""
    element = torch.empty((), dtype=dtype).element_size()
    h, v = model.hidden_size, model.vocab_size
    moe = model.moe
    i = model.intermediate_size if moe is None else moe.num_experts_per_tok * moe.moe_intermediate_size
    qkv = (model.num_attention_heads + 2 * model.num_key_value_heads) * model.head_dim
    # NOTE: float weights, also for FP8 checkpoints (dequantized at load); every expert of a MoE
    weights = model.num_params * element
    # NOTE: logits are float32 [rows, vocab], each with a float copy and a log-softmax beside it: the
    # sampled rows (max_num_seqs), and a step of prompt logprobs one row per prompt token in it, at
    # most PROMPT_LOGITS_ROWS at once
    logits = (args.max_num_seqs + min(max_batched_tokens, PROMPT_LOGITS_ROWS)) * v * 4 * 3
    activations = max_batched_tokens * (4 * h + 2 * i + qkv) * element * 2 + logits
    free, total = torch.cuda.mem_get_info(device)
    return int(min(total * args.gpu_memory_utilization, free) - weights - activations)


def create_engine_config(args: EngineArgs) -> EngineConfig:
    """Resolve defaults that depend on the model and the machine; validate; freeze."""
    from pdserve.model.demo_checkpoint import default_model_dir

    args.validate()
    model_path = str(args.model) if args.model else str(default_model_dir())
    model = Qwen3ModelConfig.from_dir(model_path)
    check_tp_size(model, args.tensor_parallel_size)
    device = _device(args.device)
    dtype = resolve_dtype(args.dtype, model.torch_dtype, device)
    kv_dtype = dtype if args.kv_cache_dtype == "auto" else FP8_KV_DTYPES.get(args.kv_cache_dtype) or DTYPES[
        args.kv_cache_dtype]
    max_model_len = args.max_model_len or model.max_context_len
    if max_model_len > model.max_context_len:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's context ({model.max_context_len}: "
                         f"max_position_embeddings, stretched by a scaled rope)")
    max_batched = args.max_num_batched_tokens or (
        _DEFAULT_MAX_BATCHED_TOKENS if args.enable_chunked_prefill else max(max_model_len, _DEFAULT_MAX_BATCHED_TOKENS))
    if not args.enable_chunked_prefill and max_batched < max_model_len:
        raise ValueError(f"without chunked prefill, max_num_batched_tokens ({max_batched}) must be >= "
                         f"max_model_len ({max_model_len}) or long prompts could never be scheduled")
    num_blocks = _num_kv_blocks(args, model, dtype, kv_dtype, device, max_batched)
    num_swap_blocks = int(args.swap_space * 1024**3) // kv_bytes_per_block(model, args.block_size, kv_dtype)
    preemption = args.preemption_mode or ("swap" if num_swap_blocks > 0 else "recompute")
    return EngineConfig(
        model_path=model_path,
        model=model,
        dtype=dtype,
        device=device,
        cache=CacheConfig(args.block_size, num_blocks, num_swap_blocks, args.enable_prefix_caching,
                          args.kv_cache_prefault),
        scheduler=SchedulerConfig(args.max_num_seqs, max_batched, max_model_len, args.enable_chunked_prefill,
                                  "swap" if preemption == "swap" else "recompute"),
        seed=args.seed,
        num_threads=args.num_threads,
        kv_disk=None if args.kv_disk_dir is None else KVDiskConfig(args.kv_disk_dir,
                                                                   parse_size_bytes(args.kv_disk_size)),
        tensor_parallel_size=args.tensor_parallel_size,
        kv_cache_dtype=kv_dtype,
        enforce_eager=args.enforce_eager,
        kv_scales=_kv_scales(model_path, model, kv_dtype),
        kv_events=None if args.kv_events_config is None else KVEventsConfig.parse(args.kv_events_config),
        lora=LoRAConfig.of(args),
    )


def _kv_scales(model_path: str, model: Qwen3ModelConfig, kv_dtype: torch.dtype) -> KVScales | None:
    """An FP8 pool's scales: read once here, at the edge, from the checkpoint (else 1.0)."""
    if not is_fp8(kv_dtype):
        return None
    from pdserve.model.loader import safetensors_files

    return fp8_kv_scales(safetensors_files(Path(model_path)), model.num_hidden_layers)


