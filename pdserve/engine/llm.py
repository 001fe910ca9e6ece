"""The offline API, written the way vLLM users write it:

    from pdserve import LLM, SamplingParams
    llm = LLM(model="/path/to/Qwen3-0.6B", dtype="float32")
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypedDict

from pdserve.config import EngineArgs
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.lora_manager import LoRARequest
from pdserve.engine.output import RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.tokenizer import Tokenizer

if TYPE_CHECKING:
    from typing_extensions import TypeIs  # typing's own from Python 3.13


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]


Prompt = str | TokensPrompt
Message = dict[str, Any]


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine = LLMEngine.from_engine_args(EngineArgs(model=model, **engine_args))
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Run all prompts to completion with continuous batching; outputs in prompt order.
        `lora_request`: one adapter for all prompts or one per prompt (None: the base model)."""
        prompt_list: list[Prompt] = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params_list = self._with_loras(_broadcast(sampling_params, len(prompt_list)), lora_request)
        request_ids: list[str] = []
        finished: dict[str, RequestOutput] = {}
        try:
            # NOTE: adding is inside the try: if a later prompt is rejected, the ones already added
            # must not stay in the engine.
            for prompt, params in zip(prompt_list, params_list, strict=True):
                request_id = str(next(self._ids))
                self.engine.add_request(request_id, _prompt_input(prompt), params)
                request_ids.append(request_id)
            while len(finished) < len(request_ids):
                for output in self.engine.step(final_only=True):
                    finished[output.request_id] = output
                failures = self.engine.take_failures()
                if failures:  # that request ended with an error; the others are aborted below
                    raise RuntimeError(failures[0].error)
        finally:
            for request_id in request_ids:  # on error or Ctrl-C nothing stays in the engine
                if request_id not in finished:
                    self.engine.abort_request(request_id)
        return [finished[request_id] for request_id in request_ids]

    def _with_loras(self, params_list: list[SamplingParams],
                    lora_request: LoRARequest | Sequence[LoRARequest | None] | None) -> list[SamplingParams]:
        """Each prompt's params naming its adapter; an adapter not loaded yet is loaded from its path."""
        if lora_request is None:
            return params_list
        loras = [lora_request] * len(params_list) if isinstance(lora_request, LoRARequest) else list(lora_request)
        if len(loras) != len(params_list):
            raise ValueError(f"got {len(loras)} LoRA requests for {len(params_list)} prompts")
        known = {info.name for info in self.engine.list_loras()}
        for lora in loras:
            if lora is not None and lora.lora_name not in known and lora.lora_path:
                self.engine.add_lora(lora.lora_name, lora.lora_path)
                known.add(lora.lora_name)
        return [params if lora is None else dataclasses.replace(params, lora_name=lora.lora_name)
                for params, lora in zip(params_list, loras, strict=True)]

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             add_generation_prompt: bool = True, enable_thinking: bool = True) -> list[RequestOutput]:
        conversations = [messages] if _is_one_conversation(messages) else messages
        tokenizer = self.get_tokenizer()
        prompts: list[Prompt] = [
            tokenizer.apply_chat_template(list(conversation), add_generation_prompt=add_generation_prompt,
                                          enable_thinking=enable_thinking)
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params)


def _is_one_conversation(messages: list[Message] | list[list[Message]]) -> TypeIs[list[Message]]:
    return bool(messages) and isinstance(messages[0], dict)


def _prompt_input(prompt: Prompt) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if "prompt_token_ids" not in prompt:
        raise ValueError("a prompt is a string or {'prompt_token_ids': [...]}")
    return list(prompt["prompt_token_ids"])


def _broadcast(params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling params for {count} prompts")
    return list(params)
