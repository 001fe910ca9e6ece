"""What the PD router's client sees of its workers' outputs: the first token prefill sampled, sent
before decode has the KV (`EarlyFirstToken`); a request resumed on another decode worker, after
what was sent before (`continuation`, `after_sent`); decode's output frames as RequestOutputs.

The early first token. Prefill samples a request's first token and hands it to decode with the KV
(decode's first output is that token). The router asks for it (POST /pd/prefill's streamed answer,
memory queue) and sends it to the client at once, which takes the KV hand-off's tail and decode's
first step off the time to the first token; decode's first frame, the same token, is then dropped.
Only where it is exactly what decode would send (`first_output`): one sequence, no logprobs of any
kind (decode samples the first tokens itself then, or the first output carries what prefill did not
send), greedy or seeded sampling (what a retried prefill samples again), and a first token that does
not end the request (EOS, a stop token or string, the length): decode's output says how it ends.
Its text is what decode's engine output state makes of the same token (stop strings held back,
unfinished characters). Should decode's frames not continue the token sent (a retried or recomputed
prefill sampled another one after all), the attempt fails over as after a decode loss
(`AttemptFailed`): the request resumes over prompt + the token sent, as it does when decode is lost
after it. A hand-off that fails after it ends the request with decode's error, as before, but in the
stream (its status went out with the first token). It meets the first-token deadline; the rest of
the hand-off is bounded by decode's lease and transfer timeout, as a stall after the first token.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from pdserve.disagg.control import FirstToken, OutputFrame
from pdserve.engine.logprobs import PromptLogprobs
from pdserve.engine.output import CompletionOutput, RequestOutput, RequestState
from pdserve.engine.sampling_params import SamplingParams
from pdserve.serving.trace import TTFTPhases
from pdserve.tokenizer import Tokenizer
from pdserve.tokenizer.detokenizer import detokenize

logger = logging.getLogger(__name__)
# a run's first token, errors, and decode's frames (bytes as the frame stream read them, or OutputFrames, then
# None at their end, on a stream of their own): `WorkerClient.stream_merged` (disagg/client.py)
Inbox = asyncio.Queue[OutputFrame | FirstToken | bytes | BaseException | None]


class DecodeLost(Exception):
    """The decode worker went away mid-request (connection dropped, or its stream ended early)."""


class AttemptFailed(DecodeLost):
    """Decode's frames do not continue the first token prefill sent (another attempt's first token
    reached decode), though the decode worker is still there: the request resumes after the token
    sent, as after a loss."""


def early_first_token_wanted(params: SamplingParams) -> bool:
    """Whether prefill's first token can be what decode would send first (module docstring)."""
    # NOTE: an unseeded sample is drawn again by a retried or recomputed prefill, most likely another
    # token: decode's output would not continue the one sent (a resume each time)
    return (params.n == 1 and params.logprobs is None and params.prompt_logprobs is None
            and (params.greedy or params.seed is not None))


def first_output(tokenizer: Tokenizer, max_model_len: int, vocab_size: int, num_prompt_tokens: int,
                 params: SamplingParams, token_id: int) -> CompletionOutput | None:
    """What a decode engine emits for the first token `token_id` of a request of `params` (its
    text: stop strings held back, an unfinished character's bytes kept); None when that token ends
    the request (Request.check_stop, a stop string), or is no token of the model."""
    if not 0 <= token_id < vocab_size:
        return None
    if params.min_tokens <= 1 and (token_id in params.stop_token_ids
                                   or (not params.ignore_eos and token_id in tokenizer.eos_token_ids)):
        return None
    max_new = params.max_tokens if params.max_tokens is not None else max_model_len
    if num_prompt_tokens + 1 >= min(max_model_len, num_prompt_tokens + max_new):
        return None
    state = RequestState("", None, [], 1, tokenizer, params.skip_special_tokens, False, params.stop,
                         params.include_stop_str_in_output, params.min_tokens, 0.0, params.text_prefix,
                         bytes(params.utf8_prefix))
    if state.add_token(0, token_id, None) is not None:
        return None
    return state.snapshot().outputs[0]


@dataclass(slots=True)
class EarlyFirstToken:
    """One attempt's first token from prefill, and decode's outputs after it (module docstring)."""

    tokenizer: Tokenizer
    max_model_len: int
    vocab_size: int
    request_id: str
    prompt: list[int]
    params: SamplingParams
    num_cached_tokens: int  # the decode reservation's (decode reports the longer of its and prefill's)
    inbox: Inbox = field(default_factory=asyncio.Queue)  # the first token lands here (then decode's frames)
    sent: RequestOutput | None = None  # the first token, once out
    too_late: bool = False  # decode's own first token came first, or prefill's would end the request

    def take(self, first: FirstToken, transfer_id: str) -> RequestOutput | None:
        """The output to send now for prefill's first token (None: not this one: another attempt's,
        too late, or one that decode must send)."""
        if self.sent is not None or self.too_late or first.transfer_id != transfer_id:
            return None
        seq = first_output(self.tokenizer, self.max_model_len, self.vocab_size, len(self.prompt), self.params,
                           first.token_id)
        if seq is None:
            self.too_late = True
            return None
        self.sent = RequestOutput(self.request_id, None, self.prompt, [seq], False,
                                  max(self.num_cached_tokens, first.prefill_cached_tokens))
        return self.sent

    @staticmethod
    def phases(first: FirstToken) -> TTFTPhases | None:
        """The TTFT phases of a request whose first token came from prefill (no decode step in it)."""
        if first.prefill_queue_s is None or first.prefill_compute_s is None:
            return None
        return TTFTPhases(first.prefill_queue_s, first.prefill_compute_s, first_decode_step_s=0.0)

    def after(self, output: RequestOutput) -> RequestOutput | None:
        """Decode's `output` as the client gets it: None when it only repeats the token sent; raises
        AttemptFailed when it does not continue what was sent."""
        seq = output.outputs[0]
        if seq.token_ids:
            self.too_late = True
        if self.sent is None:
            return output
        early = self.sent.outputs[0]
        if seq.token_ids[:1] != early.token_ids or not seq.text.startswith(early.text):
            raise AttemptFailed(f"decode's output {seq.token_ids[:1]} does not continue the first token sent "
                                f"({early.token_ids}): a retried prefill sampled another one")
        if seq.token_ids == early.token_ids and seq.text == early.text and not output.finished:
            return None
        return output


def continuation(tokenizer: Tokenizer, params: SamplingParams, sent_tokens: list[int],
                 sent_text: str) -> SamplingParams:
    """What is left of a request after `sent_tokens` went out (resuming on another worker). The
    new worker's text starts with what those tokens made that the client did not get yet: text
    held back as a possible start of a stop string, and the bytes of an unfinished character
    (else those would be lost, and a stop string across the resume missed). A structured output's
    matcher replays them (they end the new prompt), so it continues the same grammar."""
    if not sent_tokens:
        return params
    made, unfinished = detokenize(tokenizer, sent_tokens, params.skip_special_tokens)
    if not made.startswith(sent_text):
        logger.error("resumed text does not continue what the client got (%r / %r)", sent_text[-20:], made[-20:])
    held_back = made[len(sent_text):] if made.startswith(sent_text) else ""
    num_sent = len(sent_tokens)
    max_tokens = None if params.max_tokens is None else params.max_tokens - num_sent
    # NOTE: the prompt's logprobs came with the first token: not asked again (over prompt + sent tokens)
    return dataclasses.replace(params, max_tokens=max_tokens, min_tokens=max(0, params.min_tokens - num_sent),
                               text_prefix=held_back, utf8_prefix=tuple(unfinished),
                               seed_draws_done=params.seed_draws_done + num_sent, prompt_logprobs=None,
                               structured_replay=params.structured_replay + num_sent if params.structured else 0)


def after_sent(request_id: str, prompt: list[int], sent: CompletionOutput, output: RequestOutput,
               prompt_logprobs: list[PromptLogprobs | None] | None) -> RequestOutput:
    """`output` of a resumed request as its client sees it: after what was sent before the loss,
    with the prompt's logprobs (if asked for) on every output, as a colocated engine's."""
    seqs = output.outputs
    if sent.token_ids:
        seq = seqs[0]
        logprobs = None if seq.logprobs is None else (sent.logprobs or []) + seq.logprobs
        seqs = [dataclasses.replace(seq, token_ids=sent.token_ids + seq.token_ids, text=sent.text + seq.text,
                                    logprobs=logprobs)]
    return RequestOutput(request_id, None, prompt, seqs, output.finished, output.num_cached_tokens,
                         prompt_logprobs=prompt_logprobs)


async def next_within(outputs: AsyncGenerator[RequestOutput, None], timeout_s: float | None) -> RequestOutput:
    """`anext(outputs)` within `timeout_s` (TimeoutError past it). A cancel of the awaiting task
    (the client went away) always raises CancelledError and cancels the wait.
    NOTE: not `asyncio.wait_for`: before Python 3.12 it returns the output instead when the cancel
    comes just after the output did, and the router then streams to a client that is gone."""
    step = asyncio.ensure_future(anext(outputs))
    try:
        await asyncio.wait((step,), timeout=timeout_s)
    except asyncio.CancelledError:
        step.cancel()  # NOTE: and waited for, so the generator is no longer running when it is closed
        await asyncio.gather(step, return_exceptions=True)
        raise
    if not step.done():
        step.cancel()
        await asyncio.gather(step, return_exceptions=True)
        raise TimeoutError
    return step.result()
