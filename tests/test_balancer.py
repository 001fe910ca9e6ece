"""The equal-hardware baseline's parts, without processes: `pdserve up --colocated N --cpus-per-worker K`
(command lines, core plan), the balancer's choice and its answers when no replica can take a
request, core lists, and the probe filter that keeps the balancer's polling out of the logs.
(tests/test_up.py runs the whole thing as processes.)"""

from __future__ import annotations

import logging
import socket
import sys
import threading

import pytest
from fastapi.testclient import TestClient
from server_fixtures import free_port

from pdserve.cli import build_parser, main, up_plan
from pdserve.logs import ProbeAccessFilter
from pdserve.ops import up
from pdserve.ops.balancer import Balancer, create_balancer_app
from pdserve.ops.threads import CorePlan, parse_cpu_list


def test_core_lists_parse_like_taskset() -> None:
    assert parse_cpu_list("0-3,6") == (0, 1, 2, 3, 6)
    assert parse_cpu_list("2") == (2,) and parse_cpu_list("1,1-2") == (1, 2)
    for bad in ("", "a", "3-1", "-1", "0-"):
        with pytest.raises(ValueError, match="core list"):
            parse_cpu_list(bad)


def test_each_worker_gets_cores_of_its_own_and_keeps_them_across_restarts(caplog: pytest.LogCaptureFixture) -> None:
    plan = CorePlan(2, cores=(0, 1, 2, 3))
    assert [plan.for_worker(port) for port in (9001, 9002)] == [(0, 1), (2, 3)]
    assert plan.for_worker(9001) == (0, 1)  # restarted on its port: the same cores
    with caplog.at_level(logging.WARNING):
        assert plan.for_worker(9003) == (0, 1)  # more workers than blocks: wraps round, and says so
    assert "worker 3 shares cores with another" in caplog.text
    with pytest.raises(ValueError, match="expected 1 to 4"):
        CorePlan(5, cores=(0, 1, 2, 3))


def test_up_colocated_starts_pinned_replicas_behind_a_balancer() -> None:
    argv = ["up", "--colocated", "2", "--cpus-per-worker", "1", "--max-num-seqs", "4", "--max-tokens-limit", "99",
            "--port", "8100"]
    ns, engine_flags = build_parser().parse_known_args(argv)
    options, router, worker, worker_flags = up_plan(ns, engine_flags)
    commands = up.CommandLines(options, router, worker, tuple(worker_flags), cpus=2, cores=CorePlan(1, (0, 1)))
    commands.replica_urls.extend(["http://127.0.0.1:9001", "http://127.0.0.1:9002"])
    balancer = build_parser().parse_args(commands("router", 8100, 2)[3:])
    assert (balancer.command, balancer.port, balancer.replica) == ("balancer", 8100, commands.replica_urls)
    assert balancer.max_tokens_limit == 99
    for port, core in ((9001, (0,)), (9002, (1,))):
        spawned = commands("replica", port, 2)
        assert spawned[:3] == [sys.executable, "-m", "pdserve.cli"]
        child = build_parser().parse_args(spawned[3:])
        assert (child.command, child.role, child.port, child.cpu_affinity) == ("serve", "colocated", port, core)
        assert (child.num_threads, child.max_num_seqs, child.max_tokens_limit, child.register) == (1, 4, 99, ())


@pytest.mark.parametrize(("argv", "message"), [
    (["up", "--colocated", "2", "--prefill", "1"], "takes no --prefill, --decode or --autoscale"),
    (["up", "--colocated", "2", "--autoscale"], "takes no --prefill, --decode or --autoscale"),
    (["up", "--colocated", "0"], "expected at least 1"),
])
def test_up_colocated_refuses_mixed_counts(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_more_cores_per_worker_than_the_machine_has_is_refused_before_anything_starts(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["up", "--colocated", "1", "--cpus-per-worker", "4096"]) == 2
    assert "--cpus-per-worker 4096: expected 1 to" in capsys.readouterr().err
    assert main(["serve", "--cpu-affinity", "4095"]) == 2
    assert "--cpu-affinity: core(s) [4095] not available to this process (allowed: " in capsys.readouterr().err


def test_balancer_picks_the_least_busy_ready_replica_in_turn() -> None:
    balancer = Balancer(["http://a:1", "http://b:1", "http://c:1/"])
    a, b, c = balancer.replicas
    assert c.url == "http://c:1" and balancer.pick(set()) is None  # nobody ready yet
    a.ready = b.ready = c.ready = True
    assert {balancer.pick(set()).url for _ in range(3)} == {a.url, b.url, c.url}  # type: ignore[union-attr]
    a.in_flight, b.in_flight = 2, 1
    assert balancer.pick(set()) is c
    assert balancer.pick({c.url}) is b
    c.ready = False
    assert balancer.pick(set()) is b and balancer.unready_reason == ""
    with pytest.raises(ValueError, match="at least one --replica"):
        Balancer([])


def test_balancer_answers_503_in_the_envelope_when_no_replica_can_take_a_request() -> None:
    dead = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]
    with TestClient(create_balancer_app(Balancer(dead))) as client:
        assert client.get("/health").status_code == 200
        ready = client.get("/ready")
        assert ready.status_code == 503 and ready.json()["error"]["message"] == "no replica is ready"
        reply = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert reply.status_code == 503 and reply.json()["error"]["type"] == "service_unavailable"
        assert [w["ready"] for w in client.get("/workers").json()] == [False, False]


def test_successful_probe_polls_leave_no_access_log_line() -> None:
    def record(method: str, path: str, status: int) -> logging.LogRecord:
        return logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                                 ("127.0.0.1:5", method, path, "1.1", status), None)

    keep = ProbeAccessFilter().filter
    assert not keep(record("GET", "/ready", 200)) and not keep(record("GET", "/metrics", 200))
    assert keep(record("GET", "/ready", 503))  # a failing probe is worth a line
    assert keep(record("POST", "/v1/completions", 200)) and keep(record("GET", "/workers", 200))


class _Replica:
    """A replica on a raw socket: answers GET /ready with 200; every other request `answer`s
    (None: the connection is dropped unanswered, as by a replica that dies)."""

    def __init__(self, answer: bytes | None) -> None:
        self.answer = answer
        self.requests = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self.listener.settimeout(0.1)
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            with conn:
                if conn.recv(65536).startswith(b"GET /ready"):
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}")
                    continue
                self.requests += 1
                if self.answer is not None:
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s"
                                 % (len(self.answer), self.answer))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.listener.close()


def test_a_replica_that_breaks_off_before_answering_is_a_502_in_the_envelope() -> None:
    """It took the request and closed the connection, and no other replica is ready: the client
    gets a 502, never a 500; the replica leaves the rotation until its next good probe."""
    replica = _Replica(None)
    balancer = Balancer([replica.url])
    try:
        with TestClient(create_balancer_app(balancer)) as client:
            assert balancer.replicas[0].ready
            reply = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert reply.status_code == 502 and reply.json()["error"]["message"].startswith("the replica serving")
            assert balancer.replicas[0].in_flight == 0 and not balancer.replicas[0].ready
    finally:
        replica.close()


def test_a_request_a_replica_broke_off_before_answering_is_answered_by_another() -> None:
    """A replica that dies with the request (nothing of the answer reached the client): the next
    ready replica answers it, and the first leaves the rotation."""
    broken, good = _Replica(None), _Replica(b'{"answered": true}')
    balancer = Balancer([broken.url, good.url])
    try:
        with TestClient(create_balancer_app(balancer)) as client:
            assert all(r.ready for r in balancer.replicas)
            for _ in range(3):
                reply = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
                assert reply.status_code == 200 and reply.json() == {"answered": True}, reply.text
            assert broken.requests >= 1 and good.requests == 3  # out of the rotation once it broke off
            assert [r.in_flight for r in balancer.replicas] == [0, 0]
    finally:
        broken.close()
        good.close()
