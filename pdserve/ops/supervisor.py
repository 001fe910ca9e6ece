"""`pdserve up`'s supervisor: named process slots (the router, prefill and decode workers), each with
a command line and a port that it keeps across restarts.

    add(role) ─> not started ─tick─> running ─exits─> backoff: 1 s, 2 s, 4 s … 30 s ─tick─> running
                                        │               └─ the 5th exit within 120 s ─> failed (left so)
                                        └─ drain(slot): SIGTERM ─exits─> removed, whatever its status

A process that stayed up `reset_after_s` starts its backoff over. A slot that fails is only logged
and counted: the other processes go on. Scale-out is `add`, scale-in is `drain` (the worker stops
taking work, finishes what it has and exits 0); `scale` does either to reach a count.

NOTE: one thread drives it (`tick`, `add`, `drain`, `scale`, `observe_pool`: up.py's monitor loop);
the metrics collector reads it from the HTTP server's thread; a lock covers both. The clock and the
process factory are injected, so the timing is tested without sleeping and without real processes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections import Counter as Tally
from collections import deque
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from pdserve import envs
from pdserve.addresses import http_url

logger = logging.getLogger(__name__)

SlotRole = Literal["router", "prefill", "decode", "replica"]  # replica: a colocated server (up --colocated)
SlotState = Literal["starting", "ready", "draining", "failed"]
ROLES: tuple[SlotRole, ...] = ("router", "prefill", "decode", "replica")
_STOPPED_FIRST: tuple[SlotRole, ...] = ("router", "prefill")  # `Supervisor.stop`: then, once prefill exited, the rest
STATES: tuple[SlotState, ...] = ("starting", "ready", "draining", "failed")
HOST = "127.0.0.1"  # where `pdserve up`'s processes listen by default (up --host)


def reach_host(listen_host: str) -> str:
    """The address this machine reaches a server listening on `listen_host` at: itself, or for a
    wildcard (every interface) the loopback address."""
    return {"": HOST, "0.0.0.0": HOST, "::": "::1"}.get(listen_host, listen_host)

# (role, port, number of workers the pool will have) -> the command line of one process
CommandLine = Callable[[SlotRole, int, int], list[str]]


class Process(Protocol):
    """A started process, as the supervisor uses it."""

    def poll(self) -> int | None:
        """Its exit status once it has exited (and reaped it), else None."""

    def signal(self, sig: int) -> None:
        """Send `sig` (to it and anything it started); nothing if it is gone."""

    def wait(self) -> int:
        """Block until it exits; its exit status."""


class ChildProcess:
    """A real child in a session of its own: a Ctrl-C in the terminal reaches only `up`, which
    decides what each child gets; signals go to the child's whole process group."""

    def __init__(self, argv: list[str]) -> None:
        # NOTE: the child watches us (supervisor.exit_with_supervisor): even a SIGKILLed `up` leaves no orphan
        env = {**os.environ, envs.SUPERVISOR_PID: str(os.getpid())}
        self.popen = subprocess.Popen(argv, start_new_session=True, env=env)
        self.pid = self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, sig)

    def wait(self) -> int:
        return self.popen.wait()


def free_port(host: str = HOST) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    first_delay_s: float = 1.0  # after the first unexpected exit; doubles with each one after
    max_delay_s: float = 30.0
    reset_after_s: float = 60.0  # a process that stayed up this long starts the backoff over
    max_exits: int = 5  # this many unexpected exits within `window_s`: the slot fails
    window_s: float = 120.0
    drain_timeout_s: float = 600.0  # a drained process still running after this is killed

    def next_delay_s(self, last_delay_s: float, uptime_s: float) -> float:
        if last_delay_s == 0 or uptime_s >= self.reset_after_s:
            return self.first_delay_s
        return min(2 * last_delay_s, self.max_delay_s)


@dataclass(frozen=True, slots=True)
class PoolEntry:
    """One worker as the router's GET /workers lists it."""

    url: str
    ready: bool
    work: int  # this router's requests on it, plus what its engine runs and has waiting


@dataclass(slots=True, eq=False)
class Slot:
    """One process of the deployment: what it is, where it listens, and how its process fares."""

    name: str  # "router", "prefill-0", "decode-2", …: never reused within one supervisor
    role: SlotRole
    port: int
    seq: int  # creation order: the newest slot has the highest
    process: Process | None = None  # None: not started yet, waiting to restart, or failed
    start_at: float = 0.0  # while it has no process: when to (re)start it
    started_at: float = 0.0
    delay_s: float = 0.0  # the last restart's backoff; 0 until its first unexpected exit
    exits: deque[float] = field(default_factory=deque)  # its unexpected exits within the window
    num_starts: int = 0
    draining_since: float | None = None
    failed: bool = False
    ready: bool = False  # listed ready by the router (the router itself: it answers)
    served: bool = False  # its process was listed ready at least once
    work: int | None = None  # from the router's GET /workers; None when unknown
    host: str = HOST  # where it is reached (reach_host of where it listens)

    @property
    def url(self) -> str:
        return http_url(self.host, self.port)

    @property
    def live(self) -> bool:
        """Part of the pool as it will be: neither failed nor on its way out."""
        return not self.failed and self.draining_since is None

    @property
    def state(self) -> SlotState:
        if self.failed:
            return "failed"
        if self.draining_since is not None:
            return "draining"
        return "ready" if self.ready and self.process is not None else "starting"


@dataclass(frozen=True, slots=True)
class ProcessHost:
    """What the supervisor uses of the machine: its clock, how a process starts, a free port (the
    tests inject fakes, module docstring)."""

    clock: Callable[[], float] = time.monotonic
    spawn: Callable[[list[str]], Process] = ChildProcess
    new_port: Callable[[], int] = free_port


class Supervisor:
    """The processes of one `pdserve up`, kept running (see the module docstring)."""

    def __init__(self, command: CommandLine, *, registry: CollectorRegistry, policy: RestartPolicy = RestartPolicy(),
                 host: ProcessHost | None = None, reserved_ports: Collection[int] = (),
                 reach: str = HOST) -> None:
        """`reach`: the address its processes are reached at (they listen where up --host says)."""
        host = host or ProcessHost()
        self._reach = reach
        self.policy = policy
        self._command = command
        self._clock = host.clock
        self._spawn = host.spawn
        self._new_port = host.new_port
        self._reserved_ports = set(reserved_ports)
        self._slots: list[Slot] = []
        self._num_created: Tally[SlotRole] = Tally()
        self._stopped = False
        self._lock = threading.RLock()
        self._registry = registry
        self._restarts = Counter("pdserve:supervisor_restarts", "Processes restarted after an unexpected exit",
                                 ["role"], registry=registry)
        for role in ROLES:
            self._restarts.labels(role)  # every series exists from the start, at 0
        registry.register(_SlotCollector(self))


    def add(self, role: SlotRole, port: int | None = None) -> Slot:
        """A new slot (on a new free port unless given); its process starts at the next `tick`."""
        with self._lock:
            index = self._num_created[role]
            self._num_created[role] += 1
            name = role if role == "router" and index == 0 else f"{role}-{index}"
            slot = Slot(name, role, port or self._unused_port(), seq=sum(self._num_created.values()), host=self._reach)
            self._slots.append(slot)
            return slot

    def _unused_port(self) -> int:
        taken = self._reserved_ports | {s.port for s in self._slots}
        while (port := self._new_port()) in taken:
            pass
        return port

    def drain(self, slot: Slot) -> None:
        """Take `slot` out: SIGTERM its process (a worker stops taking work, finishes what it has,
        exits 0); once it exits the slot is removed, not restarted. A slot with no process goes at once."""
        with self._lock:
            if slot not in self._slots or slot.draining_since is not None:
                return
            slot.draining_since = self._clock()
            if slot.process is None:
                self._slots.remove(slot)
                logger.info("%s removed (it was not running)", slot.name)
                return
            logger.info("%s draining: it finishes what it has and exits", slot.name)
            slot.process.signal(signal.SIGTERM)

    def drain_candidate(self, role: SlotRole) -> Slot | None:
        """The live slot of `role` with the least work (as the router last listed it; a slot it
        does not list has none); among equals the newest."""
        with self._lock:
            return min(self.live(role), key=lambda s: (s.work or 0, -s.seq), default=None)

    def scale(self, role: SlotRole, desired: int) -> None:
        """Add slots, or drain the least busy ones, until `role` has `desired` live slots."""
        with self._lock:
            for _ in range(desired - len(self.live(role))):
                self.add(role)
            for _ in range(len(self.live(role)) - desired):
                if (slot := self.drain_candidate(role)) is not None:
                    self.drain(slot)

    def slots(self) -> list[Slot]:
        with self._lock:
            return list(self._slots)

    def live(self, role: SlotRole) -> list[Slot]:
        with self._lock:
            return [s for s in self._slots if s.role == role and s.live]

    def num_workers(self) -> int:
        """Live worker slots (prefill, decode, replica): the pool the thread split is for."""
        return sum(len(self.live(role)) for role in ROLES if role != "router")

    def restarts(self, role: SlotRole) -> int:
        return int(self._registry.get_sample_value("pdserve:supervisor_restarts_total", {"role": role}) or 0)


    def tick(self) -> None:
        """Start what is due, notice what exited, kill a drain that overran. Call it often (~5/s)."""
        with self._lock:
            if self._stopped:
                return
            now = self._clock()
            for slot in list(self._slots):
                if slot.process is None:
                    if not slot.failed and now >= slot.start_at:
                        self._start(slot, now)
                elif (status := slot.process.poll()) is not None:
                    self._exited(slot, f"status {status}", now)
                elif slot.draining_since is not None and now - slot.draining_since > self.policy.drain_timeout_s:
                    logger.error("%s still draining after %.0f s: killing it", slot.name, self.policy.drain_timeout_s)
                    slot.process.signal(signal.SIGKILL)

    def _start(self, slot: Slot, now: float) -> None:
        argv = self._command(slot.role, slot.port, self.num_workers())
        if slot.num_starts:
            self._restarts.labels(slot.role).inc()
        slot.num_starts += 1
        slot.started_at, slot.ready, slot.served, slot.work = now, False, False, None
        try:
            slot.process = self._spawn(argv)
        except OSError as exc:
            self._exited(slot, f"an error starting it ({exc})", now)

    def _exited(self, slot: Slot, how: str, now: float) -> None:
        slot.process, slot.ready, slot.work = None, False, None
        if slot.draining_since is not None:
            self._slots.remove(slot)
            if not slot.served:  # NOTE: SIGTERM before it serves ends it at once (-15): it had no work
                logger.info("%s drained before it was ready (exited with %s); removed", slot.name, how)
            else:
                (logger.info if how == "status 0" else logger.warning)("%s drained and exited with %s; removed",
                                                                      slot.name, how)
            return
        slot.exits.append(now)
        while now - slot.exits[0] > self.policy.window_s:
            slot.exits.popleft()
        if len(slot.exits) >= self.policy.max_exits:
            slot.failed = True
            logger.error("%s failed: %d exits in %g s; not restarting", slot.name, len(slot.exits),
                         self.policy.window_s)
            return
        slot.delay_s = self.policy.next_delay_s(slot.delay_s, now - slot.started_at)
        slot.start_at = now + slot.delay_s
        logger.warning("%s (%s, %s) exited with %s; restarting in %g s", slot.name, slot.role, slot.url, how,
                       slot.delay_s)

    def observe_pool(self, entries: Sequence[PoolEntry] | None) -> None:
        """What the router's GET /workers said (None: the router did not answer)."""
        with self._lock:
            listed = {e.url: e for e in entries or ()}
            for slot in self._slots:
                if slot.role == "router":
                    slot.ready = entries is not None
                elif entries is not None:
                    entry = listed.get(slot.url)
                    slot.ready = entry is not None and entry.ready
                    slot.work = None if entry is None else entry.work
                slot.served = slot.served or (slot.ready and slot.process is not None)

    def hopeless(self) -> str | None:
        """Why the deployment cannot serve any more: every slot of a role (the router's one) failed."""
        with self._lock:
            for role in ROLES:
                slots = [s for s in self._slots if s.role == role]
                if slots and all(s.failed for s in slots):
                    return f"every {role} slot failed ({', '.join(s.name for s in slots)})"
            return None


    def stop(self, hurried: Callable[[], bool] = lambda: False, grace_s: float = 15.0) -> None:
        """SIGTERM the processes in two phases (`_STOPPED_FIRST`): the router and prefill (each drains:
        finishes what it has, takes nothing new), then, once every prefill worker has exited, decode
        and colocated replicas. Decode is there for every hand-off prefill finishes, so no prefill
        worker sees the decode worker it sends KV to leave (and warns of a lost peer) during a
        deliberate stop; the router is not waited for (an open event stream would hold it), nor
        prefill past half of `grace_s`. SIGKILL what is left after `grace_s` or as soon as
        `hurried()`; returns once every process has exited. Nothing is (re)started after this."""
        with self._lock:
            self._stopped = True
            order = [(s.role, p) for s in sorted(self._slots, key=lambda s: (s.role != "router", -s.seq))
                     if (p := s.process) is not None]
        first = [p for role, p in order if role in _STOPPED_FIRST]
        prefill = [p for role, p in order if role == "prefill"]
        rest = [p for role, p in order if role not in _STOPPED_FIRST]
        started = time.monotonic()

        def wait_for(processes: list[Process], until: float) -> None:
            while any(p.poll() is None for p in processes) and not hurried() and time.monotonic() < until:
                time.sleep(0.05)

        for process in first:
            process.signal(signal.SIGTERM)
        # NOTE: a prefill worker still there after half the grace does not cost decode its drain: decode
        # always has at least that half
        wait_for(prefill, started + grace_s / 2)
        if not hurried():
            for process in rest:
                process.signal(signal.SIGTERM)
            wait_for(first + rest, started + grace_s)
        for process in first + rest:
            if process.poll() is None:
                process.signal(signal.SIGKILL)
                process.wait()

    def count(self) -> Tally[tuple[SlotRole, SlotState]]:
        with self._lock:
            return Tally((s.role, s.state) for s in self._slots)


class _SlotCollector(Collector):
    """pdserve:supervisor_workers{role,state}, read at scrape time."""

    def __init__(self, supervisor: Supervisor) -> None:
        self._supervisor = supervisor

    def collect(self) -> Iterator[GaugeMetricFamily]:
        gauge = GaugeMetricFamily("pdserve:supervisor_workers",
                                  "Processes of `pdserve up` by role and state (starting: started or waiting to "
                                  "restart, not ready yet)", labels=["role", "state"])
        count = self._supervisor.count()
        for role in ROLES:
            for state in STATES:
                gauge.add_metric([role, state], count[(role, state)])
        yield gauge


def exit_with_supervisor(poll_s: float = 1.0) -> None:
    """A process `pdserve up` started (PDSERVE_SUPERVISOR_PID set) drains and exits once that
    supervisor is gone, however it went (even SIGKILL, which it cannot pass on): SIGTERM to itself,
    which a server handles as a drain."""
    from pdserve import envs

    supervisor = envs.supervisor_pid()
    if supervisor is None:
        return

    def watch() -> None:
        while os.getppid() == supervisor:
            time.sleep(poll_s)
        logging.getLogger("pdserve").warning("supervisor %d is gone: draining and exiting", supervisor)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="pdserve-supervisor-watch", daemon=True).start()
