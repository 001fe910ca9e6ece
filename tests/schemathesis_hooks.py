"""Schemathesis hooks for tests/test_fuzz_api.py (loaded through SCHEMATHESIS_HOOKS): what a
request's JSON Schema cannot say, because it compares one field's value with another's, made true
of the generated bodies so that a schema-valid request is a valid one. Values of the wrong type
are left as they are (negative cases stay negative). Each rule is one the server enforces with a
400 and the OpenAPI document states in words (serving/openapi.py)."""

from __future__ import annotations

import json
import os
from typing import Any

import schemathesis


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@schemathesis.hook
def map_body(context: Any, body: Any) -> Any:
    if not isinstance(body, dict):
        return body
    # min_tokens <= max_tokens (max_completion_tokens first, on chat)
    limit = next((body[k] for k in ("max_completion_tokens", "max_tokens") if _int(body.get(k))), None)
    if _int(body.get("min_tokens")) and limit is not None and body["min_tokens"] > limit:
        body["min_tokens"] = limit
    # best_of == n (no beam search)
    if _int(body.get("best_of")):
        body["best_of"] = body["n"] if _int(body.get("n")) else 1
    _one_valid_structured_output(body)
    # a named tool_choice names one of `tools`
    choice, tools = body.get("tool_choice"), body.get("tools")
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict) and isinstance(tools, list) and tools:
        first = tools[0]
        name = first.get("function", {}).get("name") if isinstance(first, dict) else None
        if isinstance(name, str):
            choice["function"]["name"] = name
    return body


# Structured outputs (issue 32, item 1): whether a regex, a grammar or a JSON schema compiles is
# no JSON Schema's to say; a generated one of the right type becomes one that does, and a request
# keeps one constraint (more are refused). No-op on a body without them.
_VALID = {"regex": "[a-z]{1,8}", "grammar": 'root ::= "yes" | "no"', "json": {"type": "object"}}
_TOP_LEVEL = {"guided_regex": "regex", "guided_grammar": "grammar", "guided_json": "json"}
_CONSTRAINTS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                "guided_grammar")


def _valid_like(kind: str, value: Any) -> Any:
    valid = _VALID[kind]
    if kind == "json" and isinstance(value, str):
        return json.dumps(valid)
    if kind == "json" and isinstance(value, bool):  # NOTE: a boolean schema: `false` admits nothing
        return valid
    return valid if isinstance(value, type(valid)) else value


def _one_valid_structured_output(body: dict[str, Any]) -> None:
    present = [key for key in _CONSTRAINTS if body.get(key) is not None
               and not (key == "response_format" and isinstance(body[key], dict) and body[key].get("type") == "text")]
    for extra in present[1:]:
        del body[extra]
    for key, kind in _TOP_LEVEL.items():
        if body.get(key) is not None:
            body[key] = _valid_like(kind, body[key])
    outputs = body.get("structured_outputs")
    if isinstance(outputs, dict):
        for key in [k for k in ("json", "regex", "choice", "grammar", "json_object") if outputs.get(k) is not None][1:]:
            del outputs[key]
        for key in ("regex", "grammar", "json"):
            if outputs.get(key) is not None:
                outputs[key] = _valid_like(key, outputs[key])
    fmt = body.get("response_format")
    schema = fmt.get("json_schema") if isinstance(fmt, dict) else None
    if isinstance(schema, dict) and isinstance(schema.get("schema"), (dict, bool)):
        schema["schema"] = _VALID["json"]


# NOTE: the context window: a prompt's tokens are at most its UTF-8 bytes (a byte-level BPE token
# is one byte or more), and what a chat template adds is small: bodies whose prompt text is over
# this many bytes are not generated (the test sets it from the server's max_model_len)
PROMPT_BYTES_ENV = "PDSERVE_FUZZ_PROMPT_BYTES"


@schemathesis.hook
def filter_body(context: Any, body: Any) -> bool:
    limit = int(os.environ.get(PROMPT_BYTES_ENV, "0"))
    if not limit or not isinstance(body, dict):
        return True
    rendered = {key: body.get(key) for key in ("prompt", "messages", "tools")}
    return len(json.dumps(rendered, ensure_ascii=False).encode("utf-8", "surrogatepass")) <= limit


@schemathesis.check
def openai_error_envelope(ctx: Any, response: Any, case: Any) -> None:
    """Beyond the schema (which has the envelope's fields): an error's `code` is its HTTP status and
    its message says something, and no field besides the four."""
    if response.status_code < 400:
        return
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, f"not the OpenAI error envelope: {error}"
    assert error["code"] == response.status_code and error["message"], f"code or message wrong: {error}"
