"""Qwen3's chat template and a Hugging Face-compatible renderer for it (or any directory-provided template)."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, NoReturn

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The official Qwen3 template (Qwen/Qwen3-8B tokenizer_config.json): tools block in the system turn, tool results
# folded into user turns, and reasoning stripped from assistant turns before the latest user query.
QWEN3_CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n\
You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments \
within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \
\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and \
not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1]\
.lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + \
'\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

_ROLES = frozenset({"system", "user", "assistant", "tool"})


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's built-in tojson HTML-escapes and sorts keys; HF's does neither, and prompts must match HF byte for byte.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    # Same environment as transformers' apply_chat_template: templates from model directories are untrusted.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def _flatten_content(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, Sequence):
        raise ValueError(f"messages[{index}].content must be a string or a list of text parts")
    texts = []
    for part in content:
        if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            raise ValueError(
                f"messages[{index}].content: only {{'type': 'text', 'text': str}} parts are supported, got {part!r}"
            )
        texts.append(part["text"])
    # Newline-joined, as OpenAI-compatible servers (vLLM) flatten multi-part text content.
    return "\n".join(texts)


def _normalize_message(message: Any, index: int) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise ValueError(f"messages[{index}] must be a mapping, got {type(message).__name__}")
    role = message.get("role")
    if role not in _ROLES:
        raise ValueError(f"messages[{index}] has invalid role {role!r}; expected one of {sorted(_ROLES)}")
    content = message.get("content")
    if content is None:
        # An assistant turn that only calls tools legitimately has no content (OpenAI sends null).
        if role == "assistant" and message.get("tool_calls"):
            return {**message, "content": ""}
        raise ValueError(f"messages[{index}] (role {role!r}) is missing 'content'")
    return {**message, "content": _flatten_content(content, index)}


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    enable_thinking: bool = True,
    **kwargs: Any,
) -> str:
    """Render `messages` into a prompt string; raises ValueError for malformed messages or template errors."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} mappings")
    normalized = [_normalize_message(message, i) for i, message in enumerate(messages)]
    try:
        return _compile(template).render(
            messages=normalized,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=enable_thinking,
            **kwargs,
        )
    except jinja2.exceptions.TemplateError as exc:
        # Covers raise_exception() in directory templates, which reject e.g. unsupported role orders.
        raise ValueError(f"chat template rejected the messages: {exc}") from exc
