"""POST /v1/chat/completions."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any

from pdserve.engine.logprobs import TokenLogprobs
from pdserve.engine.output import RequestOutput
from pdserve.logs import bind_request_id
from pdserve.serving.chat_output import ChatReading, ChoiceReader, delta_jsons, message_json, plan_reading
from pdserve.serving.completions import MaxTokens, build_jobs
from pdserve.serving.config import ApiConfig
from pdserve.serving.echo import prompt_logprobs_json
from pdserve.serving.engine_client import EngineClient
from pdserve.serving.errors import OpenAIError
from pdserve.serving.generation import DeltaTracker, Job, encode_text, new_request_id, run_jobs, usage_of
from pdserve.serving.protocol import ChatCompletionRequest
from pdserve.serving.sse import ChunkJson, to_json
from pdserve.tokenizer import Tokenizer


def _token_json(tokenizer: Tokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    raw = tokenizer.token_bytes(token_id) or tokenizer.decode([token_id], skip_special_tokens=False).encode()
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}


def _logprobs_json(tokenizer: Tokenizer, entries: list[TokenLogprobs] | None) -> dict | None:
    if entries is None:
        return None
    return {"content": [_token_json(tokenizer, e.token_id, e.logprob)
                        | {"top_logprobs": [_token_json(tokenizer, t, lp) for t, lp in e.top]} for e in entries]}


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    # NOTE: OpenAI's `developer` role replaces `system` for newer models; chat templates only know `system`.
    return message | {"role": "system"} if message["role"] == "developer" else message


def chat_prompt_token_ids(tokenizer: Tokenizer, body: ChatCompletionRequest, reading: ChatReading) -> list[int]:
    """The rendered conversation's tokens (with the tools and the forced start `reading` asks for);
    400 for messages the template refuses. Slow for long messages: call it off the event loop."""
    messages = [_template_message(m.model_dump(exclude_none=True)) for m in body.messages]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt,
                                             enable_thinking=body.enable_thinking, tools=reading.template_tools)
    except ValueError as exc:
        raise OpenAIError(f"messages: {exc}", HTTPStatus.BAD_REQUEST, "messages") from exc
    return encode_text(tokenizer, text + reading.forced, "messages")


class ChatHandler:
    def __init__(self, client: EngineClient, model_name: str, api: ApiConfig | None = None) -> None:
        self.client = client
        self.model_name = model_name
        self.api = api or ApiConfig()

    async def prepare(self, body: ChatCompletionRequest) -> tuple[str, list[Job]]:
        request_id = new_request_id("chatcmpl")
        bind_request_id(request_id)  # NOTE: from here on, every log line (and a 500) names it
        reading = plan_reading(body, self.api)
        # NOTE: templating and tokenizing long messages take long: off the event loop
        token_ids = await asyncio.to_thread(chat_prompt_token_ids, self.client.tokenizer, body, reading)
        max_tokens = MaxTokens(body.requested_max_tokens, self.api.max_tokens_limit, prompt_param="messages")
        return request_id, build_jobs(self.client, [token_ids], body, request_id, max_tokens, reading.structured)

    async def full(self, body: ChatCompletionRequest, request_id: str, jobs: list[Job]) -> dict[str, Any]:
        final: RequestOutput | None = None
        async for _, output in run_jobs(self.client, jobs):
            final = output
        assert final is not None and final.finished
        reading = plan_reading(body, self.api)
        choices = []
        for seq in final.outputs:
            reader = ChoiceReader(reading)
            choices.append({
                "index": seq.index,
                "message": message_json(reader, seq.text),
                "logprobs": _logprobs_json(self.client.tokenizer, seq.logprobs),
                "finish_reason": reader.finish_reason(seq.finish_reason),
                "stop_reason": seq.stop_reason,
            })
        answer = {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": self.model_name,
                  "choices": choices, "usage": usage_of({0: final}).model_dump()}
        if body.prompt_logprobs is not None:  # NOTE: vLLM's extension: one list for the request, not per choice
            answer["prompt_logprobs"] = prompt_logprobs_json(self.client.tokenizer, final.prompt_logprobs or [])
        return answer

    async def stream(self, body: ChatCompletionRequest, request_id: str,
                     jobs: list[Job]) -> AsyncIterator[str]:
        created = int(time.time())
        chunks = ChunkJson.of(request_id, "chat.completion.chunk", created, self.model_name)

        def chunk(choices: list[dict[str, Any]]) -> str:
            return chunks.chunk(to_json(choices))

        tracker = DeltaTracker(body.n)
        reading = plan_reading(body, self.api)
        readers = [ChoiceReader(reading) for _ in range(body.n)]
        final: RequestOutput | None = None
        async for _, output in run_jobs(self.client, jobs):
            if final is None:  # NOTE: with the first output, so errors before it keep their status
                # NOTE: content null when calls may come (what OpenAI sends; accumulated, "" would stay)
                opening = {"role": "assistant", "content": None if reading.tools else ""}
                yield chunk([{"index": i, "delta": opening, "logprobs": None, "finish_reason": None}
                             for i in range(body.n)])
            final = output
            for delta in tracker.deltas(0, output):
                reader = readers[delta.index]
                read = reader.feed(delta.text)
                if delta.finish_reason is not None:
                    read = read.add(reader.finish())
                parts = delta_jsons(reader, read) or [{}]
                for number, part in enumerate(parts):
                    last = number == len(parts) - 1
                    yield chunk([{"index": delta.index, "delta": part,
                                  "logprobs": _logprobs_json(self.client.tokenizer, delta.logprobs)
                                  if number == 0 else None,
                                  "finish_reason": reader.finish_reason(delta.finish_reason) if last else None,
                                  "stop_reason": delta.stop_reason if last else None}])
        if body.include_usage and final is not None:
            yield chunks.usage(usage_of({0: final}).model_dump())
