"""Per-request sampling parameters, named and defaulted as in vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.structured import StructuredOutput

_GREEDY_EPS = 1e-5


@dataclass(frozen=True, slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives per token; 0 = only the sampled one
    prompt_logprobs: int | None = None  # the same, for every prompt token after the first
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured: StructuredOutput | None = None  # what the output must match (engine/structured.py)
    # the LoRA adapter the request runs under (None: the base model); set from the API's `model` or
    # LLM.generate's `lora_request` (engine/lora_manager.py)
    lora_name: str | None = None
    # NOTE: not user knobs: what the output's text starts with when the router resumes a request on
    # another decode worker: text its earlier tokens made that the client was not sent yet (held
    # back as a possible start of a stop string), and the bytes of an unfinished UTF-8 character
    text_prefix: str = ""
    utf8_prefix: tuple[int, ...] = field(default=())
    # ... and, with a seed, the draws its seeded generator made for the tokens already sent: the new
    # worker's generator skips them, so its tokens are the ones the first worker would have sampled
    seed_draws_done: int = 0
    # ... and, with `structured`, how many of the prompt's last tokens are that output so far: the
    # new worker's matcher replays them, so it continues the same grammar where the first one was
    structured_replay: int = 0

    def __post_init__(self) -> None:
        # Accept lists/strings the way callers write them, store tuples (frozen, hashable).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids or ()))
        object.__setattr__(self, "utf8_prefix", tuple(int(b) for b in self.utf8_prefix or ()))
        object.__setattr__(self, "structured", StructuredOutput.of(self.structured))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        for ok, message in self._checks():
            if not ok:
                raise ValueError(message)

    def _checks(self) -> list[tuple[bool, str]]:
        return [
            (self.n >= 1, f"n must be >= 1, got {self.n}"),
            (self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be -1 (disabled) or >= 1, got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.repetition_penalty > 0.0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (-2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2.0 <= self.frequency_penalty <= 2.0,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.max_tokens is None or self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (self.seed_draws_done >= 0, f"seed_draws_done must be >= 0, got {self.seed_draws_done}"),
            (self.structured_replay >= 0, f"structured_replay must be >= 0, got {self.structured_replay}"),
            (self.structured is not None or not self.structured_replay, "structured_replay needs `structured`"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"),
            (all(s for s in self.stop), "stop strings must be non-empty"),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be non-negative"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, f"logprobs must be in [0, 20], got {self.logprobs}"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
             f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}"),
            (len(self.utf8_prefix) <= 3 and all(0x80 <= b <= 0xFF for b in self.utf8_prefix),
             "utf8_prefix holds at most the first 3 bytes of one multi-byte character"),
        ]

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
