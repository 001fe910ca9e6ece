"""`pdserve plan`: memory arithmetic for one worker.

    KV budget      = device memory x gpu-memory-utilization - reserved (weights + overhead)
    KV per request = blocks(prompt + output) x block bytes
    fits           = floor(KV budget / KV per request)
    max-num-seqs   = fits x (1 - buffer), buffer 20 % (the seed: 16 fit -> 12.8 -> "set 12-13")

Reserved memory is either given (`--reserved-gib`, the seed's "weights and overhead") or derived:
the weights of one tensor-parallel rank plus `--overhead-gib` (activations, CUDA graphs, allocator
slack). With explicit numbers the card counts whole (utilization 1.0, as the seed counts it) unless
`--gpu-memory-utilization` says otherwise; derived from a model it defaults to 0.9 (vLLM's default).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from pdserve.model.facts import ModelFacts

GIB = 1024**3
SEED_BUFFER = 0.2
# NOTE: the seed caps the prefill token budget at 16384 or 32768 so one huge prompt cannot
# monopolise a step (DIGEST 16); below 2048 the per-step overhead dominates.
MAX_BATCHED_TOKENS_CAP = 16384
MIN_BATCHED_TOKENS = 2048


@dataclass(frozen=True, slots=True)
class PlanInputs:
    device_memory_bytes: float
    gpu_memory_utilization: float
    model: ModelFacts | None  # None: every size below given explicitly
    weight_dtype_bytes: int = 2
    kv_dtype_bytes: int = 2
    tp: int = 1
    block_size: int = 16
    overhead_bytes: float = 1.0 * GIB
    reserved_bytes: float | None = None  # weights + overhead, given (else derived from the model)
    kv_per_request_bytes: float | None = None  # given (else derived from the lengths)
    mean_input_len: float = 0.0
    max_input_len: int = 0
    output_len: int = 0
    buffer: float = SEED_BUFFER
    kv_cache_dtype: str | None = None  # the engine's --kv-cache-dtype this sizes for (None: its default)


@dataclass(frozen=True, slots=True)
class Plan:
    weights_bytes: float | None
    reserved_bytes: float
    kv_budget_bytes: float
    kv_bytes_per_token: int | None
    kv_bytes_per_block: int | None
    kv_per_request_bytes: float
    num_kv_blocks: int | None
    requests_fit: int
    max_num_seqs: int  # the suggestion: fits x (1 - buffer), rounded down
    max_num_seqs_range: tuple[int, int]  # floor and ceiling of fits x (1 - buffer)
    max_num_batched_tokens_prefill: int
    max_num_batched_tokens_decode: int
    kv_cache_dtype: str | None = None  # NOTE: the block count holds for this pool type only: flags name it

    def to_dict(self) -> dict:
        return asdict(self)

    def flags(self, role: str) -> list[str]:
        """The engine flags for a worker of this role (prefill, decode or colocated)."""
        budget = self.max_num_batched_tokens_decode if role == "decode" else self.max_num_batched_tokens_prefill
        out = ["--max-num-seqs", str(self.max_num_seqs), "--max-num-batched-tokens", str(budget)]
        if self.num_kv_blocks is not None:
            out += ["--num-kv-blocks", str(self.num_kv_blocks)]
        if self.kv_cache_dtype is not None:
            out += ["--kv-cache-dtype", self.kv_cache_dtype]
        return out


def _blocks(tokens: float, block_size: int) -> int:
    return math.ceil(tokens / block_size)


def make_plan(inputs: PlanInputs) -> Plan:
    """Raises ValueError when nothing fits (weights larger than the memory, or not one request)."""
    if not 0 < inputs.gpu_memory_utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization {inputs.gpu_memory_utilization} must be in (0, 1]")
    if not 0 <= inputs.buffer < 1:
        raise ValueError(f"--buffer {inputs.buffer} must be in [0, 1)")
    model = inputs.model
    weights = None if model is None else model.num_params * inputs.weight_dtype_bytes / inputs.tp
    if inputs.reserved_bytes is not None:
        reserved = inputs.reserved_bytes
    elif weights is not None:
        reserved = weights + inputs.overhead_bytes
    else:
        raise ValueError("give a model or --reserved-gib (weights and overhead)")
    usable = inputs.device_memory_bytes * inputs.gpu_memory_utilization
    budget = usable - reserved
    if budget <= 0:
        raise ValueError(f"weights and overhead ({reserved / GIB:.2f} GiB) do not fit in {usable / GIB:.2f} GiB "
                         f"({inputs.device_memory_bytes / GIB:.2f} GiB x {inputs.gpu_memory_utilization:g}): "
                         f"use a larger device, more tensor parallelism or a smaller model")
    per_token = None if model is None else model.kv_bytes_per_token(inputs.kv_dtype_bytes, inputs.tp)
    per_block = None if per_token is None else per_token * inputs.block_size
    per_request = _kv_per_request(inputs, per_block)
    fits = int(budget // per_request)
    if fits < 1:
        raise ValueError(f"one request needs {per_request / GIB:.3f} GiB of KV, only {budget / GIB:.3f} GiB is left "
                         "after weights and overhead")
    target = fits * (1 - inputs.buffer)
    max_seqs = max(1, math.floor(target))
    return Plan(weights, reserved, budget, per_token, per_block, per_request,
                None if per_block is None else int(budget // per_block), fits, max_seqs,
                (max_seqs, max(max_seqs, math.ceil(target))), _prefill_budget(inputs.max_input_len, max_seqs),
                # NOTE: a decode step has one token per sequence; the floor leaves room for a
                # recomputed prompt (after a preemption or a failed transfer)
                max(max_seqs, MIN_BATCHED_TOKENS), inputs.kv_cache_dtype)


def _kv_per_request(inputs: PlanInputs, per_block: int | None) -> float:
    if inputs.kv_per_request_bytes is not None:
        if inputs.kv_per_request_bytes <= 0:
            raise ValueError("--kv-per-request-gib must be > 0")
        return inputs.kv_per_request_bytes
    if per_block is None:
        raise ValueError("give a model (for KV bytes per token) or --kv-per-request-gib")
    tokens = inputs.mean_input_len + inputs.output_len
    if tokens <= 0:
        raise ValueError("give the workload's lengths (--input-len/--output-len or --workload seed-mix)")
    return _blocks(tokens, inputs.block_size) * per_block


def _prefill_budget(max_input_len: int, max_seqs: int) -> int:
    """Room for the longest prompt in one step, a power of two in [2048, 16384], and for one
    decode token per running sequence."""
    whole = 1 << max(0, max_input_len - 1).bit_length()
    return max(min(max(whole, MIN_BATCHED_TOKENS), MAX_BATCHED_TOKENS_CAP), max_seqs)
