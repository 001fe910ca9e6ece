"""The command line: flags generated from the configs (config_flags.py) and read back into them; what
`pdserve up` hands its processes parses into the same configs; `pdserve serve` as a real process."""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest
from server_fixtures import free_port

from pdserve.cli import UP_SETS_ROUTER, UP_SETS_WORKER, build_parser, main, up_plan
from pdserve.config import EngineArgs, knob
from pdserve.config_flags import add_config_args, config_from_args, flag_name, to_argv
from pdserve.disagg.config import QueueArgs, RouterConfig, WorkerConfig
from pdserve.ops import up
from pdserve.ops.autoscale import AutoscaleConfig


@dataclasses.dataclass(frozen=True, slots=True)
class _Inner:
    depth_s: float = knob(1.5, "nested")


@dataclasses.dataclass(frozen=True, slots=True)
class _Sample:
    name: str | None = knob(None, "optional text")
    count: int = knob(3, "a number")
    mode: Literal["a", "b"] = knob("a", "choices")
    on: bool = knob(True, "a switch")
    urls: tuple[str, ...] = knob((), "several")
    sizes: tuple[int, ...] = knob((1, 2), "several numbers")
    size: str | int | None = knob(None, "text or number: read as text")
    inner: _Inner = dataclasses.field(default_factory=_Inner)


def _parse(cls: type[Any], argv: list[str], **add: Any) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_config_args(parser, cls, **add)
    return parser.parse_args(argv)


def test_each_type_maps_to_its_flag_and_back() -> None:
    ns = _parse(_Sample, ["--name", "x", "--count", "4", "--mode", "b", "--no-on", "--urls", "u", "v",
                          "--sizes", "5", "--size", "2GiB", "--depth-s", "0.5"])
    assert config_from_args(_Sample, ns) == _Sample("x", 4, "b", False, ("u", "v"), (5,), "2GiB", _Inner(0.5))
    ns = _parse(_Sample, ["--sizes", "5", "--sizes", "6", "7"])  # repeated: the uses add up, not the default
    assert config_from_args(_Sample, ns).sizes == (5, 6, 7)
    assert config_from_args(_Sample, _parse(_Sample, [])) == _Sample()
    with pytest.raises(SystemExit):
        _parse(_Sample, ["--mode", "c"])
    with pytest.raises(SystemExit):
        _parse(_Sample, [], required=("urls",))


def test_to_argv_rebuilds_the_config() -> None:
    config = _Sample("x", 4, "b", False, ("u", "v"), (5,), "2GiB", _Inner(0.5))
    assert config_from_args(_Sample, _parse(_Sample, to_argv(config))) == config
    assert config_from_args(_Sample, _parse(_Sample, to_argv(_Sample()))) == _Sample()
    assert "--urls" not in to_argv(_Sample()) and "--name" not in to_argv(_Sample())
    with pytest.raises(ValueError, match="sizes"):
        to_argv(_Sample(sizes=()))  # an empty tuple is no flag, and () is not the default


def test_selection_and_overrides() -> None:
    ns = _parse(_Sample, ["--count", "7"], only=("count", "mode"))
    assert not hasattr(ns, "on")
    assert config_from_args(_Sample, ns, mode="b") == _Sample(count=7, mode="b")
    with pytest.raises(ValueError, match="no field"):
        _parse(_Sample, [], exclude=("nope",))


def _subcommand(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


@pytest.mark.parametrize(("command", "cls", "skipped"), [
    ("serve", EngineArgs, ()), ("serve", WorkerConfig, ("role", "queue")), ("serve", QueueArgs, ()),
    ("router", RouterConfig, ("queue",)), ("router", QueueArgs, ()),
    ("up", RouterConfig, ("queue", *UP_SETS_ROUTER)), ("up", WorkerConfig, ("queue", *UP_SETS_WORKER)),
    ("up", QueueArgs, ()), ("up", AutoscaleConfig, ()),
])
def test_every_config_field_is_a_flag_with_the_field_default(command: str, cls: type[Any],
                                                             skipped: tuple[str, ...]) -> None:
    actions = {a.dest: a for a in _subcommand(command)._actions}
    defaults = cls()
    for field in dataclasses.fields(cls):
        if field.name in skipped:
            continue
        action = actions[field.name]
        assert flag_name(field.name) in action.option_strings
        assert action.required or action.default == getattr(defaults, field.name), field.name
        assert action.help, f"{field.name} has no help"


def test_commands_build_their_configs() -> None:
    ns = build_parser().parse_args(["router", "--decode", "http://d", "--decode-policy", "round-robin",
                                    "--queue", "redis://r:6379/0", "--max-resumes", "5"])
    assert config_from_args(RouterConfig, ns) == RouterConfig(
        decode=("http://d",), decode_policy="round-robin", queue=QueueArgs("redis://r:6379/0"), max_resumes=5)
    ns = build_parser().parse_args(["router", "--decode", "http://a", "http://b", "--decode", "dns:c:80"])
    assert config_from_args(RouterConfig, ns).decode == ("http://a", "http://b", "dns:c:80")  # repeatable
    ns = build_parser().parse_args(["serve", "--role", "prefill", "--kv-transfer-timeout-ms", "250",
                                    "--no-enable-prefix-caching", "--preemption-mode", "swap"])
    assert config_from_args(WorkerConfig, ns, role=ns.role) == WorkerConfig(role="prefill", kv_transfer_timeout_ms=250)
    assert config_from_args(EngineArgs, ns) == EngineArgs(enable_prefix_caching=False, preemption_mode="swap")



@pytest.mark.parametrize(("argv", "message"), [
    (["router"], "the router needs decode workers"),
    (["router", "--prefill", "dns:p:80", "--decode", "dns:decode"], "expected dns:NAME:PORT"),
    (["router", "--prefill", "dns:p:80", "--decode", "decode:8000"], "a worker is a URL like http://host:port"),
    (["router", "--prefill", "dns:p:80", "--decode", "dns:d:80", "--dns-server", "x:99999"], "port out of range"),
])
def test_router_refuses_a_pool_it_cannot_build(argv: list[str], message: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_up_hands_every_process_the_configs_it_was_given() -> None:
    """What `up` writes on each command line parses, in that process, into `up`'s own configs:
    up, serve and router cannot drift apart. Workers register with the router, which gets no URLs."""
    argv = ["up", "--prefill", "2", "--queue", "redis://r:6379/0", "--pd-threshold", "64", "--kv-transport", "tcp",
            "--kv-failure-policy", "fail", "--max-num-seqs", "4", "--port", "8100", "--kv-cache-dtype", "bfloat16",
            "--decode-kv-cache-dtype", "float32"]
    ns, engine_flags = build_parser().parse_known_args(argv)
    options, router, worker, worker_flags = up_plan(ns, engine_flags)
    commands = up.CommandLines(options, router, worker, tuple(worker_flags), cpus=4)
    for role in ("decode", "prefill"):
        spawned = commands(role, 9001, 3)
        assert spawned[:3] == [sys.executable, "-m", "pdserve.cli"]
        child = build_parser().parse_args(spawned[3:])
        assert config_from_args(WorkerConfig, child, role=child.role) == dataclasses.replace(worker, role=role)
        assert (child.role, child.port, child.max_num_seqs, child.num_threads) == (role, 9001, 4, 1)
        assert child.kv_cache_dtype == {"prefill": "bfloat16", "decode": "float32"}[role]  # per role over all
    child = build_parser().parse_args(commands("router", 8100, 3)[3:])
    assert config_from_args(RouterConfig, child) == router and child.port == 8100
    assert router.prefill == router.decode == () and router.accept_registrations
    assert router.queue.queue == "redis://r:6379/0" and worker.register == ("http://127.0.0.1:8100",)
    assert options.supervisor_port == 8101 and options.prefill == up.Replicas(2, 2)


@pytest.mark.parametrize(("extra", "bind"), [([], "127.0.0.1"), (["--host", "0.0.0.0"], "*"),
                                            (["--prefill-policy", "kv-events", "--decode-policy", "least-loaded"],
                                             "127.0.0.1")])
def test_up_routing_by_kv_events_has_its_workers_publish_them(extra: list[str], bind: str) -> None:
    """`--decode-policy kv-events` (or the prefill one) with no --kv-events-config: every worker
    publishes on free ports of the address it serves on; a given config is left as it is."""
    argv = ["up", "--decode-policy", "kv-events", *extra]
    ns, engine_flags = build_parser().parse_known_args(argv)
    options, router, worker, worker_flags = up_plan(ns, engine_flags)
    child = build_parser().parse_args(up.CommandLines(options, router, worker, tuple(worker_flags), cpus=4)(
        "decode", 9001, 1)[3:])
    assert json.loads(child.kv_events_config) == {"enable_kv_cache_events": True, "publisher": "zmq",
                                                  "endpoint": f"tcp://{bind}:0", "replay_endpoint": f"tcp://{bind}:0"}
    given = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}'
    ns, engine_flags = build_parser().parse_known_args([*argv, "--kv-events-config", given])
    assert up_plan(ns, engine_flags)[3].count("--kv-events-config") == 1
    ns, engine_flags = build_parser().parse_known_args(["up"])
    assert "--kv-events-config" not in up_plan(ns, engine_flags)[3]


def test_up_refuses_bad_flags_before_starting_anything(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["up", "--prefill", "1:3", "--decode", "2"])
    assert exit_.value.code == 2 and "a MIN:MAX range needs --autoscale" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["up", "--decode", "3:1"])
    assert "expected 0 < MIN <= MAX" in capsys.readouterr().err
    # what would fail in every process fails here, before anything starts
    assert main(["up", "--model", "/nonexistent"]) == 2
    assert "/nonexistent/config.json not found" in capsys.readouterr().err
    assert main(["up", "--autoscale", "--decode-running-low", "20"]) == 2
    assert "decode_running_low" in capsys.readouterr().err


def _serve_command(model_dir: Path, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "pdserve.cli", "--log-level", "WARNING", "serve", "--model", str(model_dir),
            "--port", str(port), "--num-kv-blocks", "64", "--dtype", "float32", "--num-threads", "1", *extra]


def _wait_healthy(process: subprocess.Popen[str], http: httpx.Client, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert process.poll() is None, process.communicate()[0]
        try:
            if http.get("/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "pdserve serve did not come up"
        time.sleep(0.2)


@pytest.mark.slow
def test_cli_serve_starts_serves_and_stops_on_sigint(model_dirs: dict[str, Path]) -> None:
    port = free_port()
    process = subprocess.Popen(_serve_command(model_dirs["tiny"], port, "--served-model-name", "cli-model",
                                              "--max-model-len", "256"),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as cli_http:
            _wait_healthy(process, cli_http)
            cards = cli_http.get("/v1/models").json()["data"]
            assert [(c["id"], c["max_model_len"]) for c in cards] == [("cli-model", 256)]
            body = cli_http.post("/v1/completions", json={"model": "cli-model", "prompt": "The capital of France is",
                                                          "max_tokens": 3, "ignore_eos": True}).json()
            assert body["usage"]["completion_tokens"] == 3
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=60)
        assert process.returncode == 0, output
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


@pytest.mark.slow
def test_cli_serve_rejects_bad_engine_args(model_dirs: dict[str, Path]) -> None:
    result = subprocess.run(_serve_command(model_dirs["tiny"], free_port(), "--max-model-len", "99999999"),
                            capture_output=True, text=True, timeout=120)  # NOTE: generous: loaded 2-core CI
    assert result.returncode == 2
    assert "max_model_len" in result.stderr and "Traceback" not in result.stderr
