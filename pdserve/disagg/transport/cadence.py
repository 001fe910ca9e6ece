"""How long a transfer may go without progress before its peer is judged gone or stuck.

A fixed 100 ms is right for a peer that answers at once and wrong for one computing a long chunk
on a busy machine: on 2 shared cores healthy hand-offs timed out and were retried (a third of
them under a mixed 100-1,000-token load). `Cadence` watches how long the peers of one receiver
(or one sender) actually go between signs of progress (KV payloads, keepalives, acknowledgements)
and a wait gives up only after `FACTOR` times the longest recent gap: the configured timeout
(`--kv-transfer-timeout-ms`) is only the floor. A wait that timed out counts as a gap of its
length, and an acknowledgement that comes after its wait gave up as the gap it really was. The
longest gap decays (half-life `HALF_LIFE_S`), so a load that passed stops stretching the
deadline; `CAP_S` bounds how long a dead peer can keep a request waiting whatever the history. A
peer that stops altogether (killed, hung) sends nothing more, so it still times out, just after a
deadline that matches how it behaved when alive.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

FACTOR = 4.0  # a wait gives up after this many times the longest recent gap between signs of progress
HALF_LIFE_S = 60.0  # the longest gap seen halves in this long
CAP_S = 10.0  # never wait longer than this for a sign of progress (unless the floor says so)


class Cadence:
    """A decaying maximum of the gaps between signs of progress; thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._gap_s = 0.0
        self._at = self._clock()

    def saw(self, gap_s: float) -> None:
        """A sign of progress came `gap_s` after the previous one (of the same transfer)."""
        now = self._clock()
        with self._lock:
            self._gap_s = max(gap_s, self._decayed(now))
            self._at = now

    def timed_out(self, waited_s: float) -> None:
        """A wait gave up after `waited_s`: the peer went at least that long without progress. If
        it was only slow, the next wait is longer (FACTOR times); if it is gone, its connection or
        the lease ends what is left, and the longer deadline decays away."""
        self.saw(waited_s)

    def longest_gap_s(self) -> float:
        with self._lock:
            return self._decayed(self._clock())

    def timeout_s(self, floor_s: float) -> float:
        """How long a wait for the next sign of progress may take: `floor_s` at least, `FACTOR`
        times the longest recent gap, at most `CAP_S` (or the floor, when that is longer)."""
        return min(max(floor_s, FACTOR * self.longest_gap_s()), max(floor_s, CAP_S))

    def _decayed(self, now: float) -> float:
        return self._gap_s * math.exp2(-(now - self._at) / HALF_LIFE_S)
