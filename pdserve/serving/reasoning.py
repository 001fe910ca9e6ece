"""`--reasoning-parser qwen3`: a chat answer's `<think>…</think>` part becomes `reasoning_content`.

Qwen3 (thinking on) answers `<think>\\n…\\n</think>\\n\\nthe answer`. The split is made on text as it
streams, one choice at a time: a tag may arrive across chunks (with Qwen3's vocabulary `<think>`
and `</think>` are single tokens, 151667/151668, so they arrive whole; any other tokenizer's may
not), so text that could still be the start of a tag is held back until it cannot. An answer that
does not start with `<think>` is all content; one cut short inside its thinking is all reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_START = "<think>"
THINK_END = "</think>"


def partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (to hold back)."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningSplitter:
    """One choice's text, fed as it streams: `feed` returns what can be told apart so far, `finish`
    the rest. States: before the answer shows whether it thinks, thinking, answering."""

    def __init__(self) -> None:
        self._state = "start"
        self._held = ""

    def feed(self, text: str) -> ReasoningDelta:
        self._held += text
        if self._state == "start":
            if len(self._held) < len(THINK_START) and THINK_START.startswith(self._held):
                return ReasoningDelta()
            if not self._held.startswith(THINK_START):
                self._state = "answering"
            else:
                self._held = self._held[len(THINK_START):]
                self._state = "thinking"
        if self._state == "answering":
            content, self._held = self._held, ""
            return ReasoningDelta(content=content)
        return self._thinking()

    def _thinking(self) -> ReasoningDelta:
        at = self._held.find(THINK_END)
        if at != -1:
            reasoning, content = self._held[:at], self._held[at + len(THINK_END):]
            self._held, self._state = "", "answering"
            return ReasoningDelta(reasoning, content)
        keep = partial_tag_len(self._held, THINK_END)
        reasoning = self._held[:len(self._held) - keep]
        self._held = self._held[len(self._held) - keep:]
        return ReasoningDelta(reasoning=reasoning)

    def finish(self) -> ReasoningDelta:
        """The answer ended: what is still held back was no tag after all."""
        held, self._held = self._held, ""
        return ReasoningDelta(reasoning=held) if self._state == "thinking" else ReasoningDelta(content=held)
