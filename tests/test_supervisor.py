"""`pdserve up`'s supervisor: restarts with backoff, a crash loop fails one slot and nothing else,
drains remove slots, the restart and state metrics, the thread split; fake processes on a fake
clock, and a few tiny real ones for the stop semantics."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from helpers import FakeClock
from prometheus_client import CollectorRegistry

from pdserve.disagg.config import RouterConfig, WorkerConfig
from pdserve.ops.autoscale import AutoscaleConfig, Autoscaler, HistogramSnapshot, Signals
from pdserve.ops.scaling import AutoscaleLoop
from pdserve.ops.supervisor import ChildProcess, PoolEntry, ProcessHost, RestartPolicy, Slot, SlotRole, Supervisor
from pdserve.ops.threads import CoreShare, threads_per_worker
from pdserve.ops.up import CommandLines, Replicas, UpOptions, read_pool


class FakeProcess:
    """Runs until told to exit; SIGTERM and SIGKILL end it (with `on_term`'s status for SIGTERM)."""

    def __init__(self, argv: list[str], on_term: int | None = 0) -> None:
        self.argv = argv
        self.status: int | None = None
        self.on_term = on_term
        self.signals: list[int] = []

    def poll(self) -> int | None:
        return self.status

    def signal(self, sig: int) -> None:
        self.signals.append(sig)
        if sig == signal.SIGKILL:
            self.status = -signal.SIGKILL
        elif sig == signal.SIGTERM and self.on_term is not None:
            self.status = self.on_term

    def wait(self) -> int:
        assert self.status is not None, "would block forever"
        return self.status


class Harness:
    """A supervisor on a fake clock whose processes are FakeProcesses, by slot port."""

    def __init__(self, policy: RestartPolicy | None = None) -> None:
        self.clock = FakeClock()
        self.registry = CollectorRegistry()
        self.started: list[tuple[SlotRole, int, int]] = []  # (role, port, number of workers)
        self.processes: dict[int, list[FakeProcess]] = {}
        ports = iter(range(9001, 9999))
        host = ProcessHost(clock=self.clock, spawn=self.spawn, new_port=lambda: next(ports))
        self.supervisor = Supervisor(self.command, registry=self.registry, policy=policy or RestartPolicy(), host=host)

    def command(self, role: SlotRole, port: int, num_workers: int) -> list[str]:
        self.started.append((role, port, num_workers))
        return [role, str(port)]

    def spawn(self, argv: list[str]) -> FakeProcess:
        process = FakeProcess(argv)
        self.processes.setdefault(int(argv[1]), []).append(process)
        return process

    def current(self, slot: Slot) -> FakeProcess:
        return self.processes[slot.port][-1]

    def crash(self, slot: Slot, status: int = -9) -> None:
        self.current(slot).status = status
        self.supervisor.tick()

    def after(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.supervisor.tick()

    def workers(self, role: str, state: str) -> float | None:
        return self.registry.get_sample_value("pdserve:supervisor_workers", {"role": role, "state": state})

    def restarts(self, role: str) -> float | None:
        return self.registry.get_sample_value("pdserve:supervisor_restarts_total", {"role": role})


def test_a_worker_that_exits_is_restarted_with_backoff_doubling_to_30_s(caplog: pytest.LogCaptureFixture) -> None:
    h = Harness()
    slot = h.supervisor.add("prefill")
    h.supervisor.tick()
    assert len(h.processes[slot.port]) == 1 and slot.state == "starting"
    caplog.set_level(logging.WARNING)
    delays = []
    for _ in range(8):
        h.after(50)  # up 50 s: under the reset, and exits never pile up 5 deep within 120 s
        h.crash(slot)
        delays.append(slot.delay_s)
        starts = len(h.processes[slot.port])
        h.after(slot.start_at - h.clock.now_s - 0.01)
        assert len(h.processes[slot.port]) == starts, "restarted before its backoff ran out"
        h.after(slot.start_at - h.clock.now_s)
        assert len(h.processes[slot.port]) == starts + 1 and slot.port == h.started[-1][1]
    assert delays == [1, 2, 4, 8, 16, 30, 30, 30]
    assert "prefill-0 (prefill, http://127.0.0.1:9001) exited with status -9; restarting in 30 s" in caplog.text
    h.after(60)  # up a minute: the backoff starts over
    h.crash(slot)
    assert slot.delay_s == 1 and not slot.failed
    assert h.restarts("prefill") == 8 and h.restarts("decode") == h.restarts("router") == 0


def test_a_crash_loop_fails_its_slot_and_leaves_every_other_process_alone(caplog: pytest.LogCaptureFixture) -> None:
    h = Harness()
    router, prefill, decode = (h.supervisor.add(role) for role in ("router", "prefill", "decode"))
    h.supervisor.tick()
    caplog.set_level(logging.WARNING)
    for _ in range(5):
        h.crash(prefill, status=1)
        h.after(prefill.delay_s)
    assert prefill.failed and prefill.process is None
    assert "prefill-0 failed: 5 exits in 120 s; not restarting" in caplog.text
    h.after(300)
    assert len(h.processes[prefill.port]) == 5, "a failed slot was started again"
    for other in (router, decode):
        assert len(h.processes[other.port]) == 1 and not h.current(other).signals and other.state == "starting"
    assert (h.restarts("prefill"), h.restarts("router"), h.restarts("decode")) == (4, 0, 0)
    assert h.workers("prefill", "failed") == 1 and h.workers("decode", "starting") == 1
    assert h.supervisor.hopeless() == "every prefill slot failed (prefill-0)"
    assert h.supervisor.live("prefill") == [] and h.supervisor.num_workers() == 1


def test_exits_spread_over_more_than_two_minutes_are_no_crash_loop() -> None:
    h = Harness()
    slot = h.supervisor.add("decode")
    h.supervisor.tick()
    for _ in range(10):
        h.after(30)  # 4 exits within any 120 s, never 5
        h.crash(slot)
        h.after(slot.delay_s)
    assert not slot.failed and len(h.processes[slot.port]) == 11


def test_readiness_and_work_come_from_the_routers_pool() -> None:
    h = Harness()
    router, first, second = (h.supervisor.add(role) for role in ("router", "decode", "decode"))
    h.supervisor.tick()
    h.supervisor.observe_pool([PoolEntry(first.url, True, 5), PoolEntry(second.url, False, 0)])
    assert (router.state, first.state, second.state) == ("ready", "ready", "starting")
    assert h.workers("decode", "ready") == 1 and h.workers("router", "ready") == 1
    h.supervisor.observe_pool(None)  # the router does not answer: its workers keep what it last said
    assert (router.state, first.state) == ("starting", "ready")
    h.crash(first)
    assert first.state == "starting" and first.work is None


def test_scale_in_drains_the_least_busy_worker_and_removes_it_once_it_exits(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    h = Harness()
    busy, idle, newest = (h.supervisor.add("decode") for _ in range(3))
    h.supervisor.tick()
    assert h.supervisor.drain_candidate("decode") is newest  # no word from the router: the newest
    h.supervisor.observe_pool([PoolEntry(busy.url, True, 7), PoolEntry(idle.url, True, 0),
                               PoolEntry(newest.url, True, 2)])
    h.supervisor.scale("decode", 2)
    assert h.current(idle).signals == [signal.SIGTERM] and idle.state == "draining"
    assert h.workers("decode", "draining") == 1 and h.supervisor.live("decode") == [busy, newest]
    h.supervisor.tick()  # it exited 0: gone, not restarted
    assert idle not in h.supervisor.slots() and len(h.processes[idle.port]) == 1
    h.current(newest).on_term = -6  # a drained worker that exits badly is removed all the same
    h.supervisor.drain(newest)
    h.supervisor.tick()
    assert h.supervisor.slots() == [busy] and h.restarts("decode") == 0
    assert "decode-1 drained and exited with status 0; removed" in caplog.text
    assert "decode-2 drained and exited with status -6; removed" in caplog.text
    late = h.supervisor.add("decode")
    h.supervisor.tick()
    h.current(late).on_term = -15  # SIGTERM before it serves: no drain, it just ends
    h.supervisor.drain(late)
    h.supervisor.tick()
    assert "decode-3 drained before it was ready (exited with status -15); removed" in caplog.text


def test_scale_out_adds_slots_on_new_ports_and_a_drained_slot_not_started_goes_at_once() -> None:
    h = Harness()
    h.supervisor.add("router", port=8000)
    first = h.supervisor.add("prefill")
    h.supervisor.tick()
    h.supervisor.scale("prefill", 3)
    added = h.supervisor.live("prefill")[1:]
    assert [s.name for s in added] == ["prefill-1", "prefill-2"]
    assert len({8000, first.port, *(s.port for s in added)}) == 4
    h.supervisor.drain(added[1])  # never started: nothing to wait for
    h.supervisor.tick()
    assert h.supervisor.live("prefill") == [first, added[0]] and added[1].port not in h.processes
    # every process started knew the pool it joins (the thread split): 1 worker, then 2
    assert [n for role, _, n in h.started if role == "prefill"] == [1, 2]


def test_a_drain_that_overruns_its_timeout_is_killed() -> None:
    h = Harness(RestartPolicy(drain_timeout_s=30))
    slot = h.supervisor.add("decode")
    h.supervisor.tick()
    h.current(slot).on_term = None  # keeps serving a long stream
    h.supervisor.drain(slot)
    h.after(29)
    assert h.current(slot).signals == [signal.SIGTERM]
    h.after(2)
    assert h.current(slot).signals == [signal.SIGTERM, signal.SIGKILL]
    h.supervisor.tick()
    assert h.supervisor.slots() == []


def test_stop_terminates_the_router_first_and_starts_nothing_after() -> None:
    h = Harness()
    router, prefill, decode = (h.supervisor.add(role) for role in ("router", "prefill", "decode"))
    h.supervisor.tick()
    h.crash(prefill)  # waiting for its restart
    terminated: list[int] = []
    for slot in (router, decode):
        process = h.current(slot)
        process.signal = lambda sig, p=process, port=slot.port: (terminated.append(port), FakeProcess.signal(p, sig))
    h.supervisor.stop()
    assert terminated == [router.port, decode.port]
    h.after(60)
    assert len(h.processes[prefill.port]) == 1, "restarted after stop"


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_real_processes_restart_and_stop_leaves_none_running() -> None:
    def command(role: SlotRole, port: int, num_workers: int) -> list[str]:
        if role == "prefill":
            return _python("import sys; sys.exit(3)")
        # ignores SIGTERM: only the hurried stop's SIGKILL ends it
        return _python("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)")

    registry = CollectorRegistry()
    supervisor = Supervisor(command, registry=registry, policy=RestartPolicy(first_delay_s=0.05, max_exits=3))
    crashing, stubborn = supervisor.add("prefill"), supervisor.add("decode")
    deadline = time.monotonic() + 20
    while not crashing.failed and time.monotonic() < deadline:
        supervisor.tick()
        time.sleep(0.02)
    assert crashing.failed and supervisor.restarts("prefill") == 2
    process = stubborn.process
    assert isinstance(process, ChildProcess) and process.poll() is None
    started = time.monotonic()
    supervisor.stop(hurried=lambda: time.monotonic() - started > 0.3, grace_s=15)
    assert time.monotonic() - started < 5 and process.poll() == -signal.SIGKILL


def _options(**overrides: object) -> UpOptions:
    values: dict = {"port": 8000, "prefill": Replicas(2, 2), "decode": Replicas(1, 1), "supervisor_port": 8001}
    return UpOptions(**(values | overrides))


def test_each_worker_gets_the_cores_split_over_the_pool_it_joins() -> None:
    router, worker = RouterConfig(accept_registrations=True), WorkerConfig(register=("http://127.0.0.1:8000",))
    commands = CommandLines(_options(), router, worker, ("--max-num-seqs", "4"), cpus=8)

    def threads(argv: list[str]) -> int:
        return int(argv[argv.index("--num-threads") + 1])

    assert threads(commands("prefill", 9001, 3)) == 2 and threads(commands("decode", 9002, 5)) == 1
    worker = commands("decode", 9002, 3)
    assert worker[worker.index("--register") + 1] == "http://127.0.0.1:8000"
    assert worker[worker.index("--port") + 1] == "9002" and worker[worker.index("--role") + 1] == "decode"
    assert worker.index("--max-num-seqs") > worker.index("--num-threads")  # engine flags win
    argv = commands("router", 8000, 3)
    assert "--accept-registrations" in argv and "--decode" not in argv and "--prefill" not in argv
    fixed = CommandLines(_options(prefill_threads=3), RouterConfig(), WorkerConfig(), (), cpus=8)
    assert threads(fixed("prefill", 9001, 6)) == 3 and threads(fixed("decode", 9002, 6)) == 1
    assert threads_per_worker(3, cpus=2) == 1 and threads_per_worker(1, cpus=16) == 16


def test_more_workers_than_cores_is_said_once_per_change(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    cores = CoreShare(cpus=2)
    assert cores.note(2) is None
    assert cores.note(5) == "pdserve up: 5 workers on 2 cores: oversubscribed (1 thread each); expect slower steps"
    assert cores.note(5) is None
    assert cores.note(3) == "pdserve up: 3 workers on 2 cores: oversubscribed (1 thread each); expect slower steps"
    assert cores.note(2) == "pdserve up: 2 workers on 2 cores: no longer oversubscribed"
    assert cores.note(1) is None
    assert caplog.text.count("oversubscribed") == 3


def test_the_pool_is_read_from_the_routers_workers_listing() -> None:
    listing = [{"role": "decode", "url": "http://127.0.0.1:9002", "ready": True, "in_flight": 2, "draining": False,
                "load": {"num_running": 3, "num_waiting": 1, "num_free_kv_blocks": 10, "num_kv_blocks": 64}},
               {"role": "prefill", "url": "http://127.0.0.1:9001", "ready": False, "in_flight": 0,
                "draining": False, "load": None}]
    answer = httpx.MockTransport(lambda request: httpx.Response(200, json=listing))
    with httpx.Client(transport=answer) as http:
        assert read_pool(http, "http://r") == [PoolEntry("http://127.0.0.1:9002", True, 6),
                                               PoolEntry("http://127.0.0.1:9001", False, 0)]
    down = httpx.MockTransport(lambda request: httpx.Response(503))
    with httpx.Client(transport=down) as http:
        assert read_pool(http, "http://r") is None


def test_replicas_are_n_or_min_max() -> None:
    assert Replicas.parse("2") == Replicas(2, 2) and Replicas.parse("1:3") == Replicas(1, 3)
    assert str(Replicas(1, 3)) == "1:3" and Replicas(2, 2).fixed
    for bad in ("0", "3:1", "a", "1:", "-1:2"):
        with pytest.raises(ValueError, match="expected"):
            Replicas.parse(bad)


def test_the_autoscaler_grows_and_drains_the_pool_through_the_supervisor(caplog: pytest.LogCaptureFixture) -> None:
    h = Harness()
    slots = {role: h.supervisor.add(role) for role in ("router", "prefill", "decode")}
    config = AutoscaleConfig(autoscale_window_s=2, scale_in_cooldown_s=3)
    autoscaler = Autoscaler(config, {"prefill": (1, 3), "decode": (1, 3)}, registry=h.registry)
    load = {"depth": 20.0, "running": 40.0}

    def read(url: str, timeout_s: float) -> Signals:
        ready = {role: len(h.supervisor.live(role)) for role in ("prefill", "decode")}
        return Signals(h.clock(), load["depth"], load["running"], ready, HistogramSnapshot.empty(),
                       HistogramSnapshot.empty())

    scaler = AutoscaleLoop(autoscaler, h.supervisor, "http://r", read=read, clock=h.clock)
    caplog.set_level(logging.INFO)

    def run(seconds: int) -> list[str]:
        lines = []
        for _ in range(seconds):
            h.after(1)
            lines += [d.log_line() for d in scaler.tick()]
        return lines

    assert run(3) == ["autoscale: prefill 1 -> 2: queue depth 20 > 10 for 2 s",
                      "autoscale: decode 1 -> 3: running/instance 40 > 15 for 2 s"]
    assert [len(h.supervisor.live(role)) for role in ("prefill", "decode")] == [2, 3]
    assert "autoscale: decode 1 -> 3: running/instance 40 > 15 for 2 s" in caplog.text
    load.update(depth=0, running=0)
    lines = run(12)  # a quiet period: one worker a cooldown, until each role's minimum
    assert [line.split(":")[1] for line in lines] == [" prefill 2 -> 1", " decode 3 -> 2", " decode 2 -> 1"]
    assert h.supervisor.slots() == list(slots.values()), "drained workers removed, the first ones kept"
    assert all(h.current(slot).signals == [] for slot in slots.values())
    decisions = {(d, r): h.registry.get_sample_value("pdserve:autoscaler_decisions_total",
                                                     {"role": r, "direction": d, "reason": reason})
                 for d, r, reason in (("out", "prefill", "queue_depth"), ("in", "decode", "idle"))}
    assert decisions == {("out", "prefill"): 1, ("in", "decode"): 2}


def test_a_child_outlives_no_supervisor_even_a_sigkilled_one() -> None:
    """`up`'s children watch it (PDSERVE_SUPERVISOR_PID): SIGKILL, which it cannot pass on, still
    leaves no orphan: the child gets SIGTERM (a server drains) within about a second."""
    child_code = ("import time; from pdserve.ops.supervisor import exit_with_supervisor; "
                  "exit_with_supervisor(poll_s=0.05); print('watching', flush=True); time.sleep(30)")
    supervisor_code = ("import sys, time; from pdserve.ops.supervisor import ChildProcess; "
                       f"c = ChildProcess([sys.executable, '-c', {child_code!r}]); print(c.pid, flush=True); "
                       "time.sleep(30)")
    supervisor = subprocess.Popen([sys.executable, "-c", supervisor_code], stdout=subprocess.PIPE, text=True)
    assert supervisor.stdout is not None
    child = int(supervisor.stdout.readline())
    # NOTE: the child (its stdout is the supervisor's) imports pdserve, then watches: on a loaded
    # machine that can take longer than any fixed wait
    assert supervisor.stdout.readline().strip() == "watching"
    os.kill(child, 0)  # alive while its supervisor is
    supervisor.kill()
    supervisor.wait(10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.kill(child, signal.SIGKILL)
    raise AssertionError("the child ran on after its supervisor was killed")


def test_stop_signals_decode_only_once_prefill_has_exited() -> None:
    """A prefill worker drains (finishes its hand-offs) before decode is told to stop, so it never
    sees its decode peer leave during a deliberate stop (issue 42: "NIXL sender gives up on decode"
    on Ctrl-C)."""
    h = Harness()
    router, prefill, decode = (h.supervisor.add(role) for role in ("router", "prefill", "decode"))
    h.supervisor.tick()
    events: list[str] = []
    draining = h.current(prefill)
    draining.on_term = None  # exits 0.2 s after its SIGTERM, as a draining worker does

    def prefill_signal(sig: int) -> None:
        FakeProcess.signal(draining, sig)
        events.append(f"prefill {sig}")
        if sig == signal.SIGTERM:
            def leave() -> None:
                time.sleep(0.2)
                events.append("prefill exited")
                draining.status = 0
            threading.Thread(target=leave, daemon=True).start()

    draining.signal = prefill_signal  # type: ignore[method-assign]
    stopped_decode = h.current(decode)
    stopped_decode.signal = lambda sig: (events.append(f"decode {sig}"), FakeProcess.signal(stopped_decode, sig))
    h.supervisor.stop(grace_s=10)
    assert events == [f"prefill {signal.SIGTERM}", "prefill exited", f"decode {signal.SIGTERM}"]
    assert h.current(router).signals == [signal.SIGTERM]


def test_a_prefill_worker_that_does_not_exit_costs_decode_only_half_the_grace() -> None:
    h = Harness()
    prefill, decode = h.supervisor.add("prefill"), h.supervisor.add("decode")
    h.supervisor.tick()
    h.current(prefill).on_term = None  # stuck: only SIGKILL ends it
    signalled: list[float] = []
    decoding = h.current(decode)
    decoding.signal = lambda sig: (signalled.append(time.monotonic()), FakeProcess.signal(decoding, sig))
    started = time.monotonic()
    h.supervisor.stop(grace_s=3.0)
    assert decoding.signals == [signal.SIGTERM], "decode drained, not killed"
    assert 1.45 <= signalled[0] - started < 2.9  # at half the grace, not at its end (a loaded machine: late)
    assert h.current(prefill).signals == [signal.SIGTERM, signal.SIGKILL]


def test_a_hurried_stop_kills_decode_without_waiting_for_prefill() -> None:
    h = Harness()
    prefill, decode, replica = h.supervisor.add("prefill"), h.supervisor.add("decode"), h.supervisor.add("replica")
    h.supervisor.tick()
    h.current(prefill).on_term = None  # stuck
    started = time.monotonic()
    h.supervisor.stop(hurried=lambda: time.monotonic() - started > 0.2, grace_s=30)
    assert time.monotonic() - started < 5
    assert h.current(decode).signals == [signal.SIGKILL] and h.current(replica).signals == [signal.SIGKILL]
    assert h.current(prefill).signals == [signal.SIGTERM, signal.SIGKILL]


def test_colocated_replicas_are_signalled_at_once() -> None:
    h = Harness()
    router, replicas = h.supervisor.add("router"), [h.supervisor.add("replica") for _ in range(2)]
    h.supervisor.tick()
    h.supervisor.stop(grace_s=30)
    assert all(h.current(slot).signals == [signal.SIGTERM] for slot in (router, *replicas))
