"""`--tool-call-parser hermes`: tool calls in a chat answer, Qwen3's (Hermes') format:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Read as the text streams, one choice at a time, like reasoning.py: text that could still be the
start of `<tool_call>` is held back; a call is complete at `</tool_call>` (or at the end of the
answer), and then parsed. A call that is no JSON object with a string `name` and an object
`arguments` is not a call: its text is returned as content, as it came. With `max_calls`
(parallel_tool_calls false) the calls after the first are dropped. Whitespace that leads into
a call, or ends an answer that has one, is dropped (so `content` is null for an answer of calls
only, as with OpenAI); other text stays content.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from pdserve.serving.reasoning import partial_tag_len

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as a string (what OpenAI's `function.arguments` is)


@dataclass(frozen=True, slots=True)
class ToolDelta:
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


def parse_call(text: str) -> ToolCall | None:
    """The call in the text between the tags, or None when it is none (malformed)."""
    try:
        call = json.loads(text)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", call["name"], json.dumps(arguments, ensure_ascii=False))


class ToolCallSplitter:
    """One choice's content, fed as it streams. `forced`: what the prompt already put at the start
    of the answer (tool_choice `required` or a named function), which the model continues.
    `max_calls`: calls after that many are dropped, text and all (parallel_tool_calls false)."""

    def __init__(self, forced: str = "", max_calls: int | None = None) -> None:
        self._held = ""
        self._in_call = False
        self._spaces = ""  # whitespace not sent yet: dropped if a call follows
        self.num_calls = 0
        self.max_calls = max_calls
        self._forced = bool(forced)
        if forced:
            self.feed(forced)

    def feed(self, text: str) -> ToolDelta:
        self._held += text
        content, calls = "", []
        while True:
            if not self._in_call:
                at = self._held.find(TOOL_CALL_START)
                if at == -1:
                    keep = partial_tag_len(self._held, TOOL_CALL_START)
                    content += self._content(self._held[:len(self._held) - keep])
                    self._held = self._held[len(self._held) - keep:]
                    break
                content += self._content(self._held[:at])
                self._held, self._in_call = self._held[at + len(TOOL_CALL_START):], True
                continue
            at = self._held.find(TOOL_CALL_END)
            if at == -1:
                break
            body, self._held, self._in_call = self._held[:at], self._held[at + len(TOOL_CALL_END):], False
            call = parse_call(body)
            if call is None:
                content += self._content(TOOL_CALL_START + body + TOOL_CALL_END)
            else:
                self._spaces = ""  # NOTE: whitespace that led into a call is no content
                calls += self._take(call)
        return ToolDelta(content, calls)

    def _take(self, call: ToolCall) -> list[ToolCall]:
        if self.max_calls is not None and self.num_calls >= self.max_calls:
            return []
        self.num_calls += 1
        return [call]

    def _content(self, text: str) -> str:
        """`text` less its trailing whitespace, held until it is known not to lead into a call."""
        text = self._spaces + text
        kept = text.rstrip()
        self._spaces = text[len(kept):]
        return kept

    def finish(self) -> ToolDelta:
        """The answer ended: an unterminated call is a call if it parses, else content; but in a
        forced answer (tool_choice required) a call cut short after whole ones is dropped: the
        answer is made of calls, and `finish_reason: "length"` says it was cut."""
        held, self._held = self._held, ""
        if self._in_call:
            self._in_call = False
            call = parse_call(held)
            if call is not None:
                self._spaces = ""
                return ToolDelta(calls=self._take(call))
            if self._forced and self.num_calls:  # NOTE: a forced answer's later call, cut short (max_tokens)
                self._spaces = ""
                return ToolDelta()
            held = TOOL_CALL_START + held
        text, self._spaces = self._spaces + held, ""
        return ToolDelta("" if self.num_calls and not text.strip() else text)
