"""POST /v1/completions."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from pdserve.engine.logprobs import TokenLogprobs
from pdserve.engine.output import CompletionOutput, RequestOutput
from pdserve.engine.structured import StructuredOutput
from pdserve.logs import bind_request_id
from pdserve.serving import echo, generation
from pdserve.serving.engine_client import EngineClient
from pdserve.serving.errors import OpenAIError
from pdserve.serving.generation import ChoiceDelta, DeltaTracker, Job, new_request_id, run_jobs, usage_of
from pdserve.serving.limits import requested_logprobs, requested_max_tokens, requested_prompt_logprobs
from pdserve.serving.protocol import CompletionRequest
from pdserve.serving.sse import ChunkJson, to_json
from pdserve.tokenizer import Tokenizer


def _prompt_token_ids(body: CompletionRequest, tokenizer: Tokenizer) -> list[list[int]]:
    prompt = body.prompt
    if isinstance(prompt, str):
        return [generation.encode_text(tokenizer, prompt, "prompt")]
    token_ids = [p for p in prompt if isinstance(p, int)]
    if len(token_ids) == len(prompt):  # one prompt, as token ids
        return [token_ids]
    # NOTE: the protocol never mixes ids with prompts, so the filter only narrows the type
    return [generation.encode_text(tokenizer, p, "prompt") if isinstance(p, str) else list(p) for p in prompt
            if not isinstance(p, int)]


def _has_text(prompt: object) -> bool:
    """Whether a completion's prompt holds any text (anything else is token ids)."""
    return isinstance(prompt, str) or (isinstance(prompt, list) and any(isinstance(p, str) for p in prompt))


@dataclass(frozen=True, slots=True)
class MaxTokens:
    """A request's output length: what it asked for (None: whatever fits), the server's cap
    (--max-tokens-limit), and the parameter its prompt came in (named in the errors)."""

    requested: int | None
    limit: int | None
    prompt_param: str = "prompt"


def build_jobs(client: EngineClient, prompts: list[list[int]], body: CompletionRequest | Any, request_id: str,
               max_tokens: MaxTokens, structured: StructuredOutput | None = None) -> list[Job]:
    """Validate every prompt before anything is enqueued: bad input never costs compute.
    `structured`: a constraint the handler adds (chat's tool_choice)."""
    jobs = []
    logprobs, prompt_logprobs = requested_logprobs(body), requested_prompt_logprobs(body)
    for index, token_ids in enumerate(prompts):
        resolved = generation.resolve_max_tokens(len(token_ids), max_tokens.requested, client.max_model_len,
                                                 max_tokens.limit, max_tokens.prompt_param)
        try:
            params = body.to_sampling_params(resolved, logprobs, prompt_logprobs, structured)
            client.validate_request(token_ids, params)
        except ValueError as exc:
            raise OpenAIError(str(exc), HTTPStatus.BAD_REQUEST) from exc
        jobs.append(Job(f"{request_id}-{index}", token_ids, params))
    return jobs


def _logprobs_json(tokenizer: Tokenizer, entries: list[TokenLogprobs] | None, offset: int) -> dict | None:
    return None if entries is None else echo.logprobs_json(tokenizer, echo.sampled_entries(entries), offset)


def _prompt_texts(body: CompletionRequest, tokenizer: Tokenizer, jobs: list[Job]) -> list[str]:
    """Each job's prompt as the client wrote it (token-id prompts: decoded), for `echo`."""
    prompt = body.prompt
    items = [prompt] if isinstance(prompt, str) or all(isinstance(p, int) for p in prompt) else list(prompt)
    return [p if isinstance(p, str) else tokenizer.decode(job.prompt_token_ids, skip_special_tokens=False)
            for p, job in zip(items, jobs, strict=True)]


def _choice(tokenizer: Tokenizer, body: CompletionRequest, final: RequestOutput, seq: CompletionOutput,
            prompt_text: str) -> dict[str, Any]:
    """One choice of a full answer; `echo` puts the prompt (and its tokens' logprobs) first."""
    logprobs = None
    if seq.logprobs is not None:
        entries = echo.sampled_entries(seq.logprobs)
        if body.echo:
            assert final.prompt_logprobs is not None  # asked for with the echo (limits.requested_prompt_logprobs)
            entries = echo.echoed_entries(final.prompt_token_ids, final.prompt_logprobs) + entries
        logprobs = echo.logprobs_json(tokenizer, entries, 0)
    choice = {"index": 0, "text": prompt_text + seq.text if body.echo else seq.text, "logprobs": logprobs,
              "finish_reason": seq.finish_reason, "stop_reason": seq.stop_reason}
    if body.prompt_logprobs is not None:
        choice["prompt_logprobs"] = echo.prompt_logprobs_json(tokenizer, final.prompt_logprobs or [])
    return choice


def _echoed_delta(tokenizer: Tokenizer, delta: ChoiceDelta, output: RequestOutput,
                  prompt_text: str) -> tuple[str, dict | None]:
    """A choice's first streamed text and logprobs with its prompt's in front (`echo`)."""
    if delta.logprobs is None:
        return prompt_text + delta.text, None
    assert output.prompt_logprobs is not None  # asked for with the echo (limits.requested_prompt_logprobs)
    entries = echo.echoed_entries(output.prompt_token_ids, output.prompt_logprobs)
    return prompt_text + delta.text, echo.logprobs_json(tokenizer, entries + echo.sampled_entries(delta.logprobs), 0)


class CompletionHandler:
    def __init__(self, client: EngineClient, model_name: str, max_tokens_limit: int | None = None) -> None:
        self.client = client
        self.model_name = model_name
        self.max_tokens_limit = max_tokens_limit

    async def prepare(self, body: CompletionRequest) -> tuple[str, list[Job]]:
        request_id = new_request_id("cmpl")
        bind_request_id(request_id)  # NOTE: from here on, every log line (and a 500) names it
        # NOTE: tokenizing a long prompt takes long; on the event loop it would stall every stream.
        # Token ids need no tokenizer: no thread hop for them (it costs every request a wake-up).
        if _has_text(body.prompt):
            prompts = await asyncio.to_thread(_prompt_token_ids, body, self.client.tokenizer)
        else:
            prompts = _prompt_token_ids(body, self.client.tokenizer)
        max_tokens = MaxTokens(requested_max_tokens(body, self.max_tokens_limit), self.max_tokens_limit)
        return request_id, build_jobs(self.client, prompts, body, request_id, max_tokens)

    async def full(self, body: CompletionRequest, request_id: str, jobs: list[Job]) -> dict[str, Any]:
        finals: dict[int, RequestOutput] = {}
        async for index, output in run_jobs(self.client, jobs):
            if output.finished:
                finals[index] = output
        choices = []
        tokenizer = self.client.tokenizer
        prompt_texts = _prompt_texts(body, tokenizer, jobs) if body.echo else [""] * len(jobs)
        for index in sorted(finals):
            for seq in finals[index].outputs:
                choice = _choice(tokenizer, body, finals[index], seq, prompt_texts[index])
                choices.append(choice | {"index": index * body.n + seq.index})
        return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": self.model_name,
                "choices": choices, "usage": usage_of(finals).model_dump()}

    async def stream(self, body: CompletionRequest, request_id: str,
                     jobs: list[Job]) -> AsyncIterator[str]:
        """`echo`: a choice's first chunk starts with its prompt (and, with `logprobs`, the prompt
        tokens' entries), as vLLM streams it; so it waits for the prompt's logprobs. Each chunk
        comes as its JSON text (`ChunkJson`: one or more a token, the hot path)."""
        created = int(time.time())
        chunks = ChunkJson.of(request_id, "text_completion", created, self.model_name)
        tracker = DeltaTracker(body.n)
        finals: dict[int, RequestOutput] = {}
        text_offsets: dict[int, int] = {}
        prompt_texts = _prompt_texts(body, self.client.tokenizer, jobs) if body.echo else []
        async for index, output in run_jobs(self.client, jobs):
            if output.finished:
                finals[index] = output
            if jobs[index].params.prompt_logprobs is not None and output.prompt_logprobs is None \
                    and not output.finished:
                continue  # NOTE: the tracker sends what this output adds with the next one
            for delta in tracker.deltas(index, output):
                choice = self._stream_choice(delta, text_offsets, output, prompt_texts[index] if body.echo else None)
                yield chunks.chunk(f"[{choice}]")
        if body.include_usage:
            yield chunks.usage(usage_of(finals).model_dump())

    def _stream_choice(self, delta: ChoiceDelta, text_offsets: dict[int, int], output: RequestOutput,
                       prompt_text: str | None) -> str:
        """One streamed choice's JSON; `prompt_text` (echo) leads the choice's first."""
        offset = text_offsets.get(delta.index)
        if offset is None and prompt_text is not None:
            text, logprobs = _echoed_delta(self.client.tokenizer, delta, output, prompt_text)
        else:
            offset = offset or 0
            text, logprobs = delta.text, _logprobs_json(self.client.tokenizer, delta.logprobs, offset)
        text_offsets[delta.index] = (offset or 0) + len(text)
        # NOTE: the text json.dumps writes for {"index", "text", "logprobs", "finish_reason", "stop_reason"}
        return (f'{{"index": {delta.index}, "text": {to_json(text)}, "logprobs": {to_json(logprobs)}, '
                f'"finish_reason": {to_json(delta.finish_reason)}, "stop_reason": {to_json(delta.stop_reason)}}}')
