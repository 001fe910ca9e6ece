"""serving/reasoning.py, tool_calls.py and chat_output.py on text alone: every way of cutting an
answer into streamed chunks reads the same as the whole answer, tags split across chunks
included; malformed calls come back as content; tools a server cannot serve are a 400."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from pdserve.engine.structured import GrammarCache
from pdserve.serving.chat_output import ChatReading, ChoiceReader, MessageDelta, message_json, plan_reading
from pdserve.serving.config import ApiConfig
from pdserve.serving.errors import OpenAIError
from pdserve.serving.limits import check_limits, requested_prompt_logprobs
from pdserve.serving.protocol import ChatCompletionRequest
from pdserve.tokenizer.tokenizer import load_tokenizer

THINKING = "<think>\nStep one.\nStep two.\n</think>\n\nThe answer."
CALLS = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def cuts(text: str, sizes: tuple[int, ...]) -> list[list[str]]:
    """`text` cut into chunks of each size (every tag gets split somewhere by one of them)."""
    return [[text[i:i + size] for i in range(0, len(text), size)] for size in sizes]


def read_streamed(reading: ChatReading, chunks: list[str]) -> MessageDelta:
    reader = ChoiceReader(reading)
    total = MessageDelta()
    for chunk in chunks:
        total = total.add(reader.feed(chunk))
    return total.add(reader.finish())


@pytest.mark.parametrize("chunks", cuts(THINKING, (1, 2, 3, 5, 7, len(THINKING))))
def test_reasoning_splits_the_same_however_the_tags_are_cut(chunks: list[str]) -> None:
    read = read_streamed(ChatReading(reasoning=True), chunks)
    assert (read.reasoning, read.content, read.calls) == ("\nStep one.\nStep two.\n", "\n\nThe answer.", [])


def test_reasoning_edge_cases() -> None:
    reading = ChatReading(reasoning=True)
    assert read_streamed(reading, ["<thi", "s is not a tag"]).content == "<this is not a tag"
    assert read_streamed(reading, ["Plain ", "answer"]) == MessageDelta(content="Plain answer")
    cut_short = read_streamed(reading, ["<think>", "still thin", "king </thi"])
    assert (cut_short.reasoning, cut_short.content) == ("still thinking </thi", "")
    assert read_streamed(ChatReading(), [THINKING]).content == THINKING  # no parser: today's behaviour


@pytest.mark.parametrize("chunks", cuts(CALLS, (1, 4, 9, len(CALLS))))
def test_tool_calls_parse_the_same_however_the_stream_is_cut(chunks: list[str]) -> None:
    read = read_streamed(ChatReading(tools=True), chunks)
    assert read.content == "Let me look."  # the newline led into the call
    assert [(c.name, json.loads(c.arguments)) for c in read.calls] == [("get_weather", {"city": "Paris"}),
                                                                      ("get_time", {})]
    assert all(c.id.startswith("call_") for c in read.calls) and read.calls[0].id != read.calls[1].id


def test_malformed_calls_are_content() -> None:
    reading = ChatReading(tools=True)
    for text in ('<tool_call>\n{"name": "f", "arguments": {"x": </tool_call>',  # broken JSON
                 '<tool_call>["not", "an object"]</tool_call>',
                 '<tool_call>{"arguments": {}}</tool_call>',  # no name
                 '<tool_call>{"name": "f", "arguments": "a string"}</tool_call>',
                 '<tool_call>{"name": "f", "argu'):  # cut short
        message = message_json(ChoiceReader(reading), text)
        assert message["content"] == text and "tool_calls" not in message, text  # NOTE: absent, never []
    unterminated = message_json(ChoiceReader(reading), '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n')
    assert unterminated["content"] is None and unterminated["tool_calls"][0]["function"]["name"] == "f"


def test_forced_call_start_is_read_with_the_answer() -> None:
    body = chat({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    reading = plan_reading(body, TOOLS_ON)
    reader = ChoiceReader(reading)
    message = message_json(reader, '{"city": "Oslo"}}\n</tool_call>')
    assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert reader.finish_reason("stop") == "stop"  # a named function's answer finishes as OpenAI's does
    required = plan_reading(chat({"tools": [TOOL], "tool_choice": "required"}), TOOLS_ON)
    assert required.forced == "<tool_call>\n" and not required.named


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    """`auto` with parallel_tool_calls false: the answer's first call, whole or streamed however
    cut; the later calls are dropped, text and all (no content made of them)."""
    body = chat({"tools": [TOOL], "parallel_tool_calls": False})
    reading = plan_reading(body, TOOLS_ON)
    assert reading.max_calls == 1 and plan_reading(chat({"tools": [TOOL]}), TOOLS_ON).max_calls is None
    for chunks in cuts(CALLS, (1, 4, 9, len(CALLS))):
        read = read_streamed(reading, chunks)
        assert read.content == "Let me look."
        assert [(c.name, json.loads(c.arguments)) for c in read.calls] == [("get_weather", {"city": "Paris"})]
    unterminated = CALLS.removesuffix("\n</tool_call>")  # the second call ends the answer unterminated
    assert [c.name for c in read_streamed(reading, [unterminated]).calls] == ["get_weather"]


@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_grammar_allows_more_calls_only_when_parallel(model_dirs: dict[str, Path],
                                                                     parallel: bool) -> None:
    """`required`: the grammar after the forced `<tool_call>` takes one call of any tool and, with
    parallel_tool_calls, further `<tool_call>` blocks as Qwen3's template writes them; without, the
    second block is refused. Checked by replaying the answer's tokens through llguidance."""
    tools = [TOOL, {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    reading = plan_reading(chat({"tools": tools, "tool_choice": "required", "parallel_tool_calls": parallel}),
                           TOOLS_ON)
    assert reading.structured is not None
    tokenizer = load_tokenizer(str(model_dirs["tiny"]))
    grammars = GrammarCache(tokenizer, tokenizer.vocab_size)
    one = '{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'
    two = one + '\n<tool_call>\n{"name":"get_time","arguments":{}}\n</tool_call>'
    assert grammars.matcher(reading.structured, tokenizer.encode(one)).is_accepting()
    if parallel:
        assert grammars.matcher(reading.structured, tokenizer.encode(two)).is_accepting()
        read = read_streamed(reading, [two])  # the reader starts with the forced `<tool_call>`
        assert [c.name for c in read.calls] == ["get_weather", "get_time"] and read.content == ""
    else:
        with pytest.raises(ValueError, match="do not match"):
            grammars.matcher(reading.structured, tokenizer.encode(two))
    if parallel:  # cut short (max_tokens) inside the second call: the first one, no content
        cut = read_streamed(reading, [two[:len(one) + 30]])
        assert [c.name for c in cut.calls] == ["get_weather"] and cut.content == ""
    with pytest.raises(ValueError, match="do not match"):  # never a call of a tool not in the request
        grammars.matcher(reading.structured, tokenizer.encode('{"name":"nope","arguments":{}}'))
TOOLS_ON = ApiConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")


def chat(extra: dict[str, object]) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Hi"}]} | extra)


@pytest.mark.parametrize(("api", "extra", "words"), [
    (ApiConfig(), {"tools": [TOOL]}, "--tool-call-parser"),
    (ApiConfig(tool_call_parser="hermes"), {"tools": [TOOL]}, "--enable-auto-tool-choice"),
    (TOOLS_ON, {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among"),
    (TOOLS_ON, {"tool_choice": "required"}, "no `tools`"),
])
def test_tools_a_server_cannot_serve_are_a_400(api: ApiConfig, extra: dict[str, object], words: str) -> None:
    with pytest.raises(OpenAIError) as refused:
        plan_reading(chat(extra), api)
    assert refused.value.status == 400 and words in refused.value.message


def test_tool_choice_none_and_thinking_off_read_nothing() -> None:
    assert plan_reading(chat({"tools": [TOOL], "tool_choice": "none"}), TOOLS_ON) == ChatReading()
    off = chat({"chat_template_kwargs": {"enable_thinking": False}})
    assert not plan_reading(off, ApiConfig(reasoning_parser="qwen3")).reasoning


def test_malformed_tool_calls_in_messages_are_refused_by_the_schema() -> None:
    """(A 400 envelope at the route, not a template's TypeError and a 500.)"""
    with pytest.raises(ValidationError):
        chat({"messages": [{"role": "assistant", "tool_calls": 5}]})
    with pytest.raises(ValidationError):
        chat({"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]})


def test_prompt_logprobs_on_chat_are_asked_for_capped_and_not_streamed() -> None:
    body = chat({"prompt_logprobs": 3})
    assert requested_prompt_logprobs(body) == 3
    check_limits(body, ApiConfig(max_logprobs=3))
    with pytest.raises(OpenAIError, match="--max-logprobs") as caught:
        check_limits(body, ApiConfig(max_logprobs=2))
    assert caught.value.param == "prompt_logprobs"
    with pytest.raises(ValidationError, match="not available when stream is true"):  # as vLLM
        chat({"prompt_logprobs": 1, "stream": True})
