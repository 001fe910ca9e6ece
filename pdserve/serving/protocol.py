"""OpenAI request/response schemas (plus vLLM's extra sampling fields), as pydantic models."""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.structured import StructuredOutput, check_structured


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`."""

    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | StrictBool = Field(alias="schema")
    strict: bool | None = None  # NOTE: the output is constrained either way (as vLLM does)


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_json_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('response_format: "json_schema" goes with type "json_schema", and only with it')
        return self


class StructuredOutputsParams(BaseModel):
    """vLLM's `structured_outputs`: one of these (what vLLM also has beyond them is refused)."""

    model_config = ConfigDict(extra="forbid")

    json_schema: dict[str, Any] | str | StrictBool | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None

    def constraints(self) -> list[tuple[str, StructuredOutput]]:
        """(parameter, constraint) for each field set."""
        found = []
        if self.json_schema is not None:
            found.append(("structured_outputs.json", _json_constraint(self.json_schema)))
        if self.regex is not None:
            found.append(("structured_outputs.regex", StructuredOutput("regex", self.regex)))
        if self.choice is not None:
            found.append(("structured_outputs.choice", StructuredOutput("choice", json.dumps(self.choice))))
        if self.grammar is not None:
            found.append(("structured_outputs.grammar", StructuredOutput("grammar", self.grammar)))
        if self.json_object:
            found.append(("structured_outputs.json_object", StructuredOutput("json_object")))
        return found


def _json_constraint(schema: dict[str, Any] | str | StrictBool) -> StructuredOutput:
    return StructuredOutput("json", schema if isinstance(schema, str) else json.dumps(schema))


class _SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = Field(1, ge=1)  # NOTE: the caps of this and the other lists/counts: serving/limits.py
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    user: str | None = None
    # vLLM extras
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, allow_inf_nan=False)  # the only float without an upper bound
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    # structured outputs (engine/structured.py): OpenAI's, vLLM's, and vLLM's older names
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | str | StrictBool | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None

    def structured_constraints(self) -> list[tuple[str, StructuredOutput]]:
        """(parameter, constraint) for each structured-output parameter the request sets."""
        found = []
        if self.response_format is not None and self.response_format.type != "text":
            schema = self.response_format.json_schema
            found.append(("response_format", StructuredOutput("json_object") if schema is None
                          else _json_constraint(schema.json_schema)))
        if self.structured_outputs is not None:
            found += self.structured_outputs.constraints()
        if self.guided_json is not None:
            found.append(("guided_json", _json_constraint(self.guided_json)))
        if self.guided_regex is not None:
            found.append(("guided_regex", StructuredOutput("regex", self.guided_regex)))
        if self.guided_choice is not None:
            found.append(("guided_choice", StructuredOutput("choice", json.dumps(self.guided_choice))))
        if self.guided_grammar is not None:
            found.append(("guided_grammar", StructuredOutput("grammar", self.guided_grammar)))
        return found

    @model_validator(mode="after")
    def _one_constraint(self) -> _SamplingFields:
        found = self.structured_constraints()
        if len(found) > 1:
            raise ValueError(f"only one structured-output constraint per request; got {', '.join(p for p, _ in found)}")
        return self

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.stream and self.prompt_logprobs is not None:  # NOTE: as vLLM (echo with logprobs streams)
            raise ValueError("prompt_logprobs are not available when stream is true")
        return self

    def to_sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None,
                           structured: StructuredOutput | None = None) -> SamplingParams:
        """`structured`: the constraint the server adds (chat's tool_choice), else the request's own."""
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        found = self.structured_constraints()
        param, spec = "tools", structured
        if spec is None and found:
            param, spec = found[0]
        if spec is not None:
            try:
                check_structured(spec)
            except ValueError as exc:
                raise ValueError(f"{param}: {exc}") from exc
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured=spec,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of must equal n (beam search is not supported)")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty")
        return self


class CalledFunction(BaseModel):
    name: str
    arguments: str | dict[str, Any]


class MessageToolCall(BaseModel):
    """A call an assistant message made (rendered back into the prompt)."""

    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None


class ChatTemplateKwargs(BaseModel):
    model_config = ConfigDict(extra="allow")

    enable_thinking: bool = True


class FunctionDefinition(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    add_generation_prompt: bool = True
    chat_template_kwargs: ChatTemplateKwargs | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True  # NOTE: accepted; the model decides how many calls it makes

    @property
    def enable_thinking(self) -> bool:
        return self.chat_template_kwargs.enable_thinking if self.chat_template_kwargs else True

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pdserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
