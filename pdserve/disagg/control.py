"""Control-plane messages between router, prefill and decode workers (JSON over HTTP, validated
by pydantic on arrival; never pickle)."""

from __future__ import annotations

import dataclasses
from sys import getrefcount
from typing import Any, Literal

from pydantic import BaseModel, Field

from pdserve.addresses import HTTP_URL_PATTERN
from pdserve.engine.logprobs import PromptLogprobs, TokenLogprobs
from pdserve.engine.output import UNSHARED_REFS, CompletionOutput, RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.serving.trace import TTFTPhases

Role = Literal["prefill", "decode", "colocated"]
WorkerRole = Literal["prefill", "decode"]  # a PD worker's role


class WireSamplingParams(BaseModel):
    """SamplingParams as JSON; the receiving engine re-validates by constructing them."""

    fields: dict[str, Any]

    @classmethod
    def of(cls, params: SamplingParams) -> WireSamplingParams:
        return cls(fields={f.name: getattr(params, f.name) for f in dataclasses.fields(params)})

    def build(self) -> SamplingParams:
        return SamplingParams(**self.fields)


class ReserveRequest(BaseModel):
    """router -> decode: hold blocks for this prompt before prefill starts; the KV receiver expects
    `transfer_id` (attempt 0 of the request)."""

    request_id: str
    transfer_id: str
    prompt_token_ids: list[int] = Field(min_length=1)
    params: WireSamplingParams


class ReserveReply(BaseModel):
    """decode -> router: where the KV goes, and how much of it the decode worker already has."""

    block_ids: list[int]
    num_cached_tokens: int
    kv_address: str
    # random per reservation: only a KV stream that presents it may write the reserved blocks
    token: str = ""


class PrefillJob(BaseModel):
    """router -> prefill (directly, or through the shared queue): compute this prompt and stream
    its KV into the reservation. `transfer_id` names this attempt; `decode_url` is the decode
    worker holding the reservation (a consumer that gives up on the job tells it why); `token` is
    the reservation's (ReserveReply), which the KV stream presents; `signature` the router's over
    everything else but `transfer_id` (disagg/auth.py: prefill refuses a job it cannot verify).
    A job without `kv_address` is not placed yet (the router dispatched it while it reserved, memory
    queue): prefill computes it and sends its KV once a `Placement` names the reservation."""

    request_id: str
    transfer_id: str
    decode_url: str = ""
    prompt_token_ids: list[int] = Field(min_length=1)
    params: WireSamplingParams
    kv_address: str = ""
    block_ids: list[int] = Field(default_factory=list)
    num_cached_tokens: int = Field(default=0, ge=0)
    token: str = ""
    signature: str = ""

    @property
    def placed(self) -> bool:
        return bool(self.kv_address)

    def with_placement(self, placement: Placement) -> PrefillJob:
        """This job with the reservation `placement` names (unsigned: sign it again)."""
        return self.model_copy(update={"decode_url": placement.decode_url, "kv_address": placement.kv_address,
                                       "block_ids": placement.block_ids,
                                       "num_cached_tokens": placement.num_cached_tokens, "token": placement.token,
                                       "signature": ""})


class Placement(BaseModel):
    """router -> prefill (POST /pd/place/{transfer_id}): the decode reservation of a job sent
    unplaced; `signature` the router's over the rest (disagg/auth.py)."""

    transfer_id: str
    decode_url: str
    kv_address: str = Field(min_length=1)
    block_ids: list[int]
    num_cached_tokens: int = Field(ge=0)
    token: str = ""
    signature: str = ""


class Retarget(BaseModel):
    """router/queue consumer -> decode: the reservation now expects this attempt's transfer id
    (the previous attempt is cancelled: its late payloads are rejected). With `replaces`, only if
    the reservation still expects that attempt: whoever moved it on first runs the new attempt, a
    second copy of the move is refused (404), so no attempt is run by two prefill workers."""

    transfer_id: str
    replaces: str = ""  # the attempt this one replaces ("": whichever the reservation expects)


class FailJob(BaseModel):
    """router/queue consumer -> decode: this request cannot be prefilled (refused, dead-lettered,
    or its attempt `transfer_id` failed on the prefill side); end it with this error. Only if it
    still waits for that attempt ("": for any attempt)."""

    reason: str
    transfer_id: str = ""


class PrefixQuery(BaseModel):
    """router -> decode or prefill (prefix affinity): how much of this prompt do you cache?"""

    prompt_token_ids: list[int]


class PrefixReply(BaseModel):
    """decode or prefill -> router: leading prompt tokens its prefix cache (pool, disk tier) holds now."""

    num_cached_tokens: int


class Keepalive(BaseModel):
    """prefill -> decode: these attempts are still being computed (POST /pd/alive); `ended`: these
    ended on the prefill side without a complete hand-off (its flush timed out: what was not sent
    never will be), so decode stops waiting for them now rather than at its lease."""

    transfer_ids: list[str]
    ended: list[str] = []
    # the prefill engine's longest step of the last few seconds, the running one included (at its age
    # so far): decode's deadline for these attempts is a multiple of it (transport/cadence.py). None:
    # not said (an older prefill worker); decode then judges by the gaps it saw alone.
    step_s: float | None = Field(default=None, ge=0.0, allow_inf_nan=False)


class KeepaliveReply(BaseModel):
    """decode -> prefill, the answer to a keepalive: decode's own recent step time, as Keepalive.step_s
    (None: not said, an older decode worker answers {}). Prefill's waits on this decode worker (its
    acknowledgements, a placement) are a multiple of it (transport/cadence.py): a decode worker busy
    with long steps acknowledges late and is not gone."""

    step_s: float | None = Field(default=None, ge=0.0, allow_inf_nan=False)


class HandOff(BaseModel):
    """prefill -> router: how one prefill job ended (the reply to POST /pd/prefill). `failed`: the
    prefill side gave up (compute error, no first token, the KV connection lost): whoever ran the
    job tells the decode worker at once (POST /pd/fail). `timed_out`: decode did not acknowledge
    in time; the prefill service told decode itself (Keepalive.ended), which retries or recomputes."""

    transfer_id: str
    status: Literal["handed_off", "failed", "timed_out", "aborted"]
    reason: str = ""
    # handed_off: prompt tokens prefill took from its prefix cache (pool or disk tier), not computed
    prefill_cached_tokens: int = 0


class FirstToken(BaseModel):
    """prefill -> router: a job's first token, as soon as prefill sampled it (the first line of
    POST /pd/prefill's NDJSON answer, when the router asked for one), before the KV hand-off ends:
    the router may send it to its client at once (router/outputs.py says when)."""

    transfer_id: str
    token_id: int
    prefill_cached_tokens: int = 0  # prompt tokens prefill took from its prefix cache
    # the TTFT phases prefill measured (disagg/phases.py), when it did
    prefill_queue_s: float | None = None
    prefill_compute_s: float | None = None


class PrefillEvent(BaseModel):
    """One NDJSON line of POST /pd/prefill's streamed answer: the first token (at most once), then
    how the hand-off ended (always last)."""

    first_token: FirstToken | None = None
    hand_off: HandOff | None = None


class WorkerInfo(BaseModel):
    """What a worker advertises (GET /pd/info); the router's view of its pool."""

    role: Role
    model: str
    kv_layout: dict[str, Any]
    kv_transport: str
    kv_address: str | None
    ready: bool
    num_running: int
    num_waiting: int
    num_free_kv_blocks: int
    num_kv_blocks: int
    max_num_batched_tokens: int = 0
    draining: bool = False
    instance_id: str = ""  # new at each start: a worker back at the same URL is another instance
    # LoRA (vllm:lora_requests_info): slots (0: no LoRA), the adapters of running and waiting requests
    max_lora: int = 0
    running_lora_adapters: list[str] = Field(default_factory=list)
    waiting_lora_adapters: list[str] = Field(default_factory=list)
    # KV-cache events (--kv-events-config): its ZMQ PUB and replay addresses (a wildcard host stands
    # for the host the worker is reached at) and topic; None: it publishes none a router can subscribe to
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""


class Registration(BaseModel):
    """worker -> router (POST /pd/register, again every few seconds; POST /pd/deregister on drain)."""

    role: Literal["prefill", "decode"]
    url: str = Field(pattern=HTTP_URL_PATTERN)


class WireLogprobs(BaseModel):
    """One token's TokenLogprobs as JSON (floats survive it exactly)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]

    @classmethod
    def of_list(cls, entries: list[TokenLogprobs] | None) -> list[WireLogprobs] | None:
        return None if entries is None else [cls(token_id=e.token_id, logprob=e.logprob, top=list(e.top))
                                             for e in entries]

    @staticmethod
    def build_list(entries: list[WireLogprobs] | None) -> list[TokenLogprobs] | None:
        return None if entries is None else [TokenLogprobs(e.token_id, e.logprob, tuple(e.top)) for e in entries]


class WirePromptLogprobs(BaseModel):
    """One prompt token's PromptLogprobs as JSON."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]

    @classmethod
    def of_list(cls, entries: list[PromptLogprobs | None] | None) -> list[WirePromptLogprobs | None] | None:
        return None if entries is None else [
            None if e is None else cls(token_id=e.token_id, logprob=e.logprob, rank=e.rank, top=list(e.top))
            for e in entries]

    @staticmethod
    def build_list(entries: list[WirePromptLogprobs | None] | None) -> list[PromptLogprobs | None] | None:
        return None if entries is None else [
            None if e is None else PromptLogprobs(e.token_id, e.logprob, e.rank, tuple(e.top)) for e in entries]


class SequenceFrame(BaseModel):
    """Another of a request's `n` sequences: what is new in it since the previous frame (OutputFrame)."""

    index: int
    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[WireLogprobs] | None = None
    num_tokens_before: int = Field(default=0, ge=0)
    text_offset: int = Field(default=0, ge=0)


class OutputFrame(BaseModel):
    """decode -> router, one NDJSON line per engine output of a stream (GET /pd/stream/{id}), each
    a DELTA: only what is new since the stream's previous frame (`FrameEncoder` makes them,
    `FrameDecoder` rebuilds the cumulative RequestOutput and refuses a frame that does not follow).
    The top-level fields are sequence 0's; `other_sequences` holds sequences 1..n-1 of a request
    with n > 1 (every one in every frame, with what is new in it).

    Per sequence: `token_ids` the tokens after the first `num_tokens_before` ones; `text` replaces
    the text from character `text_offset` on (the length of what the cumulative text kept of the
    text before: all of it unless the engine changed earlier characters); `logprobs` the entries
    after those sent before; `finish_reason` and `stop_reason` as they are now. `frame_no` counts
    the stream's frames from 0 (retry and error frames included), so that a missed or reordered one
    is refused. NOTE: no version of this format is negotiated: a router and its decode workers must
    run the same pdserve (before this format, frames were cumulative)."""

    frame_no: int = Field(default=0, ge=0)
    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[WireLogprobs] | None = None  # only when the request asked for them
    num_tokens_before: int = Field(default=0, ge=0)
    text_offset: int = Field(default=0, ge=0)
    other_sequences: list[SequenceFrame] = Field(default_factory=list)
    num_cached_tokens: int = 0
    error: str | None = None
    # decode -> router: the transfer made no progress for a timeout; prefill it again (new attempt)
    kv_retry: bool = False
    # first frame with tokens only, when the KV came from prefill: the TTFT phases the workers
    # measured (disagg/phases.py), which the router records as they are
    phases: TTFTPhases | None = None
    # asked for (prompt_logprobs, echo with logprobs): only the first frame that has them; they
    # hold for every later output of the request
    prompt_logprobs: list[WirePromptLogprobs | None] | None = None


class FrameGap(Exception):
    """A stream's frame does not follow the ones before it (missed, reordered, or inconsistent)."""


@dataclasses.dataclass(slots=True)
class _Sent:
    """What a stream's frames said of one sequence so far (either side keeps one per sequence)."""

    num_tokens: int = 0
    text: str = ""
    num_logprobs: int = 0


def _text_delta(sent: str, text: str) -> tuple[int, str]:
    """(offset, new text from there) that turns `sent` into `text`: all after `sent` when `text`
    extends it (the usual case), else after the part of it that `text` kept."""
    if text.startswith(sent):
        return len(sent), text[len(sent):]
    keep = 0
    for a, b in zip(sent, text, strict=False):
        if a != b:
            break
        keep += 1
    return keep, text[keep:]


class FrameEncoder:
    """Decode's side of one stream: each engine output as a delta OutputFrame (OutputFrame)."""

    def __init__(self) -> None:
        self._sent: dict[int, _Sent] = {}
        self._frames = 0
        self._prompt_logprobs_sent = False  # NOTE: once, with the first output that has them: they never change

    def _next_no(self) -> int:
        no = self._frames
        self._frames += 1
        return no

    def signal(self, **fields: Any) -> OutputFrame:
        """A frame without output (a retry, an error), numbered in the stream."""
        return OutputFrame(frame_no=self._next_no(), **fields)

    def _delta(self, seq: CompletionOutput) -> dict[str, Any]:
        sent = self._sent.setdefault(seq.index, _Sent())
        if len(seq.token_ids) < sent.num_tokens:
            raise ValueError(f"sequence {seq.index} has fewer tokens ({len(seq.token_ids)}) than were sent")
        offset, text = _text_delta(sent.text, seq.text)
        logprobs = None
        if seq.logprobs is not None:
            logprobs = WireLogprobs.of_list(seq.logprobs[sent.num_logprobs:])
            sent.num_logprobs = len(seq.logprobs)
        delta = {"text": text, "token_ids": seq.token_ids[sent.num_tokens:], "finish_reason": seq.finish_reason,
                 "stop_reason": seq.stop_reason, "logprobs": logprobs, "num_tokens_before": sent.num_tokens,
                 "text_offset": offset}
        sent.num_tokens = len(seq.token_ids)
        sent.text = seq.text
        return delta

    def frame(self, output: RequestOutput) -> OutputFrame:
        """The frame for the stream's next engine output."""
        prompt_logprobs = None
        if not self._prompt_logprobs_sent and output.prompt_logprobs is not None:
            prompt_logprobs = WirePromptLogprobs.of_list(output.prompt_logprobs)
            self._prompt_logprobs_sent = True
        others = [SequenceFrame(index=s.index, **self._delta(s)) for s in output.outputs[1:]]
        return OutputFrame(frame_no=self._next_no(), **self._delta(output.outputs[0]), other_sequences=others,
                           num_cached_tokens=output.num_cached_tokens, prompt_logprobs=prompt_logprobs)


@dataclasses.dataclass(slots=True)
class _Got:
    """What the router rebuilt of one sequence so far (lists handed out in outputs: copy on write)."""

    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None


class FrameDecoder:
    """The router's side of one stream: its delta frames as the cumulative sequences (OutputFrame).
    Every frame is checked to follow the ones before it (FrameGap: never a wrong text)."""

    def __init__(self) -> None:
        self._got: dict[int, _Got] = {}
        self._frames = 0

    def check(self, frame: OutputFrame) -> None:
        """Count `frame` in (any frame of the stream, in order); FrameGap if it is not the next one."""
        if frame.frame_no != self._frames:
            raise FrameGap(f"frame {frame.frame_no} where frame {self._frames} was due")
        self._frames += 1

    def _apply(self, index: int, delta: OutputFrame | SequenceFrame) -> CompletionOutput:
        got = self._got.setdefault(index, _Got())
        token_ids = got.token_ids
        if delta.num_tokens_before != len(token_ids):
            raise FrameGap(f"sequence {index}: a frame after token {delta.num_tokens_before} where "
                           f"{len(token_ids)} were received")
        if delta.text_offset > len(got.text):
            raise FrameGap(f"sequence {index}: text from character {delta.text_offset} where "
                           f"{len(got.text)} were received")
        # NOTE: outputs hold these lists themselves, copied on write as `RequestState.add_token` does:
        # once the caller dropped the previous output a frame is O(new tokens), not O(output so far)
        if getrefcount(token_ids) > UNSHARED_REFS:
            token_ids = got.token_ids = token_ids[:]
        token_ids.extend(delta.token_ids)
        text, got.text = got.text, ""  # NOTE: off `got` first, so that `+=` can append in place
        if delta.text_offset != len(text):
            text = text[:delta.text_offset]
        text += delta.text
        got.text = text
        if delta.logprobs is not None:
            entries = got.logprobs
            if entries is None:
                entries = got.logprobs = []
            elif getrefcount(entries) > UNSHARED_REFS:
                entries = got.logprobs = entries[:]
            entries.extend(WireLogprobs.build_list(delta.logprobs) or [])
        return CompletionOutput(index, text, token_ids, delta.finish_reason, delta.stop_reason, got.logprobs)

    def sequences(self, frame: OutputFrame) -> list[CompletionOutput]:
        """Every sequence after `frame` (already `check`ed), in index order."""
        seqs = [self._apply(0, frame)] + [self._apply(s.index, s) for s in frame.other_sequences]
        return sorted(seqs, key=lambda s: s.index) if frame.other_sequences else seqs


class ConsumerReport(BaseModel):
    """A prefill worker's queue consumer, in GET /pd/stats: what it did (counters), holds now."""

    consumer: str
    in_flight: int
    counters: dict[str, int]


class WorkerStatsReply(BaseModel):
    """worker -> anyone (GET /pd/stats): what its service did (counters) and holds now."""

    role: Role
    in_flight: int
    draining: bool
    counters: dict[str, int]
    queue: ConsumerReport | None = None
