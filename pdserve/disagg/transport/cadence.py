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

What was seen only teaches a deadline after a slow gap happened (the first ones under a new load
timed out). So the sending side also says how it is doing: a prefill worker's keepalives carry its
engine's step time (`Keepalive.step_s`: the longest step of the last few seconds, the running one
included, as `StepClock` measures it), and a wait's deadline is `FACTOR` times the larger of that and
the longest gap seen (`Cadence.timeout_s`'s `announced_s`). A chunk that takes seconds on a busy
machine stretches the deadline while it runs, from the first request on. A hung engine stops the
keepalives (its step runs past `StepClock.stuck`), a dead one ends its attempts: the peer goes
silent, and the last deadline it announced, capped, ends the wait.

A peer never heard from has neither history nor an announcement: the first hand-off to a decode
worker that has decoded nothing yet (its first acknowledgements come while its engine starts its
first steps) timed out at the bare floor on a busy machine. So a cadence made with `first_contact_s`
takes that as its longest gap until it sees the first real one: the first waits on a new peer get
`FACTOR` times it (2 s), and from the first sign of progress on only what the peer did counts.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

FACTOR = 4.0  # a wait gives up after this many times the longest recent gap between signs of progress
HALF_LIFE_S = 60.0  # the longest gap seen halves in this long
CAP_S = 10.0  # never wait longer than this for a sign of progress (unless the floor says so)
STEP_HALF_LIFE_S = 5.0  # an engine's longest recent step halves in this long (what keepalives announce)
ENGINE_STUCK_S = 30.0  # an engine step running this long is a hung engine: no keepalive vouches for it
FIRST_CONTACT_S = 0.5  # the gap assumed of a peer not heard from yet (its first waits: FACTOR times it)


class Cadence:
    """A decaying maximum of the gaps between signs of progress; thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, half_life_s: float = HALF_LIFE_S,
                 first_contact_s: float = 0.0) -> None:
        self._clock = clock
        self._half_life_s = half_life_s
        self._lock = threading.Lock()
        self._gap_s = 0.0
        self._at = self._clock()
        self._unheard_s = first_contact_s  # until the first sign of progress: the gap assumed (then 0)

    def saw(self, gap_s: float) -> None:
        """A sign of progress came `gap_s` after the previous one (of the same transfer)."""
        now = self._clock()
        with self._lock:
            self._gap_s = max(gap_s, self._decayed(now))
            self._at = now
            self._unheard_s = 0.0

    def timed_out(self, waited_s: float) -> None:
        """A wait gave up after `waited_s`: the peer went at least that long without progress. If
        it was only slow, the next wait is longer (FACTOR times); if it is gone, its connection or
        the lease ends what is left, and the longer deadline decays away. A peer never heard from
        teaches nothing by its silence: its next wait gets the first-contact allowance again."""
        with self._lock:
            if self._unheard_s > 0:
                return
        self.saw(waited_s)

    def longest_gap_s(self) -> float:
        with self._lock:
            return max(self._decayed(self._clock()), self._unheard_s)

    def timeout_s(self, floor_s: float, announced_s: float = 0.0) -> float:
        """How long a wait for the next sign of progress may take: `floor_s` at least, `FACTOR`
        times the longest recent gap or the step time the peer announced (`announced_s`), at most
        `CAP_S` (or the floor, when that is longer)."""
        return deadline_s(floor_s, max(self.longest_gap_s(), announced_s))

    def _decayed(self, now: float) -> float:
        return self._gap_s * math.exp2(-(now - self._at) / self._half_life_s)


def deadline_s(floor_s: float, peer_s: float) -> float:
    """max(floor, FACTOR x the peer's time between signs of progress), capped (see `Cadence.timeout_s`)."""
    if not math.isfinite(peer_s) or peer_s < 0:
        peer_s = 0.0  # NOTE: what a peer announces is not trusted to be sane
    return min(max(floor_s, FACTOR * peer_s), max(floor_s, CAP_S))


class StepClock:
    """The sending side's own step time, as its keepalives announce it (`Keepalive.step_s`).

    The API process does not see the engine start a step, only finish one (`EngineClient.last_step_s`,
    which an engine process reports too), so a step is taken to run from the later of the last step's
    end and the moment work reached an idle engine (`busy`): an engine idle for minutes is not "in a
    step since minutes" when a request comes. `sample` is called at each keepalive; the step running
    then counts at its age so far (it only grows: a chunk of seconds stretches the deadline as it
    runs). Event-loop only."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, stuck_s: float = ENGINE_STUCK_S) -> None:
        self._clock = clock
        self.stuck_s = stuck_s
        self._longest = Cadence(clock, half_life_s=STEP_HALF_LIFE_S)
        self._busy_since = -math.inf
        self._running_s = 0.0

    def busy(self) -> None:
        """Work reached the engine while it computed nothing: a step starts about now."""
        self._busy_since = self._clock()

    def sample(self, last_step_end_s: float, computing: bool) -> None:
        """At a keepalive: the engine last finished a step at `last_step_end_s` (its client's clock,
        the same monotonic one); `computing`: some job is still computing (else no step runs)."""
        self._running_s = self._clock() - max(last_step_end_s, self._busy_since) if computing else 0.0
        self._longest.saw(self._running_s)

    @property
    def stuck(self) -> bool:
        """The running step has run past `stuck_s`: a hung engine, which keepalives must not vouch for."""
        return self._running_s > self.stuck_s

    def step_s(self) -> float:
        """The longest step of the last few seconds (half-life `STEP_HALF_LIFE_S`), the running one included."""
        return max(self._running_s, self._longest.longest_gap_s())
