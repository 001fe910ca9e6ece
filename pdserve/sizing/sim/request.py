"""One simulated request: token counts catching up, as in the engine (`num_computed_tokens`)."""

from __future__ import annotations


class SimRequest:
    """`computed` prompt tokens have KV; `target` is how many must before decoding (the prompt, or
    after a preemption by recomputation the prompt and the tokens generated so far); `generated`
    output tokens exist, each with its time in `token_times_s` (absolute simulated seconds)."""

    __slots__ = ("index", "prompt_len", "output_len", "sent_s", "computed", "target", "generated", "blocks",
                 "token_times_s", "worker", "decode", "error_kind", "finished_s", "num_preemptions", "relay_s")

    def __init__(self, index: int, prompt_len: int, output_len: int, sent_s: float) -> None:
        self.index = index
        self.prompt_len = prompt_len
        self.output_len = output_len
        self.sent_s = sent_s
        self.computed = 0
        self.target = prompt_len
        self.generated = 0
        self.blocks = 0  # KV blocks held on the worker it is on
        self.token_times_s: list[float] = []
        self.worker = -1  # index of the worker computing it now
        self.decode = -1  # PD: index of the decode worker holding its reservation
        self.error_kind: str | None = None
        self.finished_s: float | None = None
        self.relay_s = 0.0  # PD: the load's delay on the router's relay, paid by every token and the end
        self.num_preemptions = 0

    @property
    def context_len(self) -> int:
        """Tokens whose KV the next decode step reads."""
        return self.prompt_len + self.generated

    @property
    def prefilling(self) -> bool:
        return self.computed < self.target

    def add_token(self, now_s: float) -> None:
        self.generated += 1
        self.token_times_s.append(now_s)

    @property
    def done(self) -> bool:
        return self.generated >= self.output_len
