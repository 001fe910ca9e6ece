"""Hostile peers against a cluster that runs with a cluster secret (disagg/auth.py): an
unauthenticated client, a peer without the secret on /pd/* and on the KV port, a peer with the
secret but a wrong reservation token, a final message with a first token outside the vocabulary,
1,000 idle KV connections, a prefill job that names an address no router chose. Each is refused,
and the cluster still serves a request afterwards with nothing left behind.

One in-process cluster (pd_fixtures: 1 prefill + 1 decode over tcp, router with a client key)
serves the whole module."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
from pd_fixtures import Cluster, start_cluster, stop_cluster

from pdserve.disagg.auth import (
    HEADER_NONCE,
    HEADER_SIGNATURE,
    HEADER_TIMESTAMP,
    ClusterSecret,
    NonceCache,
    SignedRequests,
    sign_job,
)
from pdserve.disagg.client import WorkerClient
from pdserve.disagg.control import FrameDecoder, PrefillJob, ReserveRequest, WireSamplingParams
from pdserve.disagg.handoff import HandOffDone
from pdserve.disagg.kv_layout import KVLayout
from pdserve.disagg.transport import KVTransferError, make_receiver, make_sender, nixl_available
from pdserve.disagg.transport.errors import KVAuthError
from pdserve.disagg.transport.handshake import KVPeerPolicy
from pdserve.disagg.transport.tcp import TcpKVReceiver
from pdserve.disagg.worker.decode_service import DecodeService
from pdserve.disagg.worker.sender_pool import PoolSettings, SenderPool
from pdserve.engine.sampling_params import SamplingParams
from pdserve.serving.config import ApiConfig

pytestmark = pytest.mark.slow  # the module starts a cluster (threads), ~10 s in all

SECRET = "s3cret-of-this-cluster-" + "x" * 16
OTHER = ClusterSecret(b"another-cluster-secret-0123456789")
KEY = "client-key"
PROMPT = list(range(5, 45))  # 40 tokens: past the pd threshold, so prefill hands off over the KV port


@pytest.fixture(scope="module")
def cluster(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    path = tmp_path_factory.mktemp("secret") / "cluster-secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o600)
    c = start_cluster(model_dirs["tiny"], "tcp", 1, 1, api=ApiConfig(api_key=(KEY,)),
                      worker_options={"cluster_secret_file": str(path)}, cluster_secret_file=str(path))
    try:
        yield c
    finally:
        stop_cluster(c)


def secret() -> ClusterSecret:
    return ClusterSecret(SECRET.encode())


def urls(cluster: Cluster) -> tuple[str, str]:
    """(prefill URL, decode URL)."""
    (decode, _), (prefill, _) = cluster.workers
    return prefill.url, decode.url


def complete(cluster: Cluster) -> str:
    """A greedy completion of 6 tokens through the router, with the client key: the cluster serves."""
    reply = httpx.post(f"{cluster.router.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": "pd-test", "prompt": PROMPT, "max_tokens": 6, "temperature": 0}, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 6
    return str(reply.json()["choices"][0]["text"])


def serves_and_nothing_left(cluster: Cluster) -> None:
    complete(cluster)
    cluster.wait_until_idle()


def reserve_request(rid: str) -> ReserveRequest:
    return ReserveRequest(request_id=rid, transfer_id=f"{rid}@0", prompt_token_ids=PROMPT,
                          params=WireSamplingParams.of(SamplingParams(temperature=0.0, max_tokens=4)))


def prefill_pool(cluster: Cluster) -> torch.Tensor:
    (_, _), (_, prefill) = cluster.workers
    return prefill.engine.runner.kv_cache


def test_unauthenticated_client_is_refused(cluster: Cluster) -> None:
    reply = httpx.post(f"{cluster.router.url}/v1/completions", json={"model": "pd-test", "prompt": "hi"})
    assert reply.status_code == 401 and reply.json()["error"]["type"]
    serves_and_nothing_left(cluster)


@pytest.mark.parametrize("signer", ["none", "other secret"])
def test_pd_routes_refuse_a_peer_without_the_secret(cluster: Cluster, signer: str) -> None:
    prefill_url, decode_url = urls(cluster)
    auth = None if signer == "none" else SignedRequests(OTHER)
    with httpx.Client(auth=auth, timeout=10) as http:
        calls = [http.post(f"{decode_url}/pd/reserve", json=reserve_request("evil").model_dump()),
                 http.post(f"{decode_url}/pd/alive", json={"transfer_ids": ["evil@0"]}),
                 http.get(f"{decode_url}/pd/stream/evil"),
                 http.post(f"{prefill_url}/pd/abort/x"),
                 http.post(f"{cluster.router.url}/pd/register", json={"role": "decode", "url": "http://10.0.0.1:1"})]
        assert [c.status_code for c in calls] == [401] * len(calls), [c.text for c in calls]
        assert all("cluster authentication failed" in c.json()["error"]["message"] for c in calls)
        assert http.get(f"{decode_url}/pd/info").status_code == 200  # read-only status stays open
    serves_and_nothing_left(cluster)


def test_a_method_no_route_takes_is_a_405_with_allow_before_any_authentication(cluster: Cluster) -> None:
    """Issue 32: authentication has nothing to say about a request no route takes (TRACE /pd/register
    was a 401); the 405 names what the path takes, and the router's document leaves /pd/* out."""
    prefill_url, decode_url = urls(cluster)
    for url, path, allowed in ((cluster.router.url, "/pd/register", "POST"), (decode_url, "/pd/reserve", "POST"),
                               (prefill_url, "/pd/prefill", "POST"), (cluster.router.url, "/v1/models", "GET")):
        reply = httpx.request("TRACE", f"{url}{path}", timeout=10)
        assert reply.status_code == 405, (path, reply.text)
        assert reply.headers["allow"] == allowed and reply.json()["error"]["code"] == 405, (path, reply.headers)
    assert httpx.post(f"{cluster.router.url}/pd/nowhere", timeout=10).status_code == 401  # NOTE: unknown: refused
    document = httpx.get(f"{cluster.router.url}/openapi.json", timeout=10).json()
    assert not [path for path in document["paths"] if path.startswith("/pd/")], list(document["paths"])
    serves_and_nothing_left(cluster)


def test_a_replayed_or_stale_signed_call_is_refused(cluster: Cluster) -> None:
    _, decode_url = urls(cluster)
    request = httpx.Request("POST", f"{decode_url}/pd/abort/nobody")
    signed = next(SignedRequests(secret()).auth_flow(request))
    with httpx.Client(timeout=10) as http:
        first = http.post(signed.url, headers=dict(signed.headers))
        again = http.post(signed.url, headers=dict(signed.headers))
        assert first.status_code == 200 and again.status_code == 401, again.text
        assert "replayed" in again.json()["error"]["message"]
        stale = f"{time.time() - 600:.3f}"
        headers = {HEADER_TIMESTAMP: stale, HEADER_NONCE: "ab" * 16,
                   HEADER_SIGNATURE: secret().mac("pd-http", "POST", b"/pd/abort/nobody", stale, "ab" * 16,
                                                  "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855")}
        old = http.post(f"{decode_url}/pd/abort/nobody", headers=headers)
        assert old.status_code == 401 and "clock" in old.json()["error"]["message"]


def test_the_router_signs_registrations_it_checks(cluster: Cluster) -> None:
    """Signed with the secret the router passes it on to its route (which refuses: this router does
    not accept registrations), so the 401s above are the signature's doing."""
    with httpx.Client(auth=SignedRequests(secret()), timeout=10) as http:
        reply = http.post(f"{cluster.router.url}/pd/register", json={"role": "decode", "url": "http://10.0.0.1:1"})
    assert reply.status_code == 403


def eventually(check: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    """`check()` once it holds, polled until `timeout_s` (then its last value)."""
    deadline = time.monotonic() + timeout_s
    while not check() and time.monotonic() < deadline:
        time.sleep(0.01)
    return check()


@pytest.mark.parametrize("sender_secret", [None, OTHER])
def test_kv_port_refuses_a_peer_without_the_secret(cluster: Cluster, sender_secret: ClusterSecret | None) -> None:
    receiver = cluster.service(DecodeService).receiver
    pool = prefill_pool(cluster)
    refused_before = receiver.gate.num_refused
    sender = make_sender("tcp", receiver.layout, pool, secret=sender_secret)
    try:
        with pytest.raises(KVAuthError, match="cluster"):
            sender.connect(receiver.address)
    finally:
        sender.close()
    # NOTE: the receiver counts the refusal on its own thread, maybe after the sender saw it
    assert eventually(lambda: receiver.gate.num_refused == refused_before + 1)
    serves_and_nothing_left(cluster)


def test_a_wrong_reservation_token_cannot_write_the_reservation(cluster: Cluster) -> None:
    """A peer with the secret, but not the attempt the router assigned: its payloads and its final
    message are refused, nothing lands, and the reservation still waits for its own prefill."""
    receiver = cluster.service(DecodeService).receiver
    _, decode_url = urls(cluster)
    pool = prefill_pool(cluster)

    async def scenario() -> None:
        workers = WorkerClient(timeout_s=30, secret=secret())
        try:
            reply = await workers.reserve(decode_url, reserve_request("victim"))
            assert reply is not None and reply.token
            sender = make_sender("tcp", receiver.layout, pool, secret=secret())
            try:
                sender.connect(receiver.address)
                before = receiver.kv_cache.clone()
                sender.send_layer("victim@0", 0, [0], reply.block_ids[:1], token="0" * 32)
                with pytest.raises(KVTransferError, match="wrong reservation token"):
                    await sender.flush("victim@0", 10)
                # the right token, another attempt
                sender.send_done("victim@1", HandOffDone(7).encode(), token=reply.token)
                with pytest.raises(KVTransferError, match="unknown request"):
                    await sender.flush("victim@1", 10)
                assert torch.equal(receiver.kv_cache, before)
                assert "victim@0" in receiver.reserved_request_ids()  # still waiting for its own prefill
            finally:
                sender.close()
            await workers.abort(decode_url, "victim")
        finally:
            await workers.close()

    asyncio.run(scenario())
    serves_and_nothing_left(cluster)


def test_done_with_an_out_of_vocabulary_token_is_refused_through_the_decode_service(cluster: Cluster) -> None:
    """The final message arrives with the right token but a first token beyond the vocabulary: the
    decode service refuses the hand-off (recompute policy: it prefills the request itself), the
    client gets what a healthy hand-off gives, and the worker keeps serving."""
    service: DecodeService = cluster.service(DecodeService)
    receiver, expected = service.receiver, complete(cluster)
    _, decode_url = urls(cluster)
    vocab = cluster.workers[0][1].engine.config.model.vocab_size
    recomputed = service.stats().recomputed

    async def scenario() -> tuple[str, list[int]]:
        workers = WorkerClient(timeout_s=60, secret=secret())
        sender = make_sender("tcp", receiver.layout, prefill_pool(cluster), secret=secret())
        try:
            params = SamplingParams(temperature=0.0, max_tokens=6)
            request = reserve_request("oov").model_copy(update={"params": WireSamplingParams.of(params)})
            reply = await workers.reserve(decode_url, request)
            assert reply is not None
            sender.connect(receiver.address)
            sender.send_done("oov@0", HandOffDone(vocab + 5).encode(), token=reply.token)
            await sender.flush("oov@0", 10)
            decoder = FrameDecoder()  # decode's frames are deltas: rebuilt as the router does
            seqs = []
            async for frame in workers.stream(decode_url, "oov"):
                decoder.check(frame)
                seqs = decoder.sequences(frame)
            return seqs[0].text, seqs[0].token_ids
        finally:
            sender.close()
            await workers.close()

    text, tokens = asyncio.run(scenario())
    assert text == expected and len(tokens) == 6 and vocab + 5 not in tokens
    assert service.stats().recomputed == recomputed + 1
    serves_and_nothing_left(cluster)


def test_a_thousand_idle_kv_connections_cannot_keep_prefill_out(cluster: Cluster) -> None:
    receiver = cluster.service(DecodeService).receiver
    host, port = receiver.address.removeprefix("tcp://").rsplit(":", 1)
    cap = receiver.gate.policy.max_connections
    idle = []
    try:
        for _ in range(1000):
            idle.append(socket.create_connection((host, int(port)), timeout=10))
        sender = make_sender("tcp", receiver.layout, prefill_pool(cluster), secret=secret())
        try:
            sender.connect(receiver.address)  # the oldest idle connection makes room
        finally:
            sender.close()
        assert receiver.gate.num_connections <= cap
        assert receiver.gate.num_refused >= 1000 - cap
        serves_and_nothing_left(cluster)
    finally:
        for sock in idle:
            sock.close()


def test_a_connection_that_never_authenticates_is_closed() -> None:
    pool = torch.zeros(2, 2, 8, 4, 2, 8)
    receiver = TcpKVReceiver(KVLayout.from_pool("m", pool), pool,
                             peers=KVPeerPolicy(secret(), max_connections=2, handshake_timeout_s=0.2))
    host, port = receiver.address.removeprefix("tcp://").rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            received = b""
            while chunk := sock.recv(4096):  # the challenge, then EOF once the timeout passed
                received += chunk
            assert received.startswith(b"PDKV")
        assert eventually(lambda: receiver.gate.num_refused == 1)
        deadline = time.monotonic() + 5
        while receiver.gate.num_connections and time.monotonic() < deadline:
            time.sleep(0.01)
        assert receiver.gate.num_connections == 0
    finally:
        receiver.close()


def test_prefill_refuses_a_job_no_router_signed(cluster: Cluster) -> None:
    """SSRF: a job posted (or put in the queue) that names a KV address and decode URL of its
    choosing, unsigned or altered after signing, is refused before prefill connects anywhere."""
    prefill_url, decode_url = urls(cluster)
    trap = socket.create_server(("127.0.0.1", 0))
    trap.setblocking(False)
    address = f"tcp://127.0.0.1:{trap.getsockname()[1]}"
    job = PrefillJob(request_id="j", transfer_id="j@0", prompt_token_ids=PROMPT, kv_address=address,
                     decode_url=f"http://127.0.0.1:{trap.getsockname()[1]}", block_ids=[0, 1, 2],
                     num_cached_tokens=0, params=WireSamplingParams.of(SamplingParams(max_tokens=1)), token="t")
    signed = sign_job(secret(), job.model_copy(update={"kv_address": "tcp://127.0.0.1:1"}))
    altered = signed.model_copy(update={"kv_address": address})
    try:
        with httpx.Client(auth=SignedRequests(secret()), timeout=30) as http:
            for bad in (job, altered):
                reply = http.post(f"{prefill_url}/pd/prefill", json=bad.model_dump())
                assert reply.status_code == 400 and "not signed" in reply.json()["error"]["message"]
        with pytest.raises(BlockingIOError):
            trap.accept()  # nobody came
    finally:
        trap.close()
    serves_and_nothing_left(cluster)


def test_queue_consumer_drops_a_forged_job_before_contacting_anyone() -> None:
    """A job someone with access to Redis put there, unsigned: dropped (acknowledged) before the
    consumer retargets, fails or prefills anything at the addresses it names."""
    from pdserve.disagg.worker.queue_consumer import ConsumerOptions, RedisJobConsumer

    contacted: list[str] = []

    class Nobody:
        def __getattr__(self, name: str) -> object:
            contacted.append(name)
            raise AssertionError(f"the consumer called {name} for a forged job")

    service = SimpleNamespace(secret=secret(), run=Nobody())
    consumer = RedisJobConsumer(service, "redis://127.0.0.1:1/0", options=ConsumerOptions(token_budget=1))  # type: ignore[arg-type]
    consumer._workers = Nobody()  # type: ignore[assignment]
    consumer._redis = Nobody()  # type: ignore[assignment]
    acked: list[str] = []

    async def ack(entry_id: str) -> None:
        acked.append(entry_id)

    consumer._ack = ack  # type: ignore[method-assign]
    job = PrefillJob(request_id="q", transfer_id="q@0", prompt_token_ids=PROMPT, kv_address="tcp://10.9.9.9:1",
                     decode_url="http://10.9.9.9:1", block_ids=[0], num_cached_tokens=0,
                     params=WireSamplingParams.of(SamplingParams(max_tokens=1)))
    for forged in (job, sign_job(OTHER, job)):
        asyncio.run(consumer._handle("1-0", {"job": forged.model_dump_json()}, reclaimed=True))
    assert acked == ["1-0", "1-0"] and not contacted
    assert consumer._job({"job": sign_job(secret(), job).model_dump_json()}).kv_address == job.kv_address


def test_pdserve_up_always_runs_with_a_secret(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from pdserve import envs
    from pdserve.disagg.config import RouterConfig
    from pdserve.ops.up import cluster_secret_env

    monkeypatch.delenv(envs.CLUSTER_SECRET, raising=False)
    made = cluster_secret_env(RouterConfig())
    assert len(made[envs.CLUSTER_SECRET]) == 64 and made != cluster_secret_env(RouterConfig())
    assert cluster_secret_env(RouterConfig(cluster_secret_file=str(tmp_path / "s"))) == {}
    monkeypatch.setenv(envs.CLUSTER_SECRET, SECRET)
    assert cluster_secret_env(RouterConfig()) == {}


@pytest.mark.parametrize("transport", ["tcp", pytest.param("nixl", marks=pytest.mark.skipif(
    not nixl_available(), reason="nixl_cu12 is not installed"))])
def test_each_transport_handshake_needs_the_secret(transport: str) -> None:
    """Over nixl the handshake also hands out decode's agent connection info (no registration:
    grants carry those, tests/test_nixl_grants.py): only a peer that proved the secret gets it."""
    pool = torch.zeros(2, 2, 8, 4, 2, 8)
    layout = KVLayout.from_pool("m", pool)
    receiver = make_receiver(transport, layout, pool, peers=KVPeerPolicy(secret()))
    try:
        for wrong in (None, OTHER):
            sender = make_sender(transport, layout, pool.clone(), secret=wrong)
            try:
                with pytest.raises(KVAuthError):
                    sender.connect(receiver.address)
            finally:
                sender.close()
        sender = make_sender(transport, layout, pool.clone(), secret=secret())
        try:
            sender.connect(receiver.address)
        finally:
            sender.close()
        assert receiver.gate.num_refused == 2  # type: ignore[attr-defined]
    finally:
        receiver.close()


def test_the_nonce_cache_never_forgets_a_nonce_that_could_be_replayed() -> None:
    cache = NonceCache(window_s=30, max_entries=3)
    assert all(cache.first_use(n, now=100.0) for n in ("a", "b", "c"))
    assert not cache.first_use("a", now=101.0)  # a replay
    assert not cache.first_use("d", now=101.0)  # full of live nonces: refused, none forgotten
    assert not cache.first_use("a", now=159.0)
    # 61 s later "a" may be forgotten: its timestamp would be refused as stale anyway
    assert cache.first_use("d", now=161.0) and cache.first_use("a", now=161.0)


def test_prefill_closes_a_kv_connection_unused_for_its_idle_time() -> None:
    """Decode workers come and go (autoscaling, restarts on new addresses): a prefill worker keeps
    no connection to one it has not used for `idle_s`."""
    pool = torch.zeros(2, 2, 8, 4, 2, 8)
    layout = KVLayout.from_pool("m", pool)
    receivers = [make_receiver("fake", layout, pool) for _ in range(2)]
    now = [0.0]
    senders = SenderPool("fake", layout, pool.clone(), settings=PoolSettings(idle_s=60.0, clock=lambda: now[0]))
    try:
        first = senders.get(receivers[0].address)
        now[0] = 59.0
        senders.get(receivers[1].address)
        assert senders.get(receivers[0].address) is first  # used within its idle time: kept
        now[0] = 200.0
        # the first is due to be closed as idle: only `get` (off the event loop) may close it
        assert senders.connected(receivers[1].address) is None
        second = senders.get(receivers[1].address)
        assert senders.connected(receivers[1].address) is second
        assert senders.get(receivers[1].address) is second
        assert senders.get(receivers[0].address) is not first  # idle for 141 s: closed, connected again
        with pytest.raises(ConnectionError):
            first.send_layer("r", 0, [0], [0])  # the old one is closed
    finally:
        senders.close()
        for receiver in receivers:
            receiver.close()
