"""What the engine hands back: vLLM-shaped `RequestOutput`s, built by an output processor that
detokenizes incrementally and applies stop strings (the only stop condition that needs text)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from operator import attrgetter, is_
from sys import getrefcount

from pdserve.engine.logprobs import PromptLogprobs, TokenLogprobs
from pdserve.engine.request import FINISHED_STATUSES, Request, RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.tokenizer import IncrementalDetokenizer, Tokenizer


def _refs_of_an_unshared_list() -> int:
    """getrefcount of a list held only by an object's slot and a local name, as `add_token` sees a
    sequence's list that no snapshot holds (3 on CPython 3.11: the slot, the name, the argument);
    measured, not assumed, since how the interpreter counts its own references changes by version."""
    holder = _Holder([])
    held = holder.items
    return getrefcount(held)


@dataclass(slots=True)
class _Holder:
    items: list[int]


# more than this means a snapshot handed out still holds the list (copy on write in `add_token`, and
# in the router's FrameDecoder): what getrefcount reports for a list held by one object and one local name
UNSHARED_REFS = _refs_of_an_unshared_list()


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"; None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class RequestFailure:
    """A request the engine ended because handling it raised (its output processing: detokenizing,
    stop strings, logprobs): it alone failed, its blocks are free, the engine carries on."""

    request_id: str
    error: str


@dataclass(slots=True)
class RequestMetrics:
    """Monotonic timestamps of one request in this engine (serving/metrics turns them into histograms)."""

    arrival_time: float
    first_scheduled_time: float | None = None  # left the waiting queue (decode role: blocks reserved)
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[PromptLogprobs | None] | None = None  # asked for: one per prompt token (first: None)


@dataclass(slots=True)  # NOTE: not frozen: a frozen dataclass's __init__ costs 3x, twice per request a step
class SequenceDelta:
    """What one sequence of a request gained since the request's last `RequestDelta`."""

    index: int
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None  # one per new token, when the request asked for them
    finish_reason: str | None  # set once, with the delta that ends the sequence
    stop_reason: int | str | None


@dataclass(slots=True)
class RequestDelta:
    """What a request gained since its last delta (`RequestState.delta`): what the engine core
    process sends its API process, which rebuilds the cumulative outputs (engine/core_client.py)."""

    request_id: str
    sequences: list[SequenceDelta]
    num_cached_tokens: int
    first_scheduled_time: float | None  # time.monotonic() in the engine process (the same clock)
    prompt_logprobs: list[PromptLogprobs | None] | None  # once, complete


@dataclass(slots=True)
class StepTokens:
    """The engine core's short form of a step's most common deltas: requests whose delta would
    carry one token of their only sequence and nothing else (`RequestState.add_token_alone`), as two
    flat lists, in step order (`LLMEngine._emit` appends to them). Its API process reads each as that
    `RequestDelta`."""

    request_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)

    def deltas(self) -> list[RequestDelta]:
        return [RequestDelta(rid, [SequenceDelta(0, [token], None, None, None)], 0, None, None)
                for rid, token in zip(self.request_ids, self.token_ids, strict=True)]


class SteadyAlone:
    """The last step's requests when each of them went to `StepTokens` (`RequestState.add_token_alone`
    took every one). A step of the very same requests, none finished, none with logprobs, goes
    there again without asking each request's state again: what could make a state refuse
    (another sequence, text, logprobs, a finish, a cached count or prompt logprobs not sent yet) is
    fixed for a running request or ends it, and a request that ends, leaves or comes back changes
    the step's requests. Per request per step: one token appended and counted sent."""

    def __init__(self) -> None:
        self._requests: list[Request] = []  # empty: the last step was not one of them all alone
        self._ids: list[str] = []
        self._states: dict[str, RequestState] = {}  # by request id: the engine's
        self._seqs: list[_Sequence] = []  # found at the first step taken again

    def remember(self, requests: list[Request], ids: list[str], states: dict[str, RequestState]) -> None:
        """Every one of `requests` went alone this step, as `ids` (their states: `states[id]`);
        `requests` empty: not every one did."""
        self._requests, self._ids, self._states, self._seqs = requests, ids, states, []

    def take(self, requests: list[Request], tokens: list[int], logprobs: list[TokenLogprobs | None],
             alone: StepTokens) -> bool:
        """Record this step's tokens (`tokens[i]`: request i's) as sent alone where the step is the
        last one's again (True); False: nothing recorded, the step goes through every state."""
        last, num = self._requests, len(requests)
        if (not last or num != len(last) or not all(map(is_, requests, last)) or logprobs.count(None) != num
                or list(map(_status, requests)).count(_RUNNING) != num):
            self._requests = []
            return False
        seqs = self._seqs
        if not seqs:
            states = [self._states.get(rid) for rid in self._ids]
            if None in states:
                self._requests = []
                return False
            seqs = self._seqs = [state.sequences[0] for state in states if state is not None]
        for seq, token in zip(seqs, tokens, strict=True):  # NOTE: add_token_alone's last lines
            token_ids = seq.token_ids
            if getrefcount(token_ids) > UNSHARED_REFS:
                token_ids = seq.token_ids = token_ids[:]
            token_ids.append(token)
            seq.num_sent += 1
        alone.request_ids.extend(self._ids)
        alone.token_ids.extend(tokens)
        return True


_RUNNING = RequestStatus.RUNNING  # NOTE: counted by identity: an Enum's hash is Python code (3x the time)
_status = attrgetter("status")


@dataclass(slots=True)
class _Sequence:
    """Output state of one of a request's `n` sequences."""

    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent: int = 0  # tokens some `RequestDelta` carried already ...
    finish_sent: bool = False  # ... and whether one carried the finish reason


@dataclass(frozen=True, slots=True)
class OutputSettings:
    """How an engine's output processor makes outputs: its tokenizer, and whether it makes text
    (False: token ids, logprobs and finish reasons only, no text and no stop strings; the engine
    core process, whose API process's output processor makes the text)."""

    tokenizer: Tokenizer
    detokenize: bool = True


@dataclass(slots=True, eq=False)  # eq=False: compared, hashed by identity
class RequestState:
    """Everything the output side keeps for one user request (with its `n` engine sequences).

    The fields up to `detokenize` are what it is made of (`of_request` takes them from a request's
    SamplingParams); `detokenize` False: token ids, logprobs and finish reasons only, no text and
    no stop strings (see OutputSettings)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    n: int
    tokenizer: Tokenizer
    skip_special_tokens: bool
    want_logprobs: bool
    stop: tuple[str, ...]
    include_stop: bool
    min_tokens: int  # like stop tokens, stop strings cannot end a shorter output
    arrival_time: float
    text_prefix: str = ""
    utf8_prefix: bytes = b""
    detokenize: bool = True
    sequences: list[_Sequence] = field(init=False)
    # Text that could still become a stop string is held back until it cannot.
    holdback: int = field(init=False)
    metrics: RequestMetrics = field(init=False)
    num_cached_tokens: int = field(init=False, default=0)
    prompt_logprobs: list[PromptLogprobs | None] | None = field(init=False, default=None)
    num_unfinished: int = field(init=False)  # sequences without a finish reason (`finished`: O(1) a step)
    prompt_logprobs_sent: bool = field(init=False, default=False)  # a `RequestDelta` carried them
    delta_sent: bool = field(init=False, default=False)  # a first `RequestDelta` was made
    # one sequence, no text, no logprobs: what `add_token_alone` asks first, asked once
    alone_kind: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        # NOTE: a resumed request's text starts where its client's text stopped (SamplingParams.text_prefix)
        self.sequences = [_Sequence(IncrementalDetokenizer(self.tokenizer, self.skip_special_tokens, self.utf8_prefix),
                                    logprobs=[] if self.want_logprobs else None, text=self.text_prefix)
                          for _ in range(self.n)]
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        if not self.detokenize:
            self.stop = ()
        self.metrics = RequestMetrics(self.arrival_time)
        self.num_unfinished = self.n
        self.alone_kind = self.n == 1 and not self.detokenize and not self.want_logprobs

    @classmethod
    def of_request(cls, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                   settings: OutputSettings, arrival_time: float) -> RequestState:
        return cls(request_id, prompt, prompt_token_ids, params.n, settings.tokenizer, params.skip_special_tokens,
                   params.logprobs is not None, params.stop, params.include_stop_str_in_output, params.min_tokens,
                   arrival_time, params.text_prefix, bytes(params.utf8_prefix), settings.detokenize)

    @property
    def finished(self) -> bool:
        return not self.num_unfinished

    def add_token(self, index: int, token_id: int, logprobs: TokenLogprobs | None) -> str | None:
        """Record a sampled token; returns the stop string if the text now contains one."""
        seq = self.sequences[index]
        metrics = self.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = time.monotonic()
        token_ids = seq.token_ids
        if getrefcount(token_ids) > UNSHARED_REFS:  # copy on write: a snapshot still out there holds it
            token_ids = seq.token_ids = token_ids[:]
        token_ids.append(token_id)
        if logprobs is not None and seq.logprobs is not None:
            entries = seq.logprobs
            if getrefcount(entries) > UNSHARED_REFS:
                entries = seq.logprobs = entries[:]
            entries.append(logprobs)
        if not self.detokenize:
            return None
        new_text = seq.detokenizer.push(token_id)
        if not new_text:
            return None
        # NOTE: the text is taken off the sequence first, so that unless a snapshot still holds it, the
        # local name is its only reference and `+=` appends in place (an attribute's `+=` copies it all)
        text, seq.text = seq.text, ""
        search_from = max(0, len(text) - self.holdback)
        text += new_text
        seq.text = text
        if not self.stop or len(seq.token_ids) < self.min_tokens:
            return None
        for stop in self.stop:
            at = seq.text.find(stop, search_from)
            if at != -1:
                seq.text = seq.text[: at + len(stop)] if self.include_stop else seq.text[:at]
                return stop
        return None

    def finish(self, index: int, reason: RequestStatus, stop_reason: int | str | None) -> None:
        seq = self.sequences[index]
        if seq.finish_reason is not None:
            return
        if self.detokenize and (reason != RequestStatus.FINISHED_STOPPED or not isinstance(stop_reason, str)):
            seq.text += seq.detokenizer.flush()
        seq.finish_reason = reason.value
        seq.stop_reason = stop_reason
        self.num_unfinished -= 1
        if self.finished:
            self.metrics.finished_time = time.monotonic()

    def snapshot(self) -> RequestOutput:
        holdback = self.holdback
        outputs = []
        for index, seq in enumerate(self.sequences):
            text = seq.text
            if holdback and seq.finish_reason is None:
                text = text[: max(0, len(text) - holdback)]
            logprobs = seq.logprobs
            # NOTE: the lists themselves, not copies: `add_token` copies one before appending while a
            # snapshot holds it, so a snapshot never changes, and a step is O(new tokens) once it is dropped
            outputs.append(CompletionOutput(index, text, seq.token_ids, seq.finish_reason, seq.stop_reason, logprobs))
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs, not self.num_unfinished,
                             self.num_cached_tokens, self.metrics, self.prompt_logprobs)

    def add_token_alone(self, request: Request, logprobs: TokenLogprobs | None) -> bool:
        """The engine core's short path (`StepTokens`): where this request's next delta would carry
        the engine request's newest token and nothing else (one sequence, no text, no logprobs, not
        finished; its first delta made and nothing since that `LLMEngine._advance` would add: the
        cached count, prompt logprobs), record it as sent and return True. False: nothing recorded.
        NOTE: per request per step: what `add_token` would do here (its first token is behind it,
        no text, no logprobs) is done inline."""
        if not self.alone_kind or not self.delta_sent or logprobs is not None or self.metrics.first_token_time is None:
            return False
        seq = self.sequences[0]
        token_ids = seq.token_ids
        if (seq.finish_reason is not None or len(token_ids) != seq.num_sent or request.status in FINISHED_STATUSES
                or request.num_cached_tokens != self.num_cached_tokens
                or (request.prompt_logprobs is not None and not self.prompt_logprobs_sent)):
            return False
        if getrefcount(token_ids) > UNSHARED_REFS:  # copy on write, as in `add_token`
            token_ids = seq.token_ids = token_ids[:]
        token_ids.append(request.all_token_ids[-1])
        seq.num_sent += 1
        return True

    def delta(self) -> RequestDelta:
        """What is new since the last delta: new tokens (and their logprobs), finish reasons not
        sent yet, the prompt's logprobs once complete. The engine core process's output: no
        snapshot of the whole output is made, so a step's cost is O(new tokens)."""
        sequences = []
        for index, seq in enumerate(self.sequences):
            num_sent, token_ids = seq.num_sent, seq.token_ids
            ending = seq.finish_reason is not None and not seq.finish_sent
            if len(token_ids) == num_sent and not ending:
                continue
            logprobs = None if seq.logprobs is None else seq.logprobs[num_sent:]
            sequences.append(SequenceDelta(index, token_ids[num_sent:], logprobs, seq.finish_reason if ending else None,
                                           seq.stop_reason if ending else None))
            seq.num_sent = len(token_ids)
            seq.finish_sent = seq.finish_sent or ending
        prompt_logprobs = None
        if self.prompt_logprobs is not None and not self.prompt_logprobs_sent:
            prompt_logprobs, self.prompt_logprobs_sent = self.prompt_logprobs, True
        self.delta_sent = True
        return RequestDelta(self.request_id, sequences, self.num_cached_tokens, self.metrics.first_scheduled_time,
                            prompt_logprobs)
