"""Fuzz (issues 16, 32): schemathesis, as its CLI runs for a user (`--checks all`), against the
OpenAPI document of the colocated server and of the PD router: valid and invalid requests from
each route's schema, a fixed example budget and seed, generation bounded (--max-tokens-limit,
which the document states). Whatever arrives: no 5xx, every status and body the document lists
(the OpenAI error envelope on every 4xx), a request the schema calls valid accepted and one it
calls invalid refused, 405 with `Allow` for a method a path does not take, 401 without the key;
afterwards the server is still healthy and no KV block is held on any engine.

tests/schemathesis_hooks.py holds what a JSON Schema cannot say (one field compared with another,
the context window) and the envelope check beyond the schema."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from pd_fixtures import Cluster, start_cluster, stop_cluster
from schemathesis_hooks import PROMPT_BYTES_ENV
from server_fixtures import ServerHandle, start_server

from pdserve.serving.config import ApiConfig

pytestmark = pytest.mark.slow

KEY = "fuzz-key"
# NOTE: small caps keep each generated request cheap on the CPU; the caps' 400s are fuzzed too.
# Tools are served (hermes), so a request with `tools` is a valid one.
API = ApiConfig(api_key=(KEY,), max_tokens_limit=8, max_n=2, max_request_body_bytes=256 << 10,
                tool_call_parser="hermes", enable_auto_tool_choice=True)
_EXAMPLES = 40  # per operation and phase
_SEED = 1
_TIMEOUT_S = 300
# NOTE: the router's context window (pd_fixtures) is the smaller: prompts well inside it
_PROMPT_BYTES = 600


def assert_contract(response: httpx.Response, label: str) -> None:
    assert response.status_code < 500, f"{label}: {response.status_code} {response.text[:500]}"
    if response.status_code >= 400:
        body = response.json()
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"}, f"{label}: {body}"
        assert error["code"] == response.status_code and error["message"], f"{label}: {body}"


def fuzz(base_url: str, report_dir: Path) -> dict[str, Any]:
    """`schemathesis run --checks all` against the server at `base_url`; its JSON report."""
    tests = Path(__file__).parent
    env = os.environ | {"SCHEMATHESIS_HOOKS": "schemathesis_hooks", PROMPT_BYTES_ENV: str(_PROMPT_BYTES),
                        "PYTHONPATH": os.pathsep.join(filter(None, (str(tests), os.environ.get("PYTHONPATH"))))}
    report = report_dir / "report.json"
    argv = [sys.executable, "-m", "schemathesis.cli", "run", f"{base_url}/openapi.json", "--checks", "all",
            "--max-examples", str(_EXAMPLES), "--seed", str(_SEED), "--generation-database", "none",
            "--workers", "1", "--continue-on-failure", "--no-color", "--output-sanitize", "false",
            "--header", f"Authorization: Bearer {KEY}", "--request-timeout", "60",
            "--report", "json", "--report-json-path", str(report)]
    # NOTE: in the report's folder: schemathesis keeps a cache (.schemathesis/) where it runs
    run = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=_TIMEOUT_S, cwd=report_dir)
    assert run.returncode == 0, run.stdout[-20000:] + run.stderr[-5000:]
    with httpx.Client(base_url=base_url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as http:
        assert http.get("/health").status_code == 200
        reply = http.post("/v1/completions", json={"prompt": "still", "max_tokens": 2, "ignore_eos": True})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2, reply.text
    summary: dict[str, Any] = json.loads(report.read_text())
    assert summary["test_cases"]["generated"] > 500, summary["test_cases"]
    for route in ("POST /v1/completions", "POST /v1/chat/completions"):  # NOTE: valid ones reached the engine
        assert summary["valid_rates"][route]["fuzzing"]["accepted"] >= 10, summary["valid_rates"][route]
    return summary


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


def test_fuzz_the_colocated_server(server: ServerHandle, tmp_path: Path) -> None:
    fuzz(server.base_url, tmp_path)
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


def test_fuzz_the_pd_router(cluster: Cluster, tmp_path: Path) -> None:
    fuzz(cluster.router.url, tmp_path)
    cluster.wait_until_idle()
