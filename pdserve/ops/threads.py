"""How many torch threads each worker of `pdserve up` gets: the machine's cores split evenly over
the pool as it is when the worker starts, and a log line whenever the pool outgrows the cores.

A running worker keeps the count it started with (torch cannot change it from outside); a worker
started later, or restarted, gets the split of the pool as it is then.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def num_cpus() -> int:
    return os.cpu_count() or 1


def threads_per_worker(num_workers: int, cpus: int | None = None) -> int:
    """CPUs // workers, at least 1."""
    return max(1, (cpus or num_cpus()) // max(1, num_workers))


class CoreShare:
    """Says in the log when the number of workers exceeds the cores, once per change of that number
    (and once when it fits again), instead of oversubscribing silently."""

    def __init__(self, cpus: int | None = None) -> None:
        self.cpus = cpus or num_cpus()
        self._num_workers = 0
        self._oversubscribed = False

    def note(self, num_workers: int) -> str | None:
        """Call with the pool's size whenever it may have changed; returns the line it logged, if any."""
        if num_workers == self._num_workers:
            return None
        self._num_workers = num_workers
        line = None
        if num_workers > self.cpus:
            line = (f"pdserve up: {num_workers} workers on {self.cpus} cores: oversubscribed "
                    f"({threads_per_worker(num_workers, self.cpus)} thread each); expect slower steps")
        elif self._oversubscribed:
            line = f"pdserve up: {num_workers} workers on {self.cpus} cores: no longer oversubscribed"
        self._oversubscribed = num_workers > self.cpus
        if line is not None:
            logger.warning(line)
        return line


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """'0-3,6' -> (0, 1, 2, 3, 6), as taskset and /sys/fs/cgroup write core lists."""
    cores: set[int] = set()
    for part in text.split(","):
        low, dash, high = part.strip().partition("-")
        try:
            first, last = int(low), int(high) if dash else int(low)
        except ValueError:
            raise ValueError(f"{text!r}: expected a core list like 0-3,6") from None
        if not 0 <= first <= last:
            raise ValueError(f"{text!r}: expected a core list like 0-3,6 (ranges low-high, from 0)")
        cores.update(range(first, last + 1))
    return tuple(sorted(cores))


def format_cpu_list(cores: tuple[int, ...]) -> str:
    return ",".join(str(c) for c in cores)


def pin_to(cores: tuple[int, ...]) -> None:
    """This process (and the threads it starts from now on) on `cores` only; a clear error for a
    core this machine does not have or this process may not use."""
    allowed = os.sched_getaffinity(0)
    if missing := sorted(set(cores) - allowed):
        raise ValueError(f"--cpu-affinity: core(s) {missing} not available to this process "
                         f"(allowed: {format_cpu_list(tuple(sorted(allowed)))})")
    os.sched_setaffinity(0, cores)
    logger.info("pinned to core(s) %s", format_cpu_list(cores))


class CorePlan:
    """`pdserve up --cpus-per-worker K`: each worker its own K cores (one worker = one "device"),
    handed out in blocks in the order workers are first started, wrapping round (and said in the
    log) when there are more workers than blocks. A worker restarted on the same port keeps its
    cores."""

    def __init__(self, per_worker: int, cores: tuple[int, ...] | None = None) -> None:
        self.cores = cores or tuple(sorted(os.sched_getaffinity(0)))
        if not 0 < per_worker <= len(self.cores):
            raise ValueError(f"--cpus-per-worker {per_worker}: expected 1 to {len(self.cores)} "
                             f"(the cores this machine gives pdserve)")
        self.per_worker = per_worker
        self._by_port: dict[int, tuple[int, ...]] = {}

    def for_worker(self, port: int) -> tuple[int, ...]:
        if port not in self._by_port:
            n, count = len(self._by_port), len(self.cores)
            if (n + 1) * self.per_worker > count:
                logger.warning("pdserve up: worker %d shares cores with another (%d cores, %d per worker)",
                               n + 1, count, self.per_worker)
            self._by_port[port] = tuple(self.cores[(n * self.per_worker + i) % count] for i in range(self.per_worker))
        return self._by_port[port]
