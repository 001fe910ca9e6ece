"""A decode worker in gateway mode (worker/gateway.py): it answers the OpenAI API itself, sends the
prefill worker that `x-prefiller-host-port` names a directed job (no router, no queue) over tcp and
nixl, prefills here without the header, and falls back to prefilling here when the named worker is
dead, refuses or does not answer. Every answer equals the offline engine's greedy text; no worker
keeps a block."""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from helpers import random_prompt
from metrics_helpers import scrape
from pd_fixtures import Served, serve
from process_cluster import spawn_worker, wait_healthy
from server_fixtures import free_port, parse_sse

from pdserve import LLM, SamplingParams
from pdserve.config import EngineArgs
from pdserve.disagg.config import WorkerConfig
from pdserve.disagg.transport import nixl_available
from pdserve.disagg.worker.app import Worker, build_worker
from pdserve.disagg.worker.gateway import Gateway, GatewaySetup, install_gateway, prefill_target
from pdserve.disagg.worker.prefill_allow import PrefillAllowlist
from pdserve.engine.async_llm import AsyncLLM
from pdserve.engine.llm_engine import LLMEngine
from pdserve.serving.config import ApiConfig
from pdserve.serving.errors import OpenAIError

pytestmark = pytest.mark.slow  # every test but the header parser's starts two workers

MODEL = "gw-test"
MAX_TOKENS = 8
PROMPTS = [random_prompt(n, seed=7000 + n) for n in (5, 40, 70)]
BODY = {"max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}
_NO_NIXL = pytest.mark.skipif(not nixl_available(), reason="nixl_cu12 is not installed")


@dataclass
class GatewayPair:
    """One prefill worker and one decode worker in gateway mode, each on uvicorn in this process."""

    prefill: Served
    decode: Served
    workers: list[Worker]
    gateway: Gateway

    @property
    def prefill_host_port(self) -> str:
        return self.prefill.url.removeprefix("http://")

    def leaks(self) -> list[str]:
        found = []
        for worker in self.workers:
            assert isinstance(worker.client, AsyncLLM)
            engine = worker.client.engine
            pool = engine.scheduler.kv.pool
            if engine.has_unfinished_requests() or engine.scheduler.held or engine.scheduler.remote:
                found.append(f"{worker.service}: requests left")
            if pool.num_free_blocks != pool.num_blocks:
                found.append(f"{worker.service}: {pool.num_blocks - pool.num_free_blocks} blocks held")
        return found

    def wait_until_idle(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while (leaks := self.leaks()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not leaks, leaks


def _worker(model_dir: Path, role: str, transport: str) -> Worker:
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(model_dir), dtype="float32", num_kv_blocks=256,
                                                   block_size=16, max_num_batched_tokens=64))
    config = WorkerConfig(role=role, kv_transport=transport,  # type: ignore[arg-type]
                          kv_transfer_timeout_ms=5000, gateway_prefill_timeout_s=1.0)
    return build_worker(engine, config, MODEL)


@pytest.fixture(scope="module", params=["tcp", pytest.param("nixl", marks=_NO_NIXL)])
def pair(request: pytest.FixtureRequest, model_dirs: dict[str, Path]) -> Iterator[GatewayPair]:
    transport = request.param
    prefill = _worker(model_dirs["tiny"], "prefill", transport)
    decode = _worker(model_dirs["tiny"], "decode", transport)
    port = free_port()
    assert decode.metrics is not None
    gateway = install_gateway(decode, WorkerConfig(role="decode", gateway_prefill_timeout_s=1.0),
                              GatewaySetup(ApiConfig(), MODEL, f"http://127.0.0.1:{port}"))
    served = GatewayPair(serve(prefill.app), serve(decode.app, port), [prefill, decode], gateway)
    try:
        yield served
    finally:
        for server in (served.decode, served.prefill):
            server.stop()
        for worker in served.workers:
            worker.client.shutdown()
            worker.service.close()


@pytest.fixture(scope="module")
def reference(colocated: LLM) -> list[str]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [out.outputs[0].text for out in colocated.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]


def _completion(http: httpx.Client, prompt: list[int], headers: dict[str, str], stream: bool = False) -> str:
    reply = http.post("/v1/completions", json=BODY | {"prompt": prompt, "stream": stream}, headers=headers)
    assert reply.status_code == 200, reply.text
    if not stream:
        assert reply.json()["usage"]["completion_tokens"] == MAX_TOKENS
        return str(reply.json()["choices"][0]["text"])
    chunks = [e for e in parse_sse(reply.text) if isinstance(e, dict)]
    return "".join(c["choices"][0]["text"] for c in chunks)


def _prompt_tokens(url: str) -> float:
    return scrape(url).value("vllm:prompt_tokens_total")


def test_header_sends_the_job_to_the_named_prefill_worker(pair: GatewayPair, reference: list[str]) -> None:
    headers = {"x-prefiller-host-port": pair.prefill_host_port}
    with httpx.Client(base_url=pair.decode.url, timeout=60) as http:
        for prompt, want in zip(PROMPTS, reference, strict=True):
            for stream in (False, True):
                before = _prompt_tokens(pair.prefill.url)
                assert _completion(http, prompt, headers, stream) == want
                assert _prompt_tokens(pair.prefill.url) - before == len(prompt)
    after = scrape(pair.decode.url)
    assert after.value("pdserve:gateway_directed_prefills_total") >= 2 * len(PROMPTS)
    assert after.value("pdserve:gateway_prefill_fallbacks_total") == 0
    pair.wait_until_idle()


def test_no_header_prefills_here(pair: GatewayPair, reference: list[str]) -> None:
    # NOTE: the picker's and the proxy's other headers are tolerated and change nothing
    headers = {"x-gateway-inference-objective": "premium", "x-gateway-inference-fairness-id": "tenant-a",
               "x-slo-ttft-ms": "200", "x-slo-tpot-ms": "50", "Prefer": "if-available",
               "x-gateway-destination-endpoint": pair.decode.url.removeprefix("http://")}
    with httpx.Client(base_url=pair.decode.url, timeout=60) as http:
        before_prefill = _prompt_tokens(pair.prefill.url)
        before_local = scrape(pair.decode.url).value("pdserve:gateway_local_prefills_total")
        for prompt, want in zip(PROMPTS, reference, strict=True):
            assert _completion(http, prompt, headers) == want
            assert _completion(http, prompt, headers, stream=True) == want
    assert _prompt_tokens(pair.prefill.url) == before_prefill  # the prefill worker computed nothing
    assert scrape(pair.decode.url).value("pdserve:gateway_local_prefills_total") - before_local == 2 * len(PROMPTS)
    pair.wait_until_idle()


def test_chat_with_and_without_the_header(pair: GatewayPair, colocated: LLM) -> None:
    messages = [{"role": "user", "content": "Name three colours."}]
    want = colocated.chat(messages, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    body = {"messages": messages, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}
    with httpx.Client(base_url=pair.decode.url, timeout=60) as http:
        for headers in ({"x-prefiller-host-port": pair.prefill_host_port}, {}):
            reply = http.post("/v1/chat/completions", json=body, headers=headers)
            assert reply.status_code == 200, reply.text
            message = reply.json()["choices"][0]["message"]
            assert (message.get("reasoning_content") or "") + (message["content"] or "") == want[0].outputs[0].text
            streamed = http.post("/v1/chat/completions", json=body | {"stream": True}, headers=headers)
            chunks = [c for c in parse_sse(streamed.text) if isinstance(c, dict) and c["choices"]]
            deltas = [c["choices"][0]["delta"] for c in chunks]
            text = "".join((d.get("reasoning_content") or "") + (d.get("content") or "") for d in deltas)
            assert text == want[0].outputs[0].text
    pair.wait_until_idle()


def test_a_client_that_leaves_early_frees_everything(pair: GatewayPair) -> None:
    """A streamed request whose client goes after its first chunk is aborted here and on the
    prefill worker: no block, no request left on either."""
    body = {"prompt": PROMPTS[2], "max_tokens": 200, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.Client(base_url=pair.decode.url, timeout=60) as http:
        for headers in ({"x-prefiller-host-port": pair.prefill_host_port}, {}):
            with http.stream("POST", "/v1/completions", json=body, headers=headers) as reply:
                assert reply.status_code == 200
                next(reply.iter_lines())
    pair.wait_until_idle()


def test_a_prefill_worker_outside_the_allowlist_is_not_contacted(pair: GatewayPair, reference: list[str]) -> None:
    headers = {"x-prefiller-host-port": pair.prefill_host_port}
    try:
        with httpx.Client(base_url=pair.decode.url, timeout=60) as http:
            pair.gateway.allow = PrefillAllowlist.of(["10.0.0.0/8", "dns:example.invalid"])
            before, tokens = _fallbacks(pair.decode.url, "not_allowed"), _prompt_tokens(pair.prefill.url)
            assert _completion(http, PROMPTS[1], headers) == reference[1]
            assert _fallbacks(pair.decode.url, "not_allowed") - before == 1
            assert _prompt_tokens(pair.prefill.url) == tokens  # never contacted
            pair.gateway.allow = PrefillAllowlist.of(["dns:localhost"])  # what the header names resolves there
            assert _completion(http, PROMPTS[1], headers, stream=True) == reference[1]
            assert _prompt_tokens(pair.prefill.url) - tokens == len(PROMPTS[1])
    finally:
        pair.gateway.allow = None
    pair.wait_until_idle()


class _SilentPeer:
    """A TCP port that accepts connections and never answers (a hung prefill worker)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = int(self.sock.getsockname()[1])
        self.held: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


def _fallbacks(url: str, reason: str) -> float:
    return scrape(url).value("pdserve:gateway_prefill_fallbacks_total", reason=reason)


def test_a_prefill_worker_that_does_not_prefill_is_replaced_by_a_local_prefill(
        pair: GatewayPair, reference: list[str], caplog: pytest.LogCaptureFixture) -> None:
    silent = _SilentPeer()
    dead_port = free_port()  # nothing listens there
    # NOTE: the decode worker itself has no POST /pd/prefill: it refuses the job (404)
    peers = {"unreachable": f"127.0.0.1:{dead_port}", "refused": pair.decode.url.removeprefix("http://"),
             "timeout": f"127.0.0.1:{silent.port}"}
    try:
        with httpx.Client(base_url=pair.decode.url, timeout=60) as http, caplog.at_level(logging.WARNING):
            for reason, peer in peers.items():
                before = _fallbacks(pair.decode.url, reason)
                prefill_before = _prompt_tokens(pair.prefill.url)
                for stream in (False, True):
                    assert _completion(http, PROMPTS[1], {"x-prefiller-host-port": peer}, stream) == reference[1]
                assert _fallbacks(pair.decode.url, reason) - before == 2, reason
                assert _prompt_tokens(pair.prefill.url) == prefill_before
                # logged once for the peer, not once per request
                assert sum(peer.split(":")[-1] in r.getMessage() and "x-prefiller-host-port" in r.getMessage()
                           for r in caplog.records) == 1, reason
    finally:
        silent.close()
    pair.wait_until_idle()


@pytest.mark.parametrize("value", ["nonsense", "10.0.0.7", "10.0.0.7:", "10.0.0.7:99999", "10.0.0.7:http", "",
                                   "10.0.0.7:8000,bad host"])
def test_a_malformed_header_is_a_400(pair: GatewayPair, value: str) -> None:
    with httpx.Client(base_url=pair.decode.url, timeout=60) as http:
        for path, body in (("/v1/completions", BODY | {"prompt": PROMPTS[0]}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                     "stream": True})):
            reply = http.post(path, json=body, headers={"x-prefiller-host-port": value})
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert error["code"] == 400 and error["type"] == "invalid_request_error" and error["param"] == \
                "x-prefiller-host-port" and "HOST:PORT" in error["message"]
    pair.wait_until_idle()


@pytest.mark.parametrize(("values", "want"), [
    ((), None), (("10.0.0.7:8000",), "http://10.0.0.7:8000"), ((" 10.0.0.7:8000 ",), "http://10.0.0.7:8000"),
    (("[fd00::7]:8000",), "http://[fd00::7]:8000"), (("p-0.prefill:8200",), "http://p-0.prefill:8200"),
    # NOTE: llm-d's sidecar takes candidates comma-separated or repeated, and uses the first
    (("10.0.0.7:8000,10.0.0.8:8000",), "http://10.0.0.7:8000"), (("10.0.0.8:8000", "10.0.0.7:8000"),
                                                                 "http://10.0.0.8:8000"),
])
def test_the_header_names_a_prefill_worker(values: tuple[str, ...], want: str | None) -> None:
    target = prefill_target(values)
    assert (target and target.url) == want


def test_the_header_parser_refuses_what_is_no_host_port() -> None:
    for value in ("", ",", "10.0.0.7", "10.0.0.7:0", "10.0.0.7:65536", "http://10.0.0.7:8000", "a b:1"):
        with pytest.raises(OpenAIError) as raised:
            prefill_target((value,))
        assert raised.value.status == 400



def test_pdserve_serve_decode_is_a_gateway_with_a_cluster_secret(model_dirs: dict[str, Path], reference: list[str],
                                                                  tmp_path: Path) -> None:
    """`pdserve serve --role decode` (an engine process, the cluster secret set): the header's job is
    signed and taken."""
    secret = {"PDSERVE_CLUSTER_SECRET": "gateway-test-secret-0123456789abcdef"}
    prefill = spawn_worker("prefill", model_dirs["tiny"], tmp_path, [], env=secret)
    decode = spawn_worker("decode", model_dirs["tiny"], tmp_path, [], env=secret)
    try:
        wait_healthy([prefill, decode])
        headers = {"x-prefiller-host-port": prefill.url.removeprefix("http://")}
        with httpx.Client(base_url=decode.url, timeout=60) as http:
            before = _prompt_tokens(prefill.url)
            assert _completion(http, PROMPTS[2], headers) == reference[2]
            assert _completion(http, PROMPTS[2], headers, stream=True) == reference[2]
            assert _prompt_tokens(prefill.url) - before == 2 * len(PROMPTS[2])
            assert _completion(http, PROMPTS[0], {}) == reference[0]
            assert _prompt_tokens(prefill.url) - before == 2 * len(PROMPTS[2])
            assert scrape(decode.url).value("pdserve:gateway_prefill_fallbacks_total") == 0
    finally:
        for worker in (prefill, decode):
            worker.kill(signal.SIGTERM)
        for worker in (prefill, decode):
            worker.popen.wait(timeout=30)


def test_the_allowlist_takes_addresses_networks_and_names() -> None:
    import asyncio

    async def permits(entries: list[str], host: str) -> bool:
        allow = PrefillAllowlist.of(entries)
        assert allow is not None
        return await allow.permits(host)

    assert asyncio.run(permits(["10.0.0.0/8"], "10.1.2.3"))
    assert not asyncio.run(permits(["10.0.0.0/8"], "11.1.2.3"))
    assert asyncio.run(permits(["fd00::/8", "192.168.0.7"], "fd00::7"))
    assert asyncio.run(permits(["dns:localhost"], "127.0.0.1"))
    assert asyncio.run(permits(["127.0.0.0/8"], "localhost"))  # a name in the header: its addresses
    assert not asyncio.run(permits(["127.0.0.0/8"], "no-such-host.invalid"))
    assert PrefillAllowlist.of([]) is None
    with pytest.raises(ValueError, match="gateway-prefill-allow"):
        WorkerConfig(gateway_prefill_allow=("10.0.0.0/33",)).validate()
    with pytest.raises(ValueError, match="gateway-prefill-allow"):
        WorkerConfig(gateway_prefill_allow=("dns:",)).validate()
