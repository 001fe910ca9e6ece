"""The colocated server's guards (issue 16, items 5-7): client keys, the caps on what one request may
ask for, the body-size cap, and the error contract (never a plain-text 500). Every test ends with
"no request, no KV block left behind"."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_fixtures import ServerHandle, start_server

from pdserve.serving.config import ApiConfig

MODEL_NAME = "tiny-guards"
KEYS = ("key-one", "key-two")
API = ApiConfig(api_key=KEYS, max_request_body_bytes=64 << 10, max_tokens_limit=8, max_n=2, max_logprobs=2,
                max_prompts=3)
AUTH = {"Authorization": f"Bearer {KEYS[1]}"}


@pytest.fixture(scope="module")
def server(model_dirs: dict[str, Path]) -> Iterator[ServerHandle]:
    handle = start_server(model_dirs["tiny"], MODEL_NAME, api=API, dtype="float32", num_kv_blocks=128)
    yield handle
    handle.stop()


@pytest.fixture
def http(server: ServerHandle) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60, headers=AUTH) as client:
        yield client
    server.wait_until_idle()


def assert_envelope(response: httpx.Response, status: int, kind: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json"), response.headers
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status, error
    if kind is not None:
        assert error["type"] == kind, error
    return dict(error)


def complete(http: httpx.Client, **body: Any) -> httpx.Response:
    return http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "ignore_eos": True} | body)


# -- client keys ---------------------------------------------------------------------------------

@pytest.mark.parametrize("header", [None, "Bearer wrong", "Bearer key-one-", "key-one", "Basic key-one"])
def test_a_request_without_a_valid_key_gets_a_401_in_the_envelope(server: ServerHandle, header: str | None) -> None:
    headers = {} if header is None else {"Authorization": header}
    with httpx.Client(base_url=server.base_url, headers=headers) as anonymous:
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")):
            response = anonymous.request(method, path, json={"prompt": "Hi", "messages": [{"role": "user"}]})
            assert_envelope(response, 401, "authentication_error")
            assert response.headers["www-authenticate"] == "Bearer"
    server.wait_until_idle()


def test_every_key_is_accepted_and_probes_stay_open(server: ServerHandle, http: httpx.Client) -> None:
    for key in KEYS:
        assert http.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    with httpx.Client(base_url=server.base_url) as anonymous:
        for path in ("/health", "/ready", "/metrics"):
            assert anonymous.get(path).status_code == 200, path


def test_keys_come_from_flags_file_and_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "keys"
    path.write_text("# clients\nfrom-file\n\n  second  \n")
    monkeypatch.setenv("PDSERVE_API_KEY", "from-env, other")
    config = ApiConfig(api_key=("from-flag", "from-file"), api_key_file=str(path))
    assert config.api_keys() == ("from-flag", "from-file", "second", "from-env", "other")
    with pytest.raises(ValueError, match="whitespace"):
        ApiConfig(api_key=("two words",)).validate()


def test_tokenize_and_detokenize_need_the_key(server: ServerHandle, http: httpx.Client) -> None:
    with httpx.Client(base_url=server.base_url) as anonymous:
        assert_envelope(anonymous.post("/tokenize", json={"prompt": "Hi"}), 401, "authentication_error")
        assert_envelope(anonymous.post("/detokenize", json={"tokens": [1]}), 401, "authentication_error")
        assert anonymous.get("/version").status_code == 200
    assert http.post("/tokenize", json={"prompt": "Hi"}).json()["count"] == 1
    assert http.post("/detokenize", json={"tokens": [13048]}).json() == {"prompt": "Hi"}


# -- caps ------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("body", "param"), [
    ({"stop": [f"s{i}" for i in range(65)]}, "stop"),
    ({"stop": "x" * 1025}, "stop"),
    ({"stop_token_ids": list(range(65))}, "stop_token_ids"),
    ({"max_tokens": 9}, "max_tokens"),
    ({"n": 3}, "n"),
    ({"logprobs": 3}, "logprobs"),
    ({"prompt_logprobs": 3}, "prompt_logprobs"),
    ({"prompt": ["a", "b", "c", "d"]}, "prompt"),
    ({"prompt": [[1], [2], [3], [4]]}, "prompt"),
])
def test_a_request_beyond_a_cap_gets_a_400_naming_it(http: httpx.Client, body: dict[str, Any], param: str) -> None:
    error = assert_envelope(complete(http, **body), 400, "invalid_request_error")
    assert error["param"] == param and "--max-" in error["message"], error


def test_requests_at_the_caps_run(http: httpx.Client) -> None:
    body = {"stop": ["\x00" * 1024] + [f"\x01{i}" for i in range(63)], "stop_token_ids": list(range(64)),
            "n": 2, "logprobs": 2, "max_tokens": 8}
    assert complete(http, prompt=["a", "b", "c"], n=2).status_code == 200
    assert complete(http, prompt=list(range(1, 20))).status_code == 200  # one prompt, as token ids
    reply = complete(http, **body)
    assert reply.status_code == 200, reply.text
    assert [len(choice["logprobs"]["tokens"]) for choice in reply.json()["choices"]] == [8, 8]


def test_chat_without_max_tokens_stops_at_the_cap(http: httpx.Client) -> None:
    reply = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                    "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 8
    too_many = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                       "logprobs": True, "top_logprobs": 3})
    assert assert_envelope(too_many, 400)["param"] == "top_logprobs"


def test_a_body_over_the_cap_gets_a_413_declared_or_chunked(http: httpx.Client) -> None:
    huge = b'{"prompt": "' + b"a" * (64 << 10) + b'"}'
    assert_envelope(http.post("/v1/completions", content=huge,
                              headers={"Content-Type": "application/json"}), 413)

    def chunks() -> Iterator[bytes]:
        yield huge[:1000]
        yield huge[1000:]

    assert_envelope(http.post("/v1/completions", content=chunks(),
                              headers={"Content-Type": "application/json"}), 413)
    assert complete(http).status_code == 200


def test_tokenization_runs_off_the_event_loop(server: ServerHandle, monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer = server.client.tokenizer
    encode = tokenizer.encode

    def slow_encode(text: str, *args: Any, **kwargs: Any) -> list[int]:
        if text == "slow":
            time.sleep(1.0)
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", slow_encode)

    async def race() -> float:
        async with httpx.AsyncClient(base_url=server.base_url, headers=AUTH, timeout=30) as client:
            slow = asyncio.create_task(client.post("/v1/completions", json={"prompt": "slow", "max_tokens": 1}))
            await asyncio.sleep(0.2)
            start = time.monotonic()
            assert (await client.get("/health")).status_code == 200
            took = time.monotonic() - start
            assert (await slow).status_code == 200
            return took

    assert asyncio.run(race()) < 0.5, "a long tokenization stalled the event loop"
    server.wait_until_idle()


# -- the error contract ------------------------------------------------------------------------------

@pytest.mark.parametrize(("path", "raw"), [
    ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 1}'),
    ("/v1/completions", b'{"prompt": ["ok", "\\udfff"], "max_tokens": 1}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 1}'),
])
def test_a_lone_surrogate_is_a_400_not_a_crash(http: httpx.Client, path: str, raw: bytes) -> None:
    reply = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert "surrogate" in assert_envelope(reply, 400)["message"]


def test_an_error_quoting_a_surrogate_still_renders(http: httpx.Client) -> None:
    reply = http.post("/v1/completions", content=b'{"prompt": "a", "model": "\\ud800"}',
                      headers={"Content-Type": "application/json"})
    assert_envelope(reply, 404)


def test_an_unexpected_exception_is_a_500_in_the_envelope_logged_with_its_request_id(
        server: ServerHandle, http: httpx.Client, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    def broken(*_: Any) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(server.client, "validate_request", broken)
    with caplog.at_level(logging.ERROR, logger="pdserve.serving"):
        error = assert_envelope(complete(http), 500, "server_error")
    request_id = error["message"].rpartition("request ")[2].rstrip(")")
    assert request_id.startswith("cmpl-"), error
    assert any(request_id in record.getMessage() and record.exc_info for record in caplog.records), caplog.records
    monkeypatch.undo()
    assert complete(http).status_code == 200


# -- the API contract (issue 32): the document says what the server does -----------------------------

def test_the_document_lists_each_status_with_the_envelope_and_no_422(http: httpx.Client) -> None:
    document = http.get("/openapi.json").json()
    assert "422" not in str(document) and "HTTPValidationError" not in str(document)
    envelope = {"$ref": "#/components/schemas/ErrorEnvelope"}
    expected = {"/v1/completions": {"200", "400", "401", "404", "413", "500", "503"},
                "/v1/chat/completions": {"200", "400", "401", "404", "413", "500", "503"},
                "/tokenize": {"200", "400", "401", "404", "413"}, "/detokenize": {"200", "400", "401", "404", "413"},
                "/v1/models": {"200", "401"}, "/version": {"200"}, "/health": {"200", "503"}}
    for path, statuses in expected.items():
        (operation,) = document["paths"][path].values()
        assert set(operation["responses"]) == statuses, (path, operation["responses"])
        for status in statuses - {"200", "503"} if path == "/health" else statuses - {"200"}:
            assert operation["responses"][status]["content"]["application/json"]["schema"] == envelope, (path, status)
        assert ("security" in operation) == ("401" in statuses), path
    streamed = document["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]
    assert set(streamed) == {"application/json", "text/event-stream"}
    assert document["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}


def test_the_request_schemas_say_what_is_refused(http: httpx.Client, server: ServerHandle) -> None:
    schemas = http.get("/openapi.json").json()["components"]["schemas"]
    completion, chat = schemas["CompletionRequest"]["properties"], schemas["ChatCompletionRequest"]["properties"]
    text, texts, ids, lists = completion["prompt"]["anyOf"]
    assert text["minLength"] == 1 and texts["minItems"] == 1 and texts["items"]["minLength"] == 1
    vocab = server.client.vocab_size
    assert ids["items"] == {"type": "integer", "minimum": 0, "maximum": vocab - 1} and ids["minItems"] == 1
    assert texts["maxItems"] == lists["maxItems"] == API.max_prompts and "maxItems" not in ids
    # the caps of this server
    assert completion["max_tokens"]["anyOf"][0]["maximum"] == API.max_tokens_limit
    assert completion["n"]["maximum"] == API.max_n and chat["top_logprobs"]["anyOf"][0]["maximum"] == API.max_logprobs
    detokenize = schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]
    assert detokenize["maximum"] == server.client.tokenizer.vocab_size - 1
    # a message has content, but for an assistant's that calls tools; what fields require of each other
    message = schemas["ChatMessage"]
    assert message["then"] == {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}}
    rules = {json.dumps(rule["if"]["properties"]) for rule in schemas["ChatCompletionRequest"]["allOf"]}
    assert any("stream_options" in rule for rule in rules) and any("tool_choice" in rule for rule in rules)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": [[False, True]]}, "prompt.0.0"),
    ("/v1/completions", {"prompt": [True]}, "prompt.0"),
    ("/v1/completions", {"prompt": "Hi", "n": True}, "n"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": "2"}, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "stop_token_ids": [False]}, "stop_token_ids.0"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": "Hi", "stop": [""]}, "stop"),
    ("/detokenize", {"tokens": [False]}, "tokens.0"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "tool_call_id": "x"}]}, "messages.0"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0"),
])
def test_what_the_schema_refuses_is_a_400(http: httpx.Client, path: str, body: dict[str, Any], param: str) -> None:
    error = assert_envelope(http.post(path, json=body), 400, "invalid_request_error")
    assert error["param"] is not None and error["param"].startswith(param), error


def test_an_integer_written_as_a_float_is_an_integer(http: httpx.Client) -> None:
    """JSON Schema's integer is 3 or 3.0 (what schemathesis sends): taken, as the schema says."""
    reply = complete(http, prompt=[9707.0, 1879], max_tokens=2.0)
    assert reply.status_code == 200 and reply.json()["usage"]["prompt_tokens"] == 2, reply.text


@pytest.mark.parametrize(("method", "path", "allowed"), [
    ("TRACE", "/v1/models", "GET"), ("DELETE", "/v1/completions", "POST"), ("PUT", "/health", "GET"),
    ("GET", "/tokenize", "POST")])
def test_a_wrong_method_is_a_405_with_allow_before_the_key(server: ServerHandle, method: str, path: str,
                                                          allowed: str) -> None:
    with httpx.Client(base_url=server.base_url) as anonymous:  # NOTE: no key: the 405 comes first
        reply = anonymous.request(method, path)
    assert_envelope(reply, 405)
    assert reply.headers["allow"] == allowed, reply.headers
