"""How a chat request's answers are read (reasoning.py, tool_calls.py) and what its prompt gets
for it: the tools the chat template renders and, for tool_choice `required` or a named function,
the start of the call the prompt puts in the model's mouth, and the grammar the rest of the answer
is constrained to (engine/structured.py): calls whose arguments match their tool's parameters.

    tool_choice     needs                                   prompt ends with
    none / absent   -                                       -   (tools not rendered, no parsing)
    auto            --enable-auto-tool-choice, parser       -
    required        --tool-call-parser                      <tool_call>\\n
    {function: f}   --tool-call-parser, f among the tools   <tool_call>\\n{"name": "f", "arguments":

`required` is one call of any of the tools or, with `parallel_tool_calls` (OpenAI's default: true),
one or more, each in its own `<tool_call>` block as Qwen3's chat template writes them; a named
function is one call of it. `parallel_tool_calls: false` with `auto` keeps the answer's first call
(the model is free there: later calls are dropped, their text too).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from pdserve.engine.structured import StructuredOutput
from pdserve.serving.config import ApiConfig
from pdserve.serving.errors import OpenAIError
from pdserve.serving.protocol import ChatCompletionRequest, NamedToolChoice
from pdserve.serving.reasoning import ReasoningDelta, ReasoningSplitter
from pdserve.serving.tool_calls import TOOL_CALL_END, TOOL_CALL_START, ToolCall, ToolCallSplitter, ToolDelta


@dataclass(frozen=True, slots=True)
class ChatReading:
    """One request's: what its answers are read for, and what its prompt gets."""

    reasoning: bool = False
    tools: bool = False
    named: bool = False  # a named function: its finish_reason stays "stop", as OpenAI's
    forced: str = ""  # appended to the rendered prompt: the answer's start, read with it
    max_calls: int | None = None  # 1: parallel_tool_calls false (calls after the first are dropped)
    template_tools: list[dict[str, Any]] | None = None
    structured: StructuredOutput | None = None  # what the answer after `forced` is constrained to


# NOTE: compact JSON (as StructuredOutput "json"): with any whitespace allowed a model may loop in it
_COMPACT = {"x-guidance": {"whitespace_flexible": False}}


def _arguments_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    return parameters if parameters is not None else {"type": "object"}


def _call_grammar(body: ChatCompletionRequest, name: str | None) -> StructuredOutput:
    """The rest of a forced call, as a Lark grammar (llguidance's `%json` embeds a schema): for
    `required` (the prompt ends with `<tool_call>`), a call of any of the tools, then (with
    parallel_tool_calls) any number of further `<tool_call>` blocks; for a named one (it ends with
    its name and `"arguments": `), its arguments and the call's end."""
    assert body.tools is not None
    end, next_call = json.dumps("\n" + TOOL_CALL_END), json.dumps("\n" + TOOL_CALL_START + "\n")
    if name is not None:
        tool = next(t for t in body.tools if t.function.name == name)
        schema = _arguments_schema(tool.function.parameters) | _COMPACT
        return StructuredOutput("lark", f'start: args "}}" {end}\nargs: %json {json.dumps(schema)}')
    calls = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                               "arguments": _arguments_schema(t.function.parameters)},
              "required": ["name", "arguments"], "additionalProperties": False} for t in body.tools]
    schema = {"anyOf": calls} | _COMPACT
    more = f" ({next_call} call {end})*" if body.parallel_tool_calls else ""
    return StructuredOutput("lark", f"start: call {end}{more}\ncall: %json {json.dumps(schema)}")


def _refuse(message: str) -> OpenAIError:
    return OpenAIError(message, HTTPStatus.BAD_REQUEST, "tool_choice")


def plan_reading(body: ChatCompletionRequest, api: ApiConfig) -> ChatReading:
    """400 for tools this server cannot serve as asked (see the table above)."""
    reasoning = api.reasoning_parser is not None and body.enable_thinking
    choice = body.tool_choice
    if not body.tools or choice == "none":
        if choice not in (None, "none"):
            raise _refuse(f"tool_choice {choice if isinstance(choice, str) else 'naming a function'} needs "
                          "`tools`, and the request has no `tools`")
        return ChatReading(reasoning=reasoning)
    if api.tool_call_parser is None:
        raise _refuse("tools need a server started with --tool-call-parser hermes")
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools]
    if choice in (None, "auto"):
        if not api.enable_auto_tool_choice:
            raise _refuse('"auto" tool choice needs a server started with --enable-auto-tool-choice')
        return ChatReading(reasoning=reasoning, tools=True, template_tools=tools,
                           max_calls=None if body.parallel_tool_calls else 1)
    if body.structured_constraints():
        raise _refuse(f"tool_choice {choice if isinstance(choice, str) else 'naming a function'} constrains the "
                      "answer: it goes with no other structured-output constraint (response_format, "
                      "structured_outputs, guided_*)")
    if choice == "required":
        return ChatReading(tools=True, forced=TOOL_CALL_START + "\n", template_tools=tools,
                           structured=_call_grammar(body, None))
    assert isinstance(choice, NamedToolChoice)
    name = choice.function.name
    if name not in {tool.function.name for tool in body.tools}:
        raise _refuse(f"tool_choice names the function {name!r}, which is not among the request's tools")
    return ChatReading(tools=True, named=True, template_tools=tools,
                       forced=f'{TOOL_CALL_START}\n{{"name": {json.dumps(name)}, "arguments": ',
                       structured=_call_grammar(body, name))


@dataclass(slots=True)
class MessageDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def add(self, other: MessageDelta) -> MessageDelta:
        return MessageDelta(self.reasoning + other.reasoning, self.content + other.content, self.calls + other.calls)


class ChoiceReader:
    """One choice's text as it streams, split into reasoning, content and tool calls."""

    def __init__(self, reading: ChatReading) -> None:
        self.reading = reading
        self._reasoning = ReasoningSplitter() if reading.reasoning else None
        self._tools = ToolCallSplitter(reading.forced, reading.max_calls) if reading.tools else None

    @property
    def num_calls(self) -> int:
        return self._tools.num_calls if self._tools is not None else 0

    def feed(self, text: str) -> MessageDelta:
        split = self._reasoning.feed(text) if self._reasoning is not None else ReasoningDelta(content=text)
        return self._read_content(split)

    def finish(self) -> MessageDelta:
        split = self._reasoning.finish() if self._reasoning is not None else ReasoningDelta()
        delta = self._read_content(split)
        if self._tools is None:
            return delta
        rest = self._tools.finish()
        return delta.add(MessageDelta(content=rest.content, calls=rest.calls))

    def _read_content(self, split: ReasoningDelta) -> MessageDelta:
        tools = self._tools.feed(split.content) if self._tools is not None else ToolDelta(split.content)
        return MessageDelta(split.reasoning, tools.content, tools.calls)

    def finish_reason(self, reason: str | None) -> str | None:
        """An answer that ends in calls it was free to make finishes with "tool_calls"."""
        return "tool_calls" if reason == "stop" and self.num_calls and not self.reading.named else reason


def call_json(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def message_json(reader: ChoiceReader, text: str) -> dict[str, Any]:
    """The whole answer's `message` (non-streaming). NOTE: as vLLM's, `reasoning_content` is on every
    one (null without reasoning: no --reasoning-parser, thinking off, or none written); `tool_calls`,
    as OpenAI's, only on an answer that made calls (never `[]`). A streamed delta carries either
    only when it has some (delta_jsons)."""
    parsed = reader.feed(text).add(reader.finish())
    message: dict[str, Any] = {"role": "assistant",
                               "content": parsed.content if parsed.content or not parsed.calls else None,
                               "reasoning_content": parsed.reasoning or None}
    if parsed.calls:
        message["tool_calls"] = [call_json(call) for call in parsed.calls]
    return message


def delta_jsons(reader: ChoiceReader, delta: MessageDelta) -> list[dict[str, Any]]:
    """A streamed delta as the `delta` objects of one or more chunks: text first, then each call
    in two fragments (its id and name, then its arguments), as OpenAI streams them."""
    deltas: list[dict[str, Any]] = []
    text = {key: value for key, value in (("reasoning_content", delta.reasoning), ("content", delta.content))
            if value}
    if text:
        deltas.append(text)
    first_index = reader.num_calls - len(delta.calls)
    for index, call in enumerate(delta.calls, start=first_index):
        deltas.append({"tool_calls": [{"index": index, "id": call.id, "type": "function",
                                       "function": {"name": call.name, "arguments": ""}}]})
        deltas.append({"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]})
    return deltas
