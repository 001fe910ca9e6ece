"""Who sends the client key: `pdserve up` hands its router the keys (in the environment, never on a
command line `ps` shows) and its caps, and its supervisor authenticates to that router;
`pdserve bench` sends a key from --api-key or PDSERVE_API_KEY."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import pytest
from server_fixtures import start_server

from pdserve.bench.serve import workloads
from pdserve.bench.serve.client import LoadConfig, run_load
from pdserve.bench.serve.command import load_config
from pdserve.cli import build_parser, up_plan
from pdserve.config_flags import config_from_args
from pdserve.ops import up
from pdserve.serving.config import ApiConfig


def test_up_gives_its_router_the_keys_in_the_environment_and_the_caps_as_flags(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    keys = tmp_path / "keys"
    keys.write_text("from-file\n")
    argv = ["up", "--api-key", "s3cret", "--api-key-file", str(keys), "--max-stop-strings", "5", "--max-n", "3"]
    ns, engine_flags = build_parser().parse_known_args(argv)
    options, router, worker, worker_flags = up_plan(ns, engine_flags)
    commands = up.CommandLines(options, router, worker, tuple(worker_flags), cpus=4)
    spawned = commands("router", 8100, 2)
    assert not any("s3cret" in arg for arg in spawned), spawned
    assert options.router_env() == {"PDSERVE_API_KEY": "s3cret"}
    monkeypatch.setenv("PDSERVE_API_KEY", "s3cret")  # as the router inherits it from up
    child = config_from_args(ApiConfig, build_parser().parse_args(spawned[3:]))
    assert (child.max_stop_strings, child.max_n, child.api_key_file) == (5, 3, str(keys))
    assert child.api_keys() == ("from-file", "s3cret")
    assert options.router_headers == {"Authorization": "Bearer s3cret"}
    for role in ("prefill", "decode"):
        assert not any("s3cret" in arg or "api-key" in arg for arg in commands(role, 9001, 2))


def test_serve_and_router_take_the_api_flags() -> None:
    for command in (["serve"], ["router", "--decode", "http://d", "--prefill", "http://p"]):
        ns = build_parser().parse_args([*command, "--api-key", "a", "--api-key", "b", "--max-request-body-bytes",
                                        "1024", "--max-tokens-limit", "16"])
        config = config_from_args(ApiConfig, ns)
        assert (config.api_key, config.max_request_body_bytes, config.max_tokens_limit) == (("a", "b"), 1024, 16)
        config.validate()


def _bench_namespace(api_key: str | None) -> argparse.Namespace:
    return build_parser().parse_args(["bench", "--url", "http://x", *(["--api-key", api_key] if api_key else [])])


@pytest.mark.slow  # a server
def test_bench_sends_the_key_it_is_given(model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_API_KEY", "from-env")
    assert load_config(_bench_namespace(None), "http://x").api_key == "from-env"
    assert load_config(_bench_namespace("flag"), "http://x").api_key == "flag"
    server = start_server(model_dirs["tiny"], "tiny-bench", api=ApiConfig(api_key=("flag",)), dtype="float32",
                          num_kv_blocks=64)
    try:
        work = workloads.random_lengths(2, 4, 2, seed=1)
        for key, ok in (("flag", True), ("wrong", False)):
            config = LoadConfig(server.base_url, model="tiny-bench", progress=False, api_key=key)
            result = asyncio.run(run_load(work, config))
            assert [record.ok for record in result.records] == [ok, ok], result.records
        server.wait_until_idle()
    finally:
        server.stop()
