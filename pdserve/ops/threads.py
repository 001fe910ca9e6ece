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
