"""GET /openapi.json as the server behaves (colocated server and router alike): every status a
route can answer, each error with the OpenAI envelope's schema (serving/errors.py), and no 422,
which the server never answers (a request its schema refuses is a 400).

What each route declares itself (`responses=documented_errors(...)`): 404 for a model it does not
serve, 429 and 503 for generation. What this module adds to every route: 400 where FastAPI would
have documented its 422 (a body or parameters to validate), 413 where there is a body (the
--max-request-body-bytes cap), and 401 on the paths a client key guards when the server has keys
(with the bearer scheme as their `security`). Routes of the cluster's own plane (`/pd/*`) are left
out (`include_in_schema=False` where declared).

The request schemas carry this server's caps too (`bound`): --max-tokens-limit, --max-n, the stop
and logprobs caps, the vocabulary's size for token ids: a request the document calls valid is one
the server takes, but for what no schema can say (prompt + max_tokens over the context window,
min_tokens over max_tokens, a named tool that is not among `tools`).
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from pdserve.serving.config import ApiConfig
from pdserve.serving.errors import ErrorEnvelope, documented_errors
from pdserve.serving.middleware import PROTECTED_PREFIXES

_REF_TEMPLATE = "#/components/schemas/{model}"
_SCHEME = "bearer"  # `Authorization: Bearer <key>` (--api-key)
_ENVELOPE_REF = {"$ref": _REF_TEMPLATE.format(model=ErrorEnvelope.__name__)}


def install_openapi(app: FastAPI, api: ApiConfig, vocab_size: int, tokenizer_vocab_size: int) -> None:
    """`vocab_size`: the model's (prompts' ids); `tokenizer_vocab_size`: the ids /detokenize takes."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, openapi_version=app.openapi_version,
                                 routes=app.routes)
            conform(schema, keyed=bool(api.api_keys()))
            bound(schema["components"]["schemas"], api, vocab_size, tokenizer_vocab_size)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def conform(schema: dict[str, Any], keyed: bool) -> None:
    """Rewrite FastAPI's document (in place) to what the server answers (see the module docstring)."""
    for path, item in schema.get("paths", {}).items():
        for operation in item.values():
            responses: dict[str, Any] = operation.setdefault("responses", {})
            added: list[HTTPStatus] = []
            if responses.pop("422", None) is not None:
                added.append(HTTPStatus.BAD_REQUEST)
            if "requestBody" in operation:
                added.append(HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
            if keyed and path.startswith(PROTECTED_PREFIXES):
                added.append(HTTPStatus.UNAUTHORIZED)
                operation["security"] = [{_SCHEME: []}]
            for status in added:
                responses.setdefault(str(int(status)), _envelope_response(status))
    parts = schema.setdefault("components", {})
    if keyed:
        parts.setdefault("securitySchemes", {})[_SCHEME] = {"type": "http", "scheme": "bearer"}
    components = parts.setdefault("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        components.pop(unused, None)
    envelope = ErrorEnvelope.model_json_schema(ref_template=_REF_TEMPLATE)
    components.update(envelope.pop("$defs", {}))
    components[ErrorEnvelope.__name__] = envelope


def _envelope_response(status: HTTPStatus) -> dict[str, Any]:
    description = documented_errors(status)[int(status)]["description"]
    return {"description": description, "content": {"application/json": {"schema": _ENVELOPE_REF}}}


def bound(schemas: dict[str, Any], api: ApiConfig, vocab_size: int, tokenizer_vocab_size: int) -> None:
    """This server's caps into the request schemas (`schemas`: the document's components)."""
    token_id = {"integer": {"maximum": vocab_size - 1}}
    text_token_id = {"integer": {"maximum": tokenizer_vocab_size - 1}}
    stop = {"string": {"maxLength": api.max_stop_string_len}, "array": {"maxItems": api.max_stop_strings}}
    common = {"n": {"integer": {"maximum": api.max_n}}, "stop": stop,
              "stop_token_ids": {"array": {"maxItems": api.max_stop_token_ids}} | token_id,
              "prompt_logprobs": {"integer": {"maximum": api.max_logprobs}}}
    max_tokens = {} if api.max_tokens_limit is None else {"integer": {"maximum": api.max_tokens_limit}}
    common["min_tokens"] = max_tokens  # NOTE: at most max_tokens, which is at most the limit
    caps = {
        "CompletionRequest": common | {"max_tokens": max_tokens, "logprobs": {"integer": {"maximum": api.max_logprobs}},
                                       "prompt": token_id},
        "ChatCompletionRequest": common | {"max_tokens": max_tokens, "max_completion_tokens": max_tokens,
                                           "top_logprobs": {"integer": {"maximum": api.max_logprobs}}},
        "DetokenizeRequest": {"tokens": text_token_id},
    }
    for name, properties in caps.items():
        for prop, by_type in properties.items():
            if name in schemas and prop in schemas[name].get("properties", {}):
                _tighten(schemas[name]["properties"][prop], by_type)
    prompt = schemas.get("CompletionRequest", {}).get("properties", {}).get("prompt")
    for option in prompt["anyOf"] if prompt else ():  # NOTE: a list of prompts (not one prompt's ids)
        if option.get("type") == "array" and option["items"].get("type") != "integer":
            option["maxItems"] = min(option.get("maxItems", api.max_prompts), api.max_prompts)


def _tighten(node: Any, by_type: dict[str, dict[str, int]]) -> None:
    """Every subschema of `node` of a type in `by_type` gets that type's upper bounds (the lower of two)."""
    if isinstance(node, list):
        for item in node:
            _tighten(item, by_type)
        return
    if not isinstance(node, dict):
        return
    for key, cap in by_type.get(node.get("type", ""), {}).items():
        node[key] = min(node.get(key, cap), cap)
        if key == "maximum" and "exclusiveMaximum" in node:
            node[key] = min(node[key], node.pop("exclusiveMaximum") - 1)
    for key in ("anyOf", "oneOf", "allOf", "items"):
        if key in node:
            _tighten(node[key], by_type)
