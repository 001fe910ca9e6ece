"""The OpenAI-compatible server end to end: a real uvicorn server over a random-weight tiny Qwen3,
driven with httpx. Every test ends with "no request, no KV block left behind" (autouse fixture).

Greedy outputs are compared with the offline `LLM.generate` of an identically configured engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shlex
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest
from server_fixtures import DONE, ServerHandle, parse_sse, start_server, stream_events

from pdserve.engine.llm import LLM, Prompt, TokensPrompt
from pdserve.engine.output import RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.model.demo_checkpoint import PRESETS, write_checkpoint
from pdserve.tokenizer import Tokenizer

MODEL_NAME = "pdserve-test-tiny"
MAX_MODEL_LEN = 512
ENGINE_ARGS: dict[str, Any] = {"dtype": "float32", "device": "cpu", "max_model_len": MAX_MODEL_LEN,
                               "num_kv_blocks": 256, "seed": 0}
PROMPT = "The capital of France is"
EOS_PROBE_PROMPT = "Once upon a time"
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
USER_HI = [{"role": "user", "content": "Hi"}]


# -- fixtures ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny-qwen3"), PRESETS["tiny"])


@pytest.fixture(scope="module")
def offline(model_dir: Path) -> LLM:
    """The reference: offline engine with the server's settings, built before `extra_eos` edits the
    generation config (it is only ever asked for ignore_eos outputs)."""
    return LLM(str(model_dir), **ENGINE_ARGS)


@pytest.fixture(scope="module")
def tok(offline: LLM) -> Tokenizer:
    return offline.get_tokenizer()


@pytest.fixture(scope="module")
def extra_eos(model_dir: Path, offline: LLM) -> tuple[int, int]:
    """A random-weight model never samples <|im_end|>, so ignore_eos would be untestable. Declare a
    token that greedy decoding of EOS_PROBE_PROMPT does produce as an extra EOS id in
    generation_config.json (as real checkpoints list several). Returns (token id, its output position):
    the first token, from position 2 on, not seen before in that output."""
    ids = greedy(offline, EOS_PROBE_PROMPT, 16).outputs[0].token_ids
    position = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    config_path = model_dir / "generation_config.json"
    config = json.loads(config_path.read_text())
    config["eos_token_id"] = [*config["eos_token_id"], ids[position]]
    config_path.write_text(json.dumps(config))
    return ids[position], position


@pytest.fixture(scope="module")
def server(model_dir: Path, extra_eos: tuple[int, int]) -> Iterator[ServerHandle]:
    handle = start_server(model_dir, MODEL_NAME, **ENGINE_ARGS)
    assert extra_eos[0] in handle.client.tokenizer.eos_token_ids
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def http(server: ServerHandle) -> Iterator[httpx.Client]:
    with server.http() as client:
        yield client


@pytest.fixture(autouse=True)
def nothing_left_behind(server: ServerHandle) -> Iterator[None]:
    yield
    server.wait_until_idle()


# -- helpers -----------------------------------------------------------------------------------

def greedy(llm: LLM, prompt: str | list[int], max_tokens: int) -> RequestOutput:
    source: Prompt = prompt if isinstance(prompt, str) else TokensPrompt(prompt_token_ids=prompt)
    return llm.generate(source, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))[0]


def post_ok(http: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def complete(http: httpx.Client, **body: Any) -> dict[str, Any]:
    return post_ok(http, COMPLETIONS, {"model": MODEL_NAME, "temperature": 0} | body)


def chat(http: httpx.Client, **body: Any) -> dict[str, Any]:
    return post_ok(http, CHAT, {"model": MODEL_NAME, "temperature": 0} | body)


def decode_each(tok: Tokenizer, token_ids: list[int]) -> list[str]:
    return [tok.decode([t], skip_special_tokens=False) for t in token_ids]


def assert_usage(body: dict[str, Any], prompt_tokens: int, completion_tokens: int) -> None:
    usage = body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (prompt_tokens, completion_tokens)
    assert usage["total_tokens"] == prompt_tokens + completion_tokens


def collect_stream(chunks: list[dict[str, Any]], kind: Literal["text", "delta"]) -> dict[int, tuple[str, str]]:
    """Concatenated text and the finish reason of each choice (completion chunks carry `text`, chat
    chunks a `delta`); asserts exactly one chunk per choice carries a finish_reason, and nothing follows it."""
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            index = choice["index"]
            assert index not in finish, f"choice {index} got a chunk after its finish_reason"
            piece = choice["text"] if kind == "text" else choice["delta"].get("content", "")
            texts[index] = texts.get(index, "") + piece
            if choice["finish_reason"] is not None:
                finish[index] = choice["finish_reason"]
    assert set(finish) == set(texts), f"choices without a finish_reason: {set(texts) - set(finish)}"
    return {index: (texts[index], finish[index]) for index in texts}


def assert_openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert error["code"] == status
    return error


def assert_still_serving(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    assert complete(http, prompt="ok", max_tokens=1)["usage"]["completion_tokens"] == 1


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


# -- discovery ---------------------------------------------------------------------------------

def test_health_and_models(http: httpx.Client) -> None:
    health, ready = http.get("/health"), http.get("/ready")
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert ready.status_code == 200 and ready.json() == {"status": "ready"}
    models = http.get("/v1/models").json()
    assert models["object"] == "list"
    assert [card["id"] for card in models["data"]] == [MODEL_NAME]
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN


# -- /v1/completions ---------------------------------------------------------------------------

def test_completion_string_prompt_matches_offline_greedy(http: httpx.Client, offline: LLM, tok: Tokenizer) -> None:
    expected = greedy(offline, PROMPT, 12).outputs[0]
    body = complete(http, prompt=PROMPT, max_tokens=12, ignore_eos=True, logprobs=0)
    (choice,) = body["choices"]
    assert choice["text"] == expected.text
    assert choice["logprobs"]["tokens"] == decode_each(tok, expected.token_ids)
    assert choice["finish_reason"] == "length"
    assert body["object"] == "text_completion" and body["model"] == MODEL_NAME
    assert_usage(body, len(tok.encode(PROMPT)), 12)


def test_completion_token_id_prompt_matches_offline_greedy(http: httpx.Client, offline: LLM,
                                                           tok: Tokenizer) -> None:
    prompt_ids = tok.encode("Token ids in, text out:") + [151643]
    expected = greedy(offline, prompt_ids, 10).outputs[0]
    body = complete(http, prompt=prompt_ids, max_tokens=10, ignore_eos=True, logprobs=0)
    (choice,) = body["choices"]
    assert choice["text"] == expected.text
    assert choice["logprobs"]["tokens"] == decode_each(tok, expected.token_ids)
    assert_usage(body, len(prompt_ids), 10)


def test_only_text_prompts_are_tokenized_on_a_thread(http: httpx.Client, tok: Tokenizer,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Token ids need no tokenizer: they skip the thread hop that keeps long text off the event loop."""
    from pdserve.serving import completions

    calls: list[object] = []
    real = completions.asyncio.to_thread

    async def counted(fn: Any, *args: Any) -> Any:
        calls.append(fn)
        return await real(fn, *args)

    monkeypatch.setattr(completions.asyncio, "to_thread", counted)
    ids = tok.encode("Token ids in")
    for prompt, num_choices in ((ids, 1), ([ids, ids], 2)):
        assert len(complete(http, prompt=prompt, max_tokens=2, ignore_eos=True)["choices"]) == num_choices
    assert calls == []
    complete(http, prompt="Text in", max_tokens=2, ignore_eos=True)
    assert len(calls) == 1


def test_completion_list_of_prompts_indexes_choices(http: httpx.Client, offline: LLM, tok: Tokenizer) -> None:
    prompts = ["Red", "Green is a colour", "Blue sky and"]
    body = complete(http, prompt=prompts, max_tokens=6, ignore_eos=True)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    for prompt, choice in zip(prompts, body["choices"], strict=True):
        assert choice["text"] == greedy(offline, prompt, 6).outputs[0].text, prompt
    assert_usage(body, sum(len(tok.encode(p)) for p in prompts), 6 * len(prompts))


def test_completion_stream_matches_non_stream(http: httpx.Client, tok: Tokenizer) -> None:
    request = {"prompt": PROMPT, "max_tokens": 14, "ignore_eos": True}
    full = complete(http, **request)
    chunks = stream_events(http, COMPLETIONS, {"model": MODEL_NAME, "temperature": 0, **request,
                                               "stream_options": {"include_usage": True}})
    *content, usage_chunk = chunks
    assert usage_chunk["choices"] == [] and all(c["choices"] for c in content)
    assert_usage(usage_chunk, len(tok.encode(PROMPT)), 14)
    assert all("usage" not in c or c["usage"] is None for c in content)
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["object"] == "text_completion"
    assert collect_stream(content, "text") == {0: (full["choices"][0]["text"], "length")}


def test_completion_stream_several_prompts_and_n(http: httpx.Client) -> None:
    """Two prompts x n=2 seeded samples: four choices, each finishing exactly once, each equal to
    the non-streamed text of the same seeded request."""
    request = {"prompt": ["One", "Two three"], "max_tokens": 5, "n": 2, "seed": 11, "temperature": 1.0,
               "ignore_eos": True}
    full = complete(http, **request)
    streamed = collect_stream(stream_events(http, COMPLETIONS, {"model": MODEL_NAME, **request}), "text")
    assert streamed == {c["index"]: (c["text"], "length") for c in full["choices"]}
    assert sorted(streamed) == [0, 1, 2, 3]


def test_completion_stream_choice_that_stops_early_finishes_once(http: httpx.Client) -> None:
    """n=2 where only choice 0 meets its stop string: choice 1 keeps streaming after choice 0's
    finish chunk, which must not be repeated."""
    request = {"prompt": PROMPT, "max_tokens": 12, "n": 2, "seed": 5, "temperature": 1.0, "ignore_eos": True}
    first, second = (c["text"] for c in complete(http, **request)["choices"])
    at = next(i for i in range(1, len(first) // 3) if first[i:i + 2] not in second)
    stop = first[at:at + 2]
    streamed = collect_stream(stream_events(http, COMPLETIONS, {"model": MODEL_NAME, **request, "stop": stop}),
                              "text")
    assert streamed == {0: (first[: first.find(stop)], "stop"), 1: (second, "length")}


def test_completion_stream_without_usage_has_no_usage_chunk(http: httpx.Client) -> None:
    chunks = stream_events(http, COMPLETIONS, {"prompt": PROMPT, "max_tokens": 3, "temperature": 0})
    assert all(c["choices"] for c in chunks)
    assert all(c.get("usage") is None for c in chunks)


# -- /v1/chat/completions ----------------------------------------------------------------------

def test_chat_stream_matches_non_stream(http: httpx.Client, tok: Tokenizer) -> None:
    request = {"messages": USER_HI, "max_tokens": 12, "ignore_eos": True}
    full = chat(http, **request)
    (choice,) = full["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    chunks = stream_events(http, CHAT, {"model": MODEL_NAME, "temperature": 0, **request,
                                        "stream_options": {"include_usage": True}})
    *content, usage_chunk = chunks
    assert content[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == full["usage"]
    assert_usage(full, len(tok.encode(tok.apply_chat_template(USER_HI))), 12)
    assert collect_stream(content, "delta") == {0: (choice["message"]["content"], "length")}


def test_chat_enable_thinking_false_adds_empty_think_block(http: httpx.Client, tok: Tokenizer) -> None:
    header = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    thinking = chat(http, messages=USER_HI, max_tokens=1)
    plain = chat(http, messages=USER_HI, max_tokens=1, chat_template_kwargs={"enable_thinking": False})
    assert thinking["usage"]["prompt_tokens"] == len(tok.encode(header))
    assert plain["usage"]["prompt_tokens"] == len(tok.encode(header + "<think>\n\n</think>\n\n"))


def test_chat_n2_seeded_is_reproducible(http: httpx.Client) -> None:
    request = {"messages": USER_HI, "max_tokens": 8, "n": 2, "seed": 1234, "temperature": 1.0, "ignore_eos": True}
    first, second = chat(http, **request), chat(http, **request)
    texts = [c["message"]["content"] for c in first["choices"]]
    assert [c["index"] for c in first["choices"]] == [0, 1]
    assert texts == [c["message"]["content"] for c in second["choices"]]
    assert texts[0] != texts[1], "the two samples of one request must use different random streams"
    assert first["usage"]["completion_tokens"] == 16
    other = chat(http, **(request | {"seed": 4321}))
    assert [c["message"]["content"] for c in other["choices"]] != texts
    streamed = collect_stream(stream_events(http, CHAT, {"model": MODEL_NAME, **request}), "delta")
    assert streamed == {0: (texts[0], "length"), 1: (texts[1], "length")}


def test_chat_developer_role_acts_as_system(http: httpx.Client) -> None:
    as_system = chat(http, messages=[{"role": "system", "content": "Be brief."}, *USER_HI], max_tokens=4)
    as_developer = chat(http, messages=[{"role": "developer", "content": "Be brief."}, *USER_HI], max_tokens=4)
    assert as_developer["usage"]["prompt_tokens"] == as_system["usage"]["prompt_tokens"]
    assert as_developer["choices"][0]["message"] == as_system["choices"][0]["message"]


# -- vLLM sampling extras ----------------------------------------------------------------------

def test_ignore_eos(http: httpx.Client, extra_eos: tuple[int, int]) -> None:
    eos_id, position = extra_eos
    stopped = complete(http, prompt=EOS_PROBE_PROMPT, max_tokens=16, logprobs=0)
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] == position + 1  # the EOS token is counted
    ignored = complete(http, prompt=EOS_PROBE_PROMPT, max_tokens=16, ignore_eos=True)
    assert ignored["choices"][0]["finish_reason"] == "length"
    assert ignored["usage"]["completion_tokens"] == 16


def test_top_k_1_and_min_p_1_reduce_sampling_to_greedy(http: httpx.Client) -> None:
    request = {"prompt": PROMPT, "max_tokens": 12, "ignore_eos": True}
    greedy_text = complete(http, **request)["choices"][0]["text"]
    sampled = {complete(http, **request, temperature=1.0, seed=s)["choices"][0]["text"] for s in (1, 2)}
    assert greedy_text not in sampled  # temperature 1 alone is not greedy on this model
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        assert complete(http, **request, temperature=1.0, seed=1, **extra)["choices"][0]["text"] == greedy_text


def test_seed(http: httpx.Client) -> None:
    request = {"prompt": PROMPT, "max_tokens": 12, "ignore_eos": True, "temperature": 1.0}
    texts = [complete(http, **request, seed=seed)["choices"][0]["text"] for seed in (7, 7, 8)]
    assert texts[0] == texts[1]
    assert texts[0] != texts[2]


def test_stop_token_ids_and_min_tokens(http: httpx.Client, offline: LLM, tok: Tokenizer) -> None:
    ids = greedy(offline, PROMPT, 16).outputs[0].token_ids
    position = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    request = {"prompt": PROMPT, "max_tokens": 16, "ignore_eos": True, "stop_token_ids": [ids[position]]}
    stopped = complete(http, **request)["choices"][0]
    assert (stopped["finish_reason"], stopped["stop_reason"]) == ("stop", ids[position])
    assert complete(http, **request)["usage"]["completion_tokens"] == position + 1
    held = complete(http, **request, min_tokens=position + 3, logprobs=0)
    assert held["usage"]["completion_tokens"] >= position + 3
    stop_text = tok.decode([ids[position]], skip_special_tokens=False)
    assert stop_text not in held["choices"][0]["logprobs"]["tokens"][: position + 3]


def test_repetition_penalty(http: httpx.Client) -> None:
    request = {"prompt": PROMPT, "max_tokens": 24, "ignore_eos": True, "logprobs": 0}
    plain = complete(http, **request)["choices"][0]["logprobs"]["tokens"]
    assert len(set(plain)) < len(plain), "the baseline should repeat itself for this test to mean anything"
    penalized = complete(http, **request, repetition_penalty=3.0)["choices"][0]["logprobs"]["tokens"]
    assert penalized != plain
    assert len(penalized) - len(set(penalized)) < len(plain) - len(set(plain))


def test_stop_string_truncates_text(http: httpx.Client, offline: LLM) -> None:
    text = greedy(offline, PROMPT, 16).outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert len(stop) == 3 and text.find(stop) > 0
    request = {"prompt": PROMPT, "max_tokens": 16, "ignore_eos": True, "stop": [stop, "never appears"]}
    choice = complete(http, **request)["choices"][0]
    assert choice["text"] == text[: text.find(stop)]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    streamed = collect_stream(stream_events(http, COMPLETIONS, {"temperature": 0, **request}), "text")
    assert streamed == {0: (choice["text"], "stop")}
    kept = complete(http, **request, include_stop_str_in_output=True)["choices"][0]
    assert kept["text"] == text[: text.find(stop) + len(stop)]


# -- limits and errors -------------------------------------------------------------------------

@pytest.mark.parametrize(("prompt_len", "max_tokens", "status"), [
    (MAX_MODEL_LEN - 1, 1, 200),
    (MAX_MODEL_LEN, 1, 400),  # the prompt alone fills the window
    (MAX_MODEL_LEN + 88, None, 400),
    (500, 12, 200),
    (500, 13, 400),  # prompt + max_tokens one past the window
])
def test_context_window(http: httpx.Client, prompt_len: int, max_tokens: int | None, status: int) -> None:
    body: dict[str, Any] = {"prompt": [100] * prompt_len, "temperature": 0, "ignore_eos": True}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    response = http.post(COMPLETIONS, json=body)
    if status == 200:
        assert response.status_code == 200, response.text
        assert_usage(response.json(), prompt_len, max_tokens or 0)
    else:
        error = assert_openai_error(response, status)
        assert str(MAX_MODEL_LEN) in error["message"]


def test_chat_prompt_longer_than_window_is_400(http: httpx.Client) -> None:
    messages = [{"role": "user", "content": "hi " * MAX_MODEL_LEN}]
    assert_openai_error(http.post(CHAT, json={"messages": messages}), 400)
    assert_openai_error(http.post(CHAT, json={"messages": USER_HI, "max_tokens": MAX_MODEL_LEN}), 400)


_BAD_COMPLETIONS = {
    "temperature -1": {"temperature": -1},
    "top_p 0": {"top_p": 0},
    "n 0": {"n": 0},
    "max_tokens 0": {"max_tokens": 0},
    "logprobs 50": {"logprobs": 50},
    "stop is a number": {"stop": 5},
    "stop has numbers": {"stop": [1, 2]},
    "stop is empty string": {"stop": [""]},
    "top_k -2": {"top_k": -2},
    "min_p 2": {"min_p": 2},
    "repetition_penalty 0": {"repetition_penalty": 0},
    "repetition_penalty Infinity": {"repetition_penalty": float("inf")},
    "temperature NaN": {"temperature": float("nan")},
    "seed -1": {"seed": -1},
    "temperature is text": {"temperature": "hot"},
    "min_tokens > max_tokens": {"min_tokens": 9, "max_tokens": 3},
    "negative stop token": {"stop_token_ids": [-1]},
    "stop token outside vocab": {"stop_token_ids": [10**7], "min_tokens": 2},
    "stream_options without stream": {"stream_options": {"include_usage": True}},
    "prompt_logprobs 21": {"prompt_logprobs": 21},
    "token id outside vocab": {"prompt": [1, 2, 10**7]},
    "negative token id": {"prompt": [-5]},
    "empty prompt list": {"prompt": []},
    "empty token list": {"prompt": [[]]},
    "mixed prompt list": {"prompt": [1, "a"]},
    "prompt null": {"prompt": None},
}


@pytest.mark.parametrize("overrides", list(_BAD_COMPLETIONS.values()), ids=list(_BAD_COMPLETIONS))
def test_bad_completion_parameters_are_400(http: httpx.Client, overrides: dict[str, Any]) -> None:
    for stream in (False, True):
        body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, "stream": stream} | overrides
        if "stream_options" in overrides:
            body["stream"] = False
        # json.dumps, unlike httpx, writes NaN/Infinity, which Python-based servers parse
        raw = json.dumps(body).encode()
        assert_openai_error(http.post(COMPLETIONS, content=raw, headers={"content-type": "application/json"}), 400)
    assert_still_serving(http)


def test_missing_prompt_is_400(http: httpx.Client) -> None:
    error = assert_openai_error(http.post(COMPLETIONS, json={"model": MODEL_NAME}), 400)
    assert error["param"] == "prompt"
    assert_still_serving(http)


_BAD_CHATS = {
    "missing messages": {},
    "empty messages": {"messages": []},
    "messages is a string": {"messages": "hi"},
    "invalid role": {"messages": [{"role": "wizard", "content": "hi"}]},
    "missing content": {"messages": [{"role": "user"}]},
    "image content": {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    "top_logprobs without logprobs": {"messages": USER_HI, "top_logprobs": 2},
    "top_logprobs 21": {"messages": USER_HI, "logprobs": True, "top_logprobs": 21},
    "max_completion_tokens 0": {"messages": USER_HI, "max_completion_tokens": 0},
    "n 0": {"messages": USER_HI, "n": 0},
}


@pytest.mark.parametrize("body", list(_BAD_CHATS.values()), ids=list(_BAD_CHATS))
def test_bad_chat_requests_are_400(http: httpx.Client, body: dict[str, Any]) -> None:
    assert_openai_error(http.post(CHAT, json={"model": MODEL_NAME, **body}), 400)
    assert_still_serving(http)


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b'{"prompt": "x",}', b"null"],
                         ids=["malformed", "empty", "array", "trailing comma", "null"])
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_malformed_body_is_400(http: httpx.Client, path: str, raw: bytes) -> None:
    assert_openai_error(http.post(path, content=raw, headers={"content-type": "application/json"}), 400)
    assert_still_serving(http)


@pytest.mark.parametrize(("path", "body"), [
    (COMPLETIONS, {"prompt": PROMPT}),
    (COMPLETIONS, {"prompt": PROMPT, "stream": True}),
    (CHAT, {"messages": USER_HI}),
])
def test_unknown_model_is_404(http: httpx.Client, path: str, body: dict[str, Any]) -> None:
    error = assert_openai_error(http.post(path, json=body | {"model": "gpt-17"}), 404)
    assert error["param"] == "model" and "gpt-17" in error["message"]
    assert_still_serving(http)


def test_unknown_route_and_method_are_openai_errors(http: httpx.Client) -> None:
    assert_openai_error(http.get("/v1/nothing-here"), 404)
    assert_openai_error(http.get(COMPLETIONS), 405)


# -- disconnects -------------------------------------------------------------------------------

@pytest.fixture
def server_errors() -> Iterator[list[logging.LogRecord]]:
    """ERROR records the server logs during a test (uvicorn's loggers do not propagate to root)."""
    handler = _Records()
    loggers = [logging.getLogger(name) for name in ("uvicorn.error", "pdserve")]
    for logger in loggers:
        logger.addHandler(handler)
    yield handler.records
    for logger in loggers:
        logger.removeHandler(handler)


LONG = {"max_tokens": 480, "ignore_eos": True, "temperature": 0}


def test_stream_client_disconnect_aborts(server: ServerHandle, http: httpx.Client,
                                         server_errors: list[logging.LogRecord]) -> None:
    # NOTE: the engine runs in its own process and never waits for the HTTP side, so on a loaded
    # machine a request can finish all its tokens before the client has read the first event (the
    # client, the server and its engine client share this test's interpreter). Such an attempt shows
    # nothing about aborts: it is run again with more rows (n), which take more steps. Whether an
    # attempt ran to its end is read from the engine's step count once it is idle (a snapshot taken
    # while it streamed could not tell a finished request whose outputs still queue from a running one).
    steps = []
    for n in (8, 16, 32, 64):
        steps_before = server.client.stats().num_steps
        with http.stream("POST", COMPLETIONS, json={"prompt": PROMPT, "stream": True, "n": n, **LONG}) as response:
            assert response.status_code == 200
            next(line for line in response.iter_lines() if line.startswith("data: "))
        server.wait_until_idle(timeout_s=3.0)
        steps.append(server.client.stats().num_steps - steps_before)
        # Had the request run on, it would have taken at least one step per token.
        if steps[-1] < LONG["max_tokens"] // 2:
            break
    else:
        pytest.fail(f"every attempt had finished before its client read the first event (steps {steps})")
    assert not server_errors, [r.getMessage() for r in server_errors]
    assert_still_serving(http)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_non_stream_client_timeout_aborts(server: ServerHandle, http: httpx.Client, path: str,
                                          server_errors: list[logging.LogRecord]) -> None:
    body = {"prompt": PROMPT} if path == COMPLETIONS else {"messages": USER_HI}
    steps = []
    for n in (1, 8, 32):  # NOTE: as the streamed twin above: an attempt a loaded machine let run on goes again
        steps_before = server.client.stats().num_steps
        with server.http(timeout_s=0.3) as impatient, pytest.raises(httpx.ReadTimeout):
            impatient.post(path, json=body | LONG | {"n": n})
        server.wait_until_idle(timeout_s=3.0)
        steps.append(server.client.stats().num_steps - steps_before)
        if steps[-1] < LONG["max_tokens"] // 2:  # had it run on, one step per token
            break
    else:
        pytest.fail(f"every attempt ran on after its client timed out (steps {steps})")
    assert not server_errors, [r.getMessage() for r in server_errors]
    assert_still_serving(http)


# -- concurrency -------------------------------------------------------------------------------

def test_concurrent_requests(server: ServerHandle, offline: LLM, tok: Tokenizer) -> None:
    prompts = [f"Request number {i} says" + " more" * (i % 5) for i in range(16)]
    max_tokens = [4 + i % 7 for i in range(16)]

    async def one(client: httpx.AsyncClient, i: int) -> dict[str, Any]:
        body = {"model": MODEL_NAME, "prompt": prompts[i], "max_tokens": max_tokens[i], "temperature": 0,
                "ignore_eos": True}
        if i % 4 == 3:  # a quarter streams
            response = await client.post(COMPLETIONS, json=body | {"stream": True,
                                                                   "stream_options": {"include_usage": True}})
            assert response.status_code == 200
            events = parse_sse(response.text)
            assert events[-1] == DONE
            chunks = [e for e in events[:-1] if isinstance(e, dict)]
            (text, finish), = collect_stream(chunks[:-1], "text").values()
            return {"choices": [{"text": text, "finish_reason": finish}], "usage": chunks[-1]["usage"]}
        response = await client.post(COMPLETIONS, json=body)
        assert response.status_code == 200, response.text
        return response.json()

    async def run_all() -> list[dict[str, Any]]:
        async with server.async_http() as client:
            return await asyncio.gather(*(one(client, i) for i in range(16)))

    start = time.monotonic()
    results = asyncio.run(run_all())
    assert time.monotonic() - start < 30
    for i, body in enumerate(results):
        assert_usage(body, len(tok.encode(prompts[i])), max_tokens[i])
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["choices"][0]["text"] == greedy(offline, prompts[i], max_tokens[i]).outputs[0].text, i


def test_the_api_pages_tokenize_examples_work(server: ServerHandle) -> None:
    """docs/API.md's curl lines for /tokenize and /detokenize, sent as curl sends them (`-d` alone
    is a form's content type: the lines must say JSON)."""
    page = (Path(__file__).parents[1] / "docs" / "API.md").read_text()
    lines = [line for line in page.splitlines() if line.startswith("curl -s localhost:8000/") and "tokenize" in line]
    replies = {}
    for line in lines:
        argv = shlex.split(line, comments=True)
        headers = {"content-type": "application/x-www-form-urlencoded"}  # NOTE: curl's, for -d
        for flag, value in zip(argv, argv[1:], strict=False):
            if flag == "-H":
                name, _, header = value.partition(":")
                headers[name.strip().lower()] = header.strip()
        data = argv[argv.index("-d") + 1]
        path = argv[2].removeprefix("localhost:8000")
        replies[path] = httpx.post(f"{server.base_url}{path}", content=data, headers=headers, timeout=30)
    assert set(replies) == {"/tokenize", "/detokenize"}, lines
    assert all(reply.status_code == 200 for reply in replies.values()), [r.text for r in replies.values()]
    assert replies["/tokenize"].json()["tokens"] == [9707, 1879] and replies["/tokenize"].json()["count"] == 2
    assert replies["/detokenize"].json() == {"prompt": "Hello world"}


def test_a_chat_prompt_over_the_context_names_messages(http: httpx.Client) -> None:
    reply = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a " * MAX_MODEL_LEN}]})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "messages" and "maximum context length" in reply.json()["error"]["message"]
    reply = http.post("/v1/completions", json={"prompt": "a " * MAX_MODEL_LEN})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt", reply.text


def test_a_chat_reply_has_reasoning_content_and_no_empty_tool_calls(http: httpx.Client) -> None:
    """As vLLM's: every whole reply's message has `reasoning_content` (null without reasoning), a
    streamed delta only when it carries some; `tool_calls` only where there are calls (never [])."""
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "ignore_eos": True}
    message = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": message["content"], "reasoning_content": None}
    deltas = [event["choices"][0]["delta"] for event in stream_events(http, "/v1/chat/completions",
                                                                       body | {"stream": True}) if event["choices"]]
    assert deltas and all(set(delta) <= {"role", "content"} for delta in deltas), deltas
