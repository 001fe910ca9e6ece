"""Fuzz (issue 16): schemathesis generates requests from the OpenAPI schema of the colocated server
and of the PD router, valid ones and invalid ones, with a fixed example budget and a fixed seed
(Hypothesis' derandomize). Whatever arrives: no 5xx, every 4xx in the OpenAI envelope, the server
still healthy afterwards and no KV block held on any engine."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from pd_fixtures import Cluster, start_cluster, stop_cluster
from schemathesis import GenerationMode
from schemathesis.core import NotSet
from schemathesis.schemas import APIOperation
from server_fixtures import ServerHandle, start_server

from pdserve.config import ApiConfig

pytestmark = pytest.mark.slow

KEY = "fuzz-key"
# NOTE: small caps keep each generated request cheap on the CPU; the caps' 400s are fuzzed too
API = ApiConfig(api_key=(KEY,), max_tokens_limit=8, max_n=2, max_request_body_bytes=256 << 10)
_GENERATION_EXAMPLES = 30  # per generation mode, for each operation that runs the engine
_OTHER_EXAMPLES = 5


def _budget(operation: APIOperation) -> int:
    return _GENERATION_EXAMPLES if operation.path.endswith("completions") else _OTHER_EXAMPLES


def assert_contract(response: httpx.Response, label: str) -> None:
    assert response.status_code < 500, f"{label}: {response.status_code} {response.text[:500]}"
    if response.status_code >= 400:
        body = response.json()
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"}, f"{label}: {body}"
        assert error["code"] == response.status_code and error["message"], f"{label}: {body}"


def _send(http: httpx.Client, case: Any) -> httpx.Response:
    headers = {str(k): str(v) for k, v in (case.headers or {}).items() if str(k).lower() != "authorization"}
    body: dict[str, Any] = {}
    if isinstance(case.body, bytes):  # NOTE: negative cases include bodies that are no JSON at all
        body = {"content": case.body}
        headers["Content-Type"] = case.media_type or "application/octet-stream"
    elif not isinstance(case.body, NotSet):
        body = {"json": case.body}
    return http.request(case.method, case.formatted_path, params=case.query or None, headers=headers, **body)


def fuzz(base_url: str, schema: dict[str, Any]) -> int:
    """Every operation of `schema` against the server at `base_url`; returns the requests sent."""
    sent = 0
    with httpx.Client(base_url=base_url, timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as http:
        for result in schemathesis.openapi.from_dict(schema).get_all_operations():
            operation = result.ok()
            for mode in GenerationMode:
                label = f"{mode.value} {operation.label}"

                @settings(max_examples=_budget(operation), derandomize=True, database=None, deadline=None,
                          phases=[Phase.generate], suppress_health_check=list(HealthCheck))
                @given(case=operation.as_strategy(generation_mode=mode))
                def one(case: Any) -> None:
                    nonlocal sent
                    sent += 1
                    assert_contract(_send(http, case), f"{label}: {str(case.body)[:300]}")  # noqa: B023

                try:
                    one()
                except Unsatisfiable:  # NOTE: no invalid request exists for an operation without inputs
                    assert mode is GenerationMode.NEGATIVE, label
        assert http.get("/health").status_code == 200
        reply = http.post("/v1/completions", json={"prompt": "still", "max_tokens": 2, "ignore_eos": True})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2, reply.text
    return sent


@pytest.fixture(scope="module")
def server(model_dirs: dict[str, Path]) -> Iterator[ServerHandle]:
    handle = start_server(model_dirs["tiny"], "tiny-fuzz", api=API, dtype="float32", num_kv_blocks=256)
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def cluster(model_dirs: dict[str, Path]) -> Iterator[Cluster]:
    started = start_cluster(model_dirs["tiny"], "tcp", 1, 1, api=API)
    yield started
    stop_cluster(started)


def test_fuzz_the_colocated_server(server: ServerHandle) -> None:
    schema = httpx.get(f"{server.base_url}/openapi.json").json()
    assert fuzz(server.base_url, schema) > 100
    server.wait_until_idle(timeout_s=10)


def test_fuzz_text_fields_with_any_code_point(server: ServerHandle) -> None:
    """What schema-driven generation never makes (Hypothesis' text leaves out surrogates, which JSON
    can still carry as escapes): prompts, messages, stop strings and model names of any code point."""
    surrogates = st.integers(0xD800, 0xDFFF).map(chr)  # NOTE: st.characters() never yields them
    text = st.text(st.characters() | surrogates, max_size=12)
    bodies = st.one_of(
        st.builds(lambda t, m: ("/v1/completions", {"prompt": t, "model": m}), text, st.none() | text),
        st.builds(lambda t: ("/v1/completions", {"prompt": [t, "ok"], "stop": [t]}), text),
        st.builds(lambda t: ("/v1/chat/completions", {"messages": [{"role": "user", "content": t}], "stop": t}), text))
    with httpx.Client(base_url=server.base_url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as http:

        @settings(max_examples=40, derandomize=True, database=None, deadline=None, phases=[Phase.generate])
        @given(request=bodies)
        def one(request: tuple[str, dict[str, Any]]) -> None:
            path, body = request
            raw = json.dumps(body | {"max_tokens": 1}).encode()  # NOTE: ASCII, surrogates as \\uXXXX escapes
            assert_contract(http.post(path, content=raw, headers={"Content-Type": "application/json"}), raw.decode())

        one()
    server.wait_until_idle(timeout_s=10)


def test_fuzz_the_pd_router(cluster: Cluster) -> None:
    schema = httpx.get(f"{cluster.router.url}/openapi.json").json()
    assert fuzz(cluster.router.url, schema) > 100
    cluster.wait_until_idle()
