"""Control-plane messages between router, prefill and decode workers (JSON over HTTP, validated
by pydantic on arrival; never pickle)."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, Field

from pdserve.addresses import HTTP_URL_PATTERN
from pdserve.engine.logprobs import PromptLogprobs, TokenLogprobs
from pdserve.engine.output import CompletionOutput, RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.serving.trace import TTFTPhases

Role = Literal["prefill", "decode", "colocated"]


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
    (the previous attempt is cancelled: its late payloads are rejected)."""

    transfer_id: str


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
    the router may send it to its client at once (router_outputs.py says when)."""

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
    """Another of a request's `n` sequences (cumulative, like CompletionOutput)."""

    index: int
    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[WireLogprobs] | None = None

    @classmethod
    def of(cls, seq: CompletionOutput) -> SequenceFrame:
        return cls(index=seq.index, text=seq.text, token_ids=seq.token_ids, finish_reason=seq.finish_reason,
                   stop_reason=seq.stop_reason, logprobs=WireLogprobs.of_list(seq.logprobs))

    def build(self) -> CompletionOutput:
        return CompletionOutput(self.index, self.text, self.token_ids, self.finish_reason, self.stop_reason,
                                WireLogprobs.build_list(self.logprobs))


class OutputFrame(BaseModel):
    """decode -> router, one NDJSON line per engine output (cumulative, like RequestOutput). The
    top-level text, token ids, finish and logprobs are sequence 0's; `other_sequences` holds
    sequences 1..n-1 of a request with n > 1."""

    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[WireLogprobs] | None = None  # only when the request asked for them
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

    @classmethod
    def of(cls, output: RequestOutput, with_prompt_logprobs: bool = True) -> OutputFrame:
        seq = output.outputs[0]
        return cls(text=seq.text, token_ids=seq.token_ids, finish_reason=seq.finish_reason,
                   stop_reason=seq.stop_reason, logprobs=WireLogprobs.of_list(seq.logprobs),
                   other_sequences=[SequenceFrame.of(s) for s in output.outputs[1:]],
                   num_cached_tokens=output.num_cached_tokens,
                   prompt_logprobs=WirePromptLogprobs.of_list(output.prompt_logprobs) if with_prompt_logprobs else None)

    def sequences(self) -> list[CompletionOutput]:
        """Every sequence, in index order."""
        first = CompletionOutput(0, self.text, self.token_ids, self.finish_reason, self.stop_reason,
                                 WireLogprobs.build_list(self.logprobs))
        return [first] + [s.build() for s in self.other_sequences]


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
