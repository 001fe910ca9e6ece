"""OpenAI request/response schemas (plus vLLM's extra sampling fields), as pydantic models.

NOTE: requests are validated as their JSON Schema reads (`_Strict`): an integer is one (not a
boolean, not "3"), a boolean is `true`/`false`; the OpenAPI document is then what the server takes
(serving/openapi.py). An integer is taken where a float is asked for, as 3.0 where an integer is.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, Strict, StrictBool, model_validator

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.structured import StructuredOutput, check_structured


class _Strict(BaseModel):
    """A request's part: its booleans, numbers and integers are what JSON Schema calls so (`Bool`,
    `Float`, `Int`); text stays lax (strict text refuses what JSON escapes allow: a lone surrogate,
    which the handlers refuse themselves with a 400 that says so)."""


Bool = Annotated[bool, Strict()]  # NOTE: true/false, never 1 or "true"
Float = Annotated[float, Strict()]  # NOTE: a number (an integer too), never "0.5" or true


def _no_bool_or_str(value: Any) -> Any:
    if isinstance(value, (bool, str)):
        raise ValueError("expected an integer")  # NOTE: JSON's true is none (pydantic's lax mode took it as 1)
    return value


# NOTE: an integer as JSON Schema has it: 3 or 3.0, never true or "3". Bounds go inside the
# Annotated (an optional or listed one's Field(ge=...) would reach the JSON Schema as "ge", unread)
_AN_INTEGER = BeforeValidator(_no_bool_or_str)
Int = Annotated[int, _AN_INTEGER]
NonNegativeInt = Annotated[int, Field(ge=0), _AN_INTEGER]
PositiveInt = Annotated[int, Field(ge=1), _AN_INTEGER]
TokenId = NonNegativeInt


def _not_empty(text: str) -> str:
    if not text:
        raise ValueError("must not be empty")
    return text


# NOTE: checked after, not as Field(min_length=1): pydantic's constrained text refuses a lone
# surrogate outright, where the handlers answer one with a 400 that says what it is
NonEmptyStr = Annotated[str, AfterValidator(_not_empty), Field(json_schema_extra={"minLength": 1})]


def _when(condition: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """A JSON Schema rule between fields: when `condition` holds (properties present and matching), `then` must."""
    return {"if": {"required": sorted(condition), "properties": condition},
            "then": {"required": sorted(then), "properties": then}}


def _rules_between_fields(schema: dict[str, Any], model: type[BaseModel]) -> None:
    """The model's RULES (what its validators refuse across fields) into its JSON Schema's allOf."""
    rules = [rule for cls in reversed(model.__mro__) for rule in vars(cls).get("RULES", ())]
    if rules:
        schema["allOf"] = rules


_PRESENT = {"not": {"type": "null"}}


class StreamOptions(_Strict):
    include_usage: Bool = False


class JsonSchemaFormat(_Strict):
    """OpenAI's `response_format.json_schema`."""

    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | StrictBool = Field(alias="schema")
    strict: Bool | None = None  # NOTE: the output is constrained either way (as vLLM does)


class ResponseFormat(_Strict):
    model_config = ConfigDict(json_schema_extra=_rules_between_fields)
    RULES: ClassVar[tuple[dict[str, Any], ...]] = (  # what _schema_with_json_schema refuses
        {"if": {"properties": {"type": {"const": "json_schema"}}},
         "then": {"required": ["json_schema"], "properties": {"json_schema": _PRESENT}},
         "else": {"properties": {"json_schema": {"type": "null"}}}},
    )

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_json_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('response_format: "json_schema" goes with type "json_schema", and only with it')
        return self


class StructuredOutputsParams(_Strict):
    """vLLM's `structured_outputs`: one of these (what vLLM also has beyond them is refused)."""

    model_config = ConfigDict(extra="forbid")

    json_schema: dict[str, Any] | str | StrictBool | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[NonEmptyStr] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: Bool | None = None

    def constraints(self) -> list[tuple[str, StructuredOutput]]:
        """(parameter, constraint) for each field set."""
        found = _named_constraints("structured_outputs.", ("json", "regex", "choice", "grammar"),
                                   (self.json_schema, self.regex, self.choice, self.grammar))
        if self.json_object:
            found.append(("structured_outputs.json_object", StructuredOutput("json_object")))
        return found


def _named_constraints(prefix: str, names: tuple[str, ...],
                       values: tuple[Any, ...]) -> list[tuple[str, StructuredOutput]]:
    """(prefix + name, constraint) for each of a json / regex / choice / grammar family that is set."""
    found = []
    for name, value in zip(names, values, strict=True):
        if value is None:
            continue
        if name == "json":
            spec = _json_constraint(value)
        else:
            spec = StructuredOutput(name, json.dumps(value) if name == "choice" else value)
        found.append((prefix + name, spec))
    return found


def _json_constraint(schema: dict[str, Any] | str | StrictBool) -> StructuredOutput:
    return StructuredOutput("json", schema if isinstance(schema, str) else json.dumps(schema))


class _SamplingFields(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore", json_schema_extra=_rules_between_fields)
    RULES: ClassVar[tuple[dict[str, Any], ...]] = (
        _when({"stream_options": _PRESENT}, {"stream": {"const": True}}),
        {"if": {"required": ["stream"], "properties": {"stream": {"const": True}}},
         "then": {"properties": {"prompt_logprobs": {"type": "null"}}}},
    )

    model: str | None = None
    n: Int = Field(1, ge=1)  # NOTE: the caps of this and the other lists/counts: serving/limits.py
    temperature: Float | None = Field(None, ge=0.0, le=2.0)
    top_p: Float | None = Field(None, gt=0.0, le=1.0)
    stop: NonEmptyStr | list[NonEmptyStr] | None = None
    stream: Bool = False
    stream_options: StreamOptions | None = None
    seed: Annotated[int, Field(ge=0, lt=2**63), _AN_INTEGER] | None = None
    presence_penalty: Float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: Float = Field(0.0, ge=-2.0, le=2.0)
    user: str | None = None
    # vLLM extras
    top_k: Int = Field(0, ge=-1)
    min_p: Float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: Float = Field(1.0, gt=0.0, allow_inf_nan=False)  # the only float without an upper bound
    ignore_eos: Bool = False
    stop_token_ids: list[TokenId] | None = None
    min_tokens: Int = Field(0, ge=0)
    skip_special_tokens: Bool = True
    include_stop_str_in_output: Bool = False
    prompt_logprobs: Annotated[int, Field(ge=0, le=20), _AN_INTEGER] | None = None
    # structured outputs (engine/structured.py): OpenAI's, vLLM's, and vLLM's older names
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | str | StrictBool | None = None
    guided_regex: str | None = None
    guided_choice: list[NonEmptyStr] | None = Field(None, min_length=1)
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
        found += _named_constraints("guided_", ("json", "regex", "choice", "grammar"),
                                    (self.guided_json, self.guided_regex, self.guided_choice, self.guided_grammar))
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
    # NOTE: an empty prompt (text or ids) is refused: minLength/minItems say so
    prompt: (NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)]
             | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)])
    max_tokens: PositiveInt | None = 16
    logprobs: NonNegativeInt | None = None
    echo: Bool = False
    best_of: Int | None = None  # NOTE: equal to n (the schema cannot say that)
    suffix: Annotated[str, Field(max_length=0)] | None = None  # NOTE: not supported: only "" or null

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of must equal n (beam search is not supported)")
        return self


class CalledFunction(_Strict):
    name: str
    arguments: str | dict[str, Any]


class MessageToolCall(_Strict):
    """A call an assistant message made (rendered back into the prompt)."""

    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class TextPart(_Strict):
    """The one kind of content part the chat template renders."""

    model_config = ConfigDict(extra="allow")

    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    # NOTE: a message has content, but for an assistant's that only calls tools (OpenAI sends null
    # there); the schema says so too
    model_config = ConfigDict(extra="allow", json_schema_extra={
        "if": {"not": {"properties": {"role": {"const": "assistant"}, "tool_calls": {"type": "array", "minItems": 1}},
                       "required": ["role", "tool_calls"]}},
        "then": {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}}})

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role!r} message needs its content (only an assistant's that calls tools "
                             "may have none)")
        return self


class ChatTemplateKwargs(_Strict):
    model_config = ConfigDict(extra="allow")

    enable_thinking: Bool = True


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: Bool | None = None


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    RULES: ClassVar[tuple[dict[str, Any], ...]] = (
        _when({"top_logprobs": {"type": "integer", "minimum": 1}}, {"logprobs": {"const": True}}),
        # NOTE: a named function must be one of `tools` too (the schema cannot say that)
        _when({"tool_choice": {"not": {"enum": [None, "none"]}}}, {"tools": {"type": "array", "minItems": 1}}),
    )
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: Bool = False
    top_logprobs: NonNegativeInt | None = None
    add_generation_prompt: Bool = True
    chat_template_kwargs: ChatTemplateKwargs | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: Bool = True  # false: at most one call (chat_output.py)

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
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field)
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
