"""The whole OpenAI surface through the official `openai` SDK, against a colocated server and the
PD router (an in-process cluster: one prefill and one decode worker over TCP): n > 1 and logprobs
give the same answers on both, reasoning and tool calls are read (streamed and not) from answers
forced token by token through the sampler, and the utility routes work on both."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import httpx
import openai
import pytest
from pd_fixtures import MODEL, Cluster, start_cluster, stop_cluster
from server_fixtures import ServerHandle, start_server

from pdserve.disagg.control import FrameEncoder
from pdserve.disagg.worker.decode_service import DecodeService
from pdserve.disagg.worker.prefill_service import PrefillService
from pdserve.engine.request import Request
from pdserve.engine.sampler import Sampler, SampleResult
from pdserve.serving.config import ApiConfig
from pdserve.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow  # a server and a cluster

API = ApiConfig(reasoning_parser="qwen3", enable_auto_tool_choice=True, tool_call_parser="hermes")
PROMPT = "The quick brown fox jumps over the lazy dog, then it runs far away into the green forest"
IM_END = 151645


@pytest.fixture(scope="module")
def servers(model_dirs: dict[str, Path]) -> Iterator[tuple[ServerHandle, Cluster]]:
    # NOTE: in-process: `forced` patches the sampler of every engine in this process
    colocated = start_server(model_dirs["tiny"], MODEL, api=API, in_process=True, dtype="float32", num_kv_blocks=256)
    cluster = start_cluster(model_dirs["tiny"], "tcp", 1, 1, api=API)
    yield colocated, cluster
    stop_cluster(cluster)
    colocated.stop()


@pytest.fixture
def clients(servers: tuple[ServerHandle, Cluster]) -> Iterator[list[openai.OpenAI]]:
    colocated, cluster = servers
    made = [openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
            for url in (colocated.base_url, cluster.router.url)]
    yield made
    colocated.wait_until_idle()
    cluster.wait_until_idle()


@contextmanager
def forced(token_ids: list[int]) -> Iterator[None]:
    """Every engine in this process (colocated, prefill, decode) samples `token_ids` in order: a
    request's k-th output token is token_ids[k], whatever the model says."""
    sample = Sampler.__call__

    def scripted(self: Sampler, logits: Any, requests: list[Request]) -> SampleResult:
        result = sample(self, logits, requests)
        return SampleResult([token_ids[min(r.num_output_tokens, len(token_ids) - 1)] for r in requests],
                            result.logprobs)

    with mock.patch.object(Sampler, "__call__", scripted):
        yield


def answer_ids(model_dir: Path, text: str) -> list[int]:
    return load_tokenizer(str(model_dir)).encode(text) + [IM_END]


def on_both(clients: list[openai.OpenAI], call: Callable[[openai.OpenAI], Any]) -> list[Any]:
    return [call(client) for client in clients]


def test_n_seeded_choices_are_the_same_and_the_prompt_is_prefilled_once(
        clients: list[openai.OpenAI], servers: tuple[ServerHandle, Cluster]) -> None:
    prefill = servers[1].service(PrefillService).client.engine
    before = prefill.stats().num_prefill_tokens
    colocated, routed = on_both(clients, lambda c: c.completions.create(
        model=MODEL, prompt=PROMPT, n=3, seed=7, temperature=1.0, max_tokens=6, extra_body={"ignore_eos": True}))
    texts = [c.text for c in sorted(colocated.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(routed.choices, key=lambda c: c.index)]
    assert len(set(texts)) == 3, texts  # three sequences, not one three times
    assert prefill.stats().num_prefill_tokens - before == routed.usage.prompt_tokens  # one hand-off for all three
    assert routed.usage.completion_tokens == 18


def test_logprobs_match_on_completions_and_chat(clients: list[openai.OpenAI]) -> None:
    colocated, routed = on_both(clients, lambda c: c.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3, presence_penalty=0.5,
        extra_body={"ignore_eos": True, "min_tokens": 2, "repetition_penalty": 1.2, "stop_token_ids": [IM_END]}))
    a, b = colocated.choices[0], routed.choices[0]
    assert a.text == b.text and a.logprobs.tokens == b.logprobs.tokens
    assert a.logprobs.token_logprobs == pytest.approx(b.logprobs.token_logprobs, abs=1e-5)
    assert [sorted(t) for t in a.logprobs.top_logprobs] == [sorted(t) for t in b.logprobs.top_logprobs]
    chats = on_both(clients, lambda c: c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], n=2, seed=3, max_tokens=4, logprobs=True,
        top_logprobs=2, extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}}))
    for x, y in zip(*(sorted(r.choices, key=lambda c: c.index) for r in chats), strict=True):
        assert x.message.content == y.message.content
        xs, ys = x.logprobs.content, y.logprobs.content
        assert [t.token for t in xs] == [t.token for t in ys]
        assert [t.logprob for t in xs] == pytest.approx([t.logprob for t in ys], abs=1e-5)
        assert [[u.token for u in t.top_logprobs] for t in xs] == [[u.token for u in t.top_logprobs] for t in ys]


def test_streamed_n_with_logprobs_matches_the_whole_answer(clients: list[openai.OpenAI]) -> None:
    request = {"model": MODEL, "prompt": PROMPT, "n": 2, "seed": 5, "max_tokens": 5, "logprobs": 1,
               "extra_body": {"ignore_eos": True}}
    whole = clients[1].completions.create(**request)
    texts, logprobs = ["", ""], [[], []]
    for chunk in clients[1].completions.create(stream=True, **request):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            logprobs[choice.index] += choice.logprobs.token_logprobs if choice.logprobs else []
    for choice in whole.choices:
        assert texts[choice.index] == choice.text
        assert logprobs[choice.index] == pytest.approx(choice.logprobs.token_logprobs, abs=1e-5)


def test_reasoning_is_split_streamed_and_not(clients: list[openai.OpenAI], model_dirs: dict[str, Path]) -> None:
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    with forced(answer_ids(model_dirs["tiny"], "<think>\nTwo plus two.\n</think>\n\nIt is 4.")):
        for client in clients:
            whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40)
            message = whole.choices[0].message
            assert (message.reasoning_content, message.content) == ("\nTwo plus two.\n", "\n\nIt is 4.")
            reasoning, content = "", ""
            for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, stream=True):
                delta = chunk.choices[0].delta if chunk.choices else None
                reasoning += getattr(delta, "reasoning_content", None) or ""
                content += (delta.content or "") if delta else ""
            assert (reasoning, content) == ("\nTwo plus two.\n", "\n\nIt is 4.")
            off = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40,
                                                 extra_body={"chat_template_kwargs": {"enable_thinking": False}})
            assert off.choices[0].message.content == "<think>\nTwo plus two.\n</think>\n\nIt is 4."


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def tool_round_trip(client: openai.OpenAI, model_dir: Path, stream: bool) -> str:
    """Request with tools -> a call -> the tool's answer -> the final answer (SDK's own accumulator)."""
    messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    request = {"model": MODEL, "tools": [WEATHER], "max_tokens": 60,
               "extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}

    def ask() -> Any:
        if not stream:
            return client.chat.completions.create(messages=messages, **request).choices[0]
        with client.chat.completions.stream(messages=messages, **request) as events:
            return events.get_final_completion().choices[0]

    with forced(answer_ids(model_dir, CALL)):
        first = ask()
    assert first.finish_reason == "tool_calls" and first.message.content is None
    (call,) = first.message.tool_calls
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
                 {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny"}'}]
    with forced(answer_ids(model_dir, "It is sunny in Paris.")):
        final = ask()
    assert final.finish_reason == "stop" and not final.message.tool_calls
    return str(final.message.content)


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_round_trip(clients: list[openai.OpenAI], model_dirs: dict[str, Path], stream: bool) -> None:
    for client in clients:
        assert tool_round_trip(client, model_dirs["tiny"], stream) == "It is sunny in Paris."


def test_tool_results_are_rendered_into_the_next_prompt(servers: tuple[ServerHandle, Cluster]) -> None:
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    for url in (servers[0].base_url, servers[1].router.url):
        reply = httpx.post(f"{url}/tokenize", json={"messages": messages, "tools": [WEATHER]}, timeout=30).json()
        text = httpx.post(f"{url}/detokenize", json={"tokens": reply["tokens"]}, timeout=30).json()["prompt"]
        assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
        assert f"<|im_start|>assistant\n{CALL}<|im_end|>" in text
        assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in text


def test_malformed_calls_are_content_and_bad_tools_a_400(clients: list[openai.OpenAI],
                                                         model_dirs: dict[str, Path]) -> None:
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>'
    with forced(answer_ids(model_dirs["tiny"], broken)):
        for client in clients:
            choice = client.chat.completions.create(model=MODEL, tools=[WEATHER], max_tokens=40, messages=[
                {"role": "user", "content": "Hi"}], extra_body={"chat_template_kwargs": {"enable_thinking": False}}
            ).choices[0]
            assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (broken, None, "stop")
    for client in clients:
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                           tools=[{"type": "function", "function": {"name": "bad name!"}}])
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], tools=[WEATHER],
                                           tool_choice={"type": "function", "function": {"name": "other"}})
        assert refused.value.status_code == 400 and "not among" in str(refused.value)


def test_utility_routes_and_cached_tokens(clients: list[openai.OpenAI], servers: tuple[ServerHandle, Cluster]) -> None:
    for url, client in zip((servers[0].base_url, servers[1].router.url), clients, strict=True):
        tokens = httpx.post(f"{url}/tokenize", json={"prompt": PROMPT}, timeout=30).json()
        assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] > tokens["count"]
        assert httpx.post(f"{url}/detokenize", json={"tokens": tokens["tokens"]}, timeout=30).json() == {
            "prompt": PROMPT}
        assert httpx.post(f"{url}/detokenize", json={"tokens": [10**9]}, timeout=30).status_code == 400
        assert httpx.get(f"{url}/version", timeout=30).json()["version"]
        (card,) = client.models.list().data
        assert card.id == MODEL and card.max_model_len and card.root  # type: ignore[attr-defined]
        long_prompt = PROMPT * 3
        for _ in range(2):
            usage = client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=1).usage
        assert usage.prompt_tokens_details.cached_tokens >= 16  # type: ignore[union-attr]


def post_both(servers: tuple[ServerHandle, Cluster], path: str, body: dict[str, Any]) -> list[httpx.Response]:
    return [httpx.post(f"{url}{path}", json={"model": MODEL} | body, timeout=60)
            for url in (servers[0].base_url, servers[1].router.url)]


def assert_same_prompt_logprobs(a: list[dict[str, Any] | None], b: list[dict[str, Any] | None]) -> None:
    assert len(a) == len(b) and a[0] is None and b[0] is None
    for x, y in zip(a[1:], b[1:], strict=True):
        assert x is not None and y is not None and x.keys() == y.keys()
        for token in x:
            assert (x[token]["rank"], x[token]["decoded_token"]) == (y[token]["rank"], y[token]["decoded_token"])
            assert x[token]["logprob"] == pytest.approx(y[token]["logprob"], abs=1e-5)


def assert_same_logprobs(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert (a["tokens"], a["text_offset"]) == (b["tokens"], b["text_offset"])
    assert a["token_logprobs"] == pytest.approx(b["token_logprobs"], abs=1e-5)
    assert [t and sorted(t) for t in a["top_logprobs"]] == [t and sorted(t) for t in b["top_logprobs"]]


def decode_hand_offs(cluster: Cluster) -> tuple[int, int]:
    """(hand-offs whose KV arrived whole, prompts recomputed on decode) so far."""
    stats = cluster.service(DecodeService).stats()
    return stats.completed, stats.recomputed + stats.prefilled_locally


@pytest.mark.parametrize("logprobs", [None, 2], ids=["first-token-from-prefill", "first-token-resampled"])
def test_prompt_logprobs_and_echo_through_the_router_equal_colocated(
        servers: tuple[ServerHandle, Cluster], logprobs: int | None) -> None:
    """The prefill worker computes the prompt's logprobs; they ride its final KV message to decode
    and the first output frame to the router: no prompt is recomputed on decode."""
    completed, recomputed = decode_hand_offs(servers[1])
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "prompt_logprobs": 3, "echo": True,
            "logprobs": logprobs, "n": 1 if logprobs is None else 2, "seed": 1, "ignore_eos": True}
    colocated, routed = (r.json() for r in post_both(servers, "/v1/completions", body))
    assert decode_hand_offs(servers[1]) == (completed + 1, recomputed)
    assert len(colocated["choices"]) == len(routed["choices"]) == body["n"]
    for a, b in zip(colocated["choices"], routed["choices"], strict=True):
        assert a["text"] == b["text"] and a["text"].startswith(PROMPT)
        assert len(a["prompt_logprobs"]) == colocated["usage"]["prompt_tokens"]
        assert_same_prompt_logprobs(a["prompt_logprobs"], b["prompt_logprobs"])
        if logprobs is None:
            assert a["logprobs"] is None and b["logprobs"] is None
        else:
            assert_same_logprobs(a["logprobs"], b["logprobs"])


def streamed(response: httpx.Response) -> list[dict[str, Any]]:
    lines = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_streamed_echo_leads_with_the_prompt_on_both(servers: tuple[ServerHandle, Cluster]) -> None:
    body = {"prompt": [PROMPT, "Hello there"], "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1,
            "ignore_eos": True}
    wholes = [r.json()["choices"] for r in post_both(servers, "/v1/completions", body)]
    for whole, reply in zip(wholes, post_both(servers, "/v1/completions", body | {"stream": True}), strict=True):
        assert reply.status_code == 200, reply.text
        chunks = [c["choices"][0] for c in streamed(reply)]
        for choice in whole:
            mine = [c for c in chunks if c["index"] == choice["index"]]
            prompt = [PROMPT, "Hello there"][choice["index"]]
            assert mine[0]["text"].startswith(prompt) and "".join(c["text"] for c in mine) == choice["text"]
            joined = {key: [v for c in mine for v in c["logprobs"][key]] for key in choice["logprobs"]}
            assert_same_logprobs(joined, choice["logprobs"])
    assert_same_logprobs(wholes[0][0]["logprobs"], wholes[1][0]["logprobs"])
    plain = post_both(servers, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "echo": True, "stream": True})
    assert all(streamed(r)[0]["choices"][0]["text"].startswith(PROMPT) for r in plain)


def test_chat_prompt_logprobs_on_both(servers: tuple[ServerHandle, Cluster]) -> None:
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3, "temperature": 0,
            "prompt_logprobs": 2, "chat_template_kwargs": {"enable_thinking": False}}
    colocated, routed = (r.json() for r in post_both(servers, "/v1/chat/completions", body))
    assert colocated["choices"][0]["message"] == routed["choices"][0]["message"]
    assert len(colocated["prompt_logprobs"]) == colocated["usage"]["prompt_tokens"]
    assert_same_prompt_logprobs(colocated["prompt_logprobs"], routed["prompt_logprobs"])
    plain = post_both(servers, "/v1/chat/completions", body | {"prompt_logprobs": None})
    assert all("prompt_logprobs" not in r.json() for r in plain)


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": -1}),
    ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 21}),
    ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 1, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "prompt_logprobs": -1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "prompt_logprobs": 2, "stream": True}),
])
def test_bad_prompt_logprobs_are_a_400_on_both(servers: tuple[ServerHandle, Cluster], path: str,
                                               body: dict[str, Any]) -> None:
    for reply in post_both(servers, path, body):
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["type"] == "invalid_request_error"


def test_a_decode_worker_that_does_not_send_the_prompt_logprobs_is_a_502(servers: tuple[ServerHandle, Cluster]) -> None:
    """(A decode worker of an older version would not: a 502 in the envelope, not a 500 or a silent gap.)"""
    frame = FrameEncoder.frame
    with mock.patch.object(FrameEncoder, "frame",
                           lambda self, output: frame(self, dataclasses.replace(output, prompt_logprobs=None))):
        reply = httpx.post(f"{servers[1].router.url}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 1})
    assert reply.status_code == 502 and "prompt's logprobs" in reply.json()["error"]["message"]
