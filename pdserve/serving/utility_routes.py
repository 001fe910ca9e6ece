"""The routes vLLM users script against besides /v1/*, in vLLM's shapes (colocated and router):

    POST /tokenize     {"prompt": str} or {"messages": [...], ...}
                       -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize   {"tokens": [int]} -> {"prompt": str}
    GET  /version      {"version": pdserve's}
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field, model_validator

import pdserve
from pdserve.serving.chat import chat_prompt_token_ids
from pdserve.serving.chat_output import plan_reading
from pdserve.serving.config import ApiConfig
from pdserve.serving.engine_client import EngineClient
from pdserve.serving.errors import OpenAIError, documented_errors
from pdserve.serving.generation import encode_text
from pdserve.serving.protocol import Bool, ChatCompletionRequest, ChatMessage, ChatTemplateKwargs, ChatTool, TokenId


class TokenizeRequest(BaseModel):
    # NOTE: typed as the other requests (serving/protocol.py); exactly one of prompt and messages
    model_config = ConfigDict(extra="ignore", json_schema_extra={
        "oneOf": [{"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                  {"required": ["messages"], "properties": {"messages": {"type": "array"}}}]})

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: Bool = True
    chat_template_kwargs: ChatTemplateKwargs | None = None
    tools: list[ChatTool] | None = None
    return_token_strs: Bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either `prompt` or `messages`")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[TokenId]


def add_utility_routes(app: FastAPI, client: EngineClient, check_model: Callable[[str | None], object]) -> None:
    tokenizer = client.tokenizer

    def token_ids(body: TokenizeRequest) -> list[int]:
        if body.prompt is not None:
            return encode_text(tokenizer, body.prompt, "prompt")
        chat = ChatCompletionRequest.model_validate(body.model_dump(include={
            "messages", "add_generation_prompt", "chat_template_kwargs", "tools"}))
        # NOTE: the prompt as a chat request with these tools would get it (tool_choice auto)
        reading = plan_reading(chat, ApiConfig(tool_call_parser="hermes", enable_auto_tool_choice=True))
        return chat_prompt_token_ids(tokenizer, chat, reading)

    refusals = documented_errors(HTTPStatus.BAD_REQUEST, HTTPStatus.NOT_FOUND)

    @app.post("/tokenize", responses=refusals)
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        ids = await asyncio.to_thread(token_ids, body)
        strs = [tokenizer.decode([t], skip_special_tokens=False) for t in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": client.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize", responses=refusals)
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        bad = next((t for t in body.tokens if not 0 <= t < tokenizer.vocab_size), None)
        if bad is not None:
            raise OpenAIError(f"token id {bad} is outside the vocabulary [0, {tokenizer.vocab_size})",
                              HTTPStatus.BAD_REQUEST, "tokens")
        return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": pdserve.__version__}
