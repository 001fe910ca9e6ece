"""What one run of a request is made of, on whichever side of the cluster drives it: its signed
prefill job, the placement that names its decode reservation, and decode's output frames made back
into `RequestOutput`s. The router's `RequestRun` (router/request_run.py) and a decode worker in
gateway mode (worker/gateway.py) build them here, so the two paths cannot drift apart: a job that
prefill runs for the router is the job it runs for a gateway.
"""

from __future__ import annotations

import dataclasses

from pdserve.disagg.auth import ClusterSecret, sign_job
from pdserve.disagg.control import (
    FrameDecoder,
    OutputFrame,
    Placement,
    PrefillJob,
    ReserveReply,
    WirePromptLogprobs,
    WireSamplingParams,
)
from pdserve.disagg.request_ids import transfer_id
from pdserve.engine.output import RequestOutput
from pdserve.engine.sampling_params import SamplingParams


def prefill_job(secret: ClusterSecret | None, run: str, prompt: list[int], params: SamplingParams,
                placement: Placement | None = None) -> PrefillJob:
    """Run `run`'s prefill job (attempt 0), naming the decode reservation `placement` if there is
    one, signed with the cluster secret (prefill acts only on jobs a cluster member signed).
    NOTE: prefill computes the prompt's KV once for all n sequences; with n > 1 or logprobs,
    decode samples the first tokens itself (LLMEngine.complete_remote)."""
    job = PrefillJob(request_id=run, transfer_id=transfer_id(run, 0), prompt_token_ids=prompt,
                     params=WireSamplingParams.of(dataclasses.replace(params, n=1, logprobs=None)))
    if placement is not None:
        job = job.with_placement(placement)
    return sign_job(secret, job)


def placement(tid: str, decode_url: str, reply: ReserveReply) -> Placement:
    """Where attempt `tid`'s KV goes: the reservation `reply` on the decode worker at `decode_url`."""
    return Placement(transfer_id=tid, decode_url=decode_url, kv_address=reply.kv_address, block_ids=reply.block_ids,
                     num_cached_tokens=reply.num_cached_tokens, token=reply.token)


def request_output(request_id: str, prompt: list[int], frame: OutputFrame, frames: FrameDecoder) -> RequestOutput:
    """The cumulative output after `frame` (a delta, already `frames.check`ed) of the stream `frames`
    rebuilds; FrameGap if it does not continue the frames before it."""
    seqs = frames.sequences(frame)
    return RequestOutput(request_id, None, prompt, seqs, all(s.finished for s in seqs), frame.num_cached_tokens,
                         prompt_logprobs=WirePromptLogprobs.build_list(frame.prompt_logprobs))
