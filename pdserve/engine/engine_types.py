"""The engine's records its clients share (in-process, the engine-core client, the router's
admission), and the check of a request no engine of a given size can run."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.disk_offload import TierStats
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.structured import check_structured


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Plain numbers; the serving layer turns them into metrics."""

    num_running: int
    num_waiting: int
    num_swapped: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    num_quarantined_kv_blocks: int  # decode role: held after a cancelled one-sided transfer (nixl)
    kv_cache_usage: float
    num_preemptions: int
    num_prefix_query_tokens: int
    num_prefix_hit_tokens: int
    num_evictions: int
    num_no_available_block: int  # preemptions for lack of blocks + refused reservations
    num_cannot_allocate: int  # requests refused because they could never fit the pool
    num_remote_waiting: int  # decode role: reservations waiting for their KV
    num_prefill_tokens: int  # prompt tokens computed here (prefix hits and received KV excluded)
    num_batch_prefill_requests: int  # the last step's batch: requests with a prefill chunk
    num_batch_prefill_tokens: int  # ... and the tokens of those chunks
    num_steps: int
    schedule_time_s: float  # total time in schedule() + update() bookkeeping
    step_time_s: float  # total wall time of steps
    kv_tier: TierStats | None = None  # with --kv-disk-dir
    num_engine_requests: int = 0  # user requests the engine tracks (their output state included)
    num_scheduler_requests: int = 0  # sequences the scheduler tracks (waiting, running, swapped, remote, held)
    block_size: int = 0  # tokens per KV block (vllm:cache_config_info)
    # LoRA (vllm:lora_requests_info): slots, and the adapters of running / waiting requests
    max_lora: int = 0
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    num_kv_events_dropped_batches: int = 0  # --kv-events-config: batches the publisher's full queue dropped


def check_request(prompt_token_ids: list[int], params: SamplingParams, max_model_len: int, vocab_size: int) -> None:
    """Raises ValueError for a request no engine with this context window and vocabulary can run."""
    if not prompt_token_ids:
        raise ValueError("the prompt is empty")
    if len(prompt_token_ids) >= max_model_len:
        raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens; max_model_len is {max_model_len}, "
                         f"so at most {max_model_len - 1} prompt tokens fit")
    bad = next((t for t in prompt_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    # NOTE: the sampler indexes logits with stop ids (min_tokens masking); an id out of range
    # would raise inside step() and stop the engine for everyone.
    bad = next((t for t in params.stop_token_ids if t >= vocab_size), None)
    if bad is not None:
        raise ValueError(f"stop_token_ids: token id {bad} is outside the vocabulary [0, {vocab_size})")
    if params.structured_replay >= len(prompt_token_ids):
        raise ValueError("structured_replay must be shorter than the prompt")
    check_structured(params.structured)


@dataclass(frozen=True, slots=True)
class RemoteReservation:
    """Decode role: where a prefill worker must write a request's prompt KV."""

    block_ids: tuple[int, ...]  # the request's whole block table, in token order
    num_cached_tokens: int  # leading prompt tokens already in this pool: not to be sent


def check_handoff(request: Request, first_token_id: int, generator_state: bytes | None, prefill_cached_tokens: int,
                  vocab_size: int) -> None:
    """Raises ValueError for a KV hand-off's values that do not fit the reserved request (decode
    role, `LLMEngine.complete_remote`): a peer's bad value must never reach the sampler."""
    if not 0 <= first_token_id < vocab_size:
        raise ValueError(f"first token id {first_token_id} is outside the vocabulary (0..{vocab_size - 1})")
    if not 0 <= prefill_cached_tokens <= request.num_prompt_tokens:
        raise ValueError(f"prefill_cached_tokens {prefill_cached_tokens} is outside 0..{request.num_prompt_tokens}")
    expected = request.generator.get_state().numel() if request.generator is not None else None
    if generator_state is not None and expected is not None and len(generator_state) != expected:
        raise ValueError(f"generator state of {len(generator_state)} bytes, expected {expected}")
    if request.matcher is not None and request.matcher.validate_tokens([first_token_id]) != 1:
        raise ValueError(f"first token id {first_token_id} does not follow the request's structured output")
