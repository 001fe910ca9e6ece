"""A request inside the engine: a token count (`num_computed_tokens`) catching up with its tokens.

Prefill, a chunk of prefill, a prefix-cache hit and (later) KV arriving from a peer all just
advance `num_computed_tokens`; when it reaches `num_tokens` the next token is sampled.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pdserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import llguidance

    from pdserve.engine.logprobs import PromptLogprobs


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    WAITING_FOR_REMOTE_KV = "remote"  # decode role: blocks reserved, KV arriving from a prefill worker
    LOADING = "loading"  # blocks reserved, prefix KV being read from the disk tier
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in FINISHED_STATUSES


# NOTE: `status in FINISHED_STATUSES` where it runs per request per step: the property's call costs more than the test
FINISHED_STATUSES = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass(frozen=True, slots=True)
class ModelContext:
    """What a request takes from the engine it runs in: the model's end-of-sequence tokens and
    context length, and the device its seeded generator draws on (None: the CPU)."""

    eos_token_ids: tuple[int, ...]
    max_model_len: int
    device: torch.device | None = None


class Request:
    __slots__ = ("request_id", "prompt_token_ids", "all_token_ids", "params", "eos_token_ids", "max_total_tokens",
                 "num_computed_tokens", "num_cached_tokens", "block_ids", "block_hashes", "swapped_block_ids",
                 "status", "stop_reason", "generator", "pending_draws", "arrival_time", "first_scheduled_time",
                 "num_preemptions", "hold_blocks", "disk_checked", "prompt_logprobs", "matcher",
                 "num_indexed_blocks", "hash_root", "plain_greedy", "stop_tokens",
                 "__weakref__")  # NOTE: the sampler's penalty rows (engine/penalties.py) must not keep one alive

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 model: ModelContext, arrival_time: float | None = None,
                 matcher: llguidance.LLMatcher | None = None) -> None:
        eos_token_ids, max_model_len, device = model.eos_token_ids, model.max_model_len, model.device
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids = eos_token_ids
        max_new = params.max_tokens if params.max_tokens is not None else max_model_len
        self.max_total_tokens = min(max_model_len, len(prompt_token_ids) + max_new)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at first scheduling
        # with params.prompt_logprobs: one entry per prompt token computed so far (None: the first)
        self.prompt_logprobs: list[PromptLogprobs | None] | None = None if params.prompt_logprobs is None else [None]
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []  # hashes of the leading full blocks, chained
        self.hash_root = b""  # the first block's parent: its LoRA adapter's (engine/lora_manager.py hash_root)
        self.num_indexed_blocks = 0  # leading blocks of block_ids already offered to the prefix cache
        self.swapped_block_ids: list[int] = []  # CPU swap blocks while SWAPPED
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        # The seeded generator lives where the logits are, so sampling never copies them to the host.
        self.generator = (torch.Generator(device=device or "cpu").manual_seed(params.seed)
                          if params.seed is not None else None)
        # draws the generator must skip before its first (a resumed request: see SamplingParams)
        self.pending_draws = params.seed_draws_done if self.generator is not None else 0
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None
        self.num_preemptions = 0
        # Prefill role: on finishing, keep the blocks until the KV hand-off is acknowledged.
        self.hold_blocks = False
        # The disk tier was asked for this request's prefix since it last had none computed.
        self.disk_checked = False
        # with params.structured: the grammar's state after the tokens so far (engine/structured.py)
        self.matcher = matcher
        # greedy and nothing else the sampler asks its params about (logprobs, penalties, min_tokens):
        # with no grammar either, its row is the argmax alone (engine/sampler.py, `_Rows.of`)
        self.plain_greedy = (params.greedy and params.logprobs is None and not params.needs_penalties
                             and not params.min_tokens)
        # every token that may stop it (min_tokens aside): one not in here stops it only at its length
        # limit or through a grammar (`check_stop`; `Scheduler.update` tests that first, per request per step)
        self.stop_tokens = frozenset(params.stop_token_ids or ()).union(() if params.ignore_eos else eos_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        if self.matcher is not None:
            # NOTE: a token the mask did not allow (only a peer's first token could be one) leaves
            # the matcher in its error state, which ends the request (check_stop)
            self.matcher.consume_token(token_id)

    def take_prompt_logprobs(self, entries: list[PromptLogprobs | None] | None, vocab_size: int) -> None:
        """Decode role: the prompt's logprobs, computed by the prefill worker that sent its KV (one
        entry per prompt token, the first None). Raises ValueError, changing nothing, for entries
        that cannot be this prompt's; ignored when the request did not ask for them."""
        k = self.params.prompt_logprobs
        if k is None:
            return
        if entries is None or len(entries) != self.num_prompt_tokens or entries[0] is not None:
            raise ValueError(f"expected prompt logprobs for {self.num_prompt_tokens} prompt tokens")
        for token_id, entry in zip(self.prompt_token_ids[1:], entries[1:], strict=True):
            if entry is None or entry.token_id != token_id or not 1 <= entry.rank <= vocab_size or \
                    len(entry.top) != k or any(not 0 <= t < vocab_size for t, _ in entry.top):
                raise ValueError("prompt logprobs do not match the prompt")
        self.prompt_logprobs = list(entries)

    def check_stop(self) -> RequestStatus | None:
        """Token-level stop conditions after a token was appended (stop strings live in the
        output processor, which sees text)."""
        token_ids, params = self.all_token_ids, self.params
        last = token_ids[-1]
        if self.matcher is not None and (self.matcher.is_stopped() or self.matcher.is_error()):
            return RequestStatus.FINISHED_STOPPED  # the grammar ended (or, above, could not go on)
        num_tokens = len(token_ids)
        if num_tokens - len(self.prompt_token_ids) >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if params.stop_token_ids and last in params.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if num_tokens >= self.max_total_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None


def child_request_id(request_id: str, index: int) -> str:
    """The engine request id of sequence `index` of a user request (n > 1): the first keeps the user's."""
    return request_id if index == 0 else f"{request_id}#{index}"
