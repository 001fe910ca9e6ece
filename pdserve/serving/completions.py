"""POST /v1/completions."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any

from pdserve.engine.output import RequestOutput
from pdserve.engine.sampler import TokenLogprobs
from pdserve.logs import bind_request_id
from pdserve.serving import generation
from pdserve.serving.engine_client import EngineClient
from pdserve.serving.errors import OpenAIError
from pdserve.serving.generation import DeltaTracker, Job, new_request_id, run_jobs, usage_of
from pdserve.serving.limits import requested_logprobs
from pdserve.serving.protocol import CompletionRequest
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


def build_jobs(client: EngineClient, prompts: list[list[int]], requested_max_tokens: int | None,
               body: CompletionRequest | Any, request_id: str, max_tokens_limit: int | None) -> list[Job]:
    """Validate every prompt before anything is enqueued: bad input never costs compute."""
    jobs = []
    logprobs = requested_logprobs(body)
    for index, token_ids in enumerate(prompts):
        max_tokens = generation.resolve_max_tokens(len(token_ids), requested_max_tokens, client.max_model_len,
                                                   max_tokens_limit)
        try:
            params = body.to_sampling_params(max_tokens, logprobs)
            client.validate_request(token_ids, params)
        except ValueError as exc:
            raise OpenAIError(str(exc), HTTPStatus.BAD_REQUEST) from exc
        jobs.append(Job(f"{request_id}-{index}", token_ids, params))
    return jobs


def _logprobs_json(tokenizer: Tokenizer, entries: list[TokenLogprobs] | None, offset: int) -> dict | None:
    if entries is None:
        return None
    tokens = [tokenizer.decode([e.token_id], skip_special_tokens=False) for e in entries]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{tokenizer.decode([t], skip_special_tokens=False): lp for t, lp in e.top} for e in entries],
        "text_offset": offsets,
    }


class CompletionHandler:
    def __init__(self, client: EngineClient, model_name: str, max_tokens_limit: int | None = None) -> None:
        self.client = client
        self.model_name = model_name
        self.max_tokens_limit = max_tokens_limit

    async def prepare(self, body: CompletionRequest) -> tuple[str, list[Job]]:
        request_id = new_request_id("cmpl")
        bind_request_id(request_id)  # NOTE: from here on, every log line (and a 500) names it
        # NOTE: tokenizing a long prompt takes long; on the event loop it would stall every stream
        prompts = await asyncio.to_thread(_prompt_token_ids, body, self.client.tokenizer)
        return request_id, build_jobs(self.client, prompts, body.max_tokens, body, request_id, self.max_tokens_limit)

    async def full(self, body: CompletionRequest, request_id: str, jobs: list[Job]) -> dict[str, Any]:
        finals: dict[int, RequestOutput] = {}
        async for index, output in run_jobs(self.client, jobs):
            if output.finished:
                finals[index] = output
        choices = []
        for index in sorted(finals):
            for seq in finals[index].outputs:
                choices.append({
                    "index": index * body.n + seq.index,
                    "text": seq.text,
                    "logprobs": _logprobs_json(self.client.tokenizer, seq.logprobs, 0),
                    "finish_reason": seq.finish_reason,
                    "stop_reason": seq.stop_reason,
                })
        return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": self.model_name,
                "choices": choices, "usage": usage_of(finals).model_dump()}

    async def stream(self, body: CompletionRequest, request_id: str, jobs: list[Job]) -> AsyncIterator[dict]:
        created = int(time.time())
        tracker = DeltaTracker(body.n)
        finals: dict[int, RequestOutput] = {}
        text_offsets: dict[int, int] = {}
        async for index, output in run_jobs(self.client, jobs):
            if output.finished:
                finals[index] = output
            for delta in tracker.deltas(index, output):
                offset = text_offsets.get(delta.index, 0)
                text_offsets[delta.index] = offset + len(delta.text)
                yield {"id": request_id, "object": "text_completion", "created": created, "model": self.model_name,
                       "choices": [{"index": delta.index, "text": delta.text,
                                    "logprobs": _logprobs_json(self.client.tokenizer, delta.logprobs, offset),
                                    "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason}]}
        if body.include_usage:
            yield {"id": request_id, "object": "text_completion", "created": created, "model": self.model_name,
                   "choices": [], "usage": usage_of(finals).model_dump()}
