"""The states a request goes through across the cluster, and who may move it where: one table per
side, here only.

    router     RUN          one run of a request (request_run.py; a resume is a new run)
    decode     RESERVATION  a request's blocks on a decode worker (decode_service.py)
    prefill    ATTEMPT      one prefill attempt of a run on a prefill worker (prefill_service.py)

Each record holds a `State` and moves it with `move`; a move the table does not allow is a bug
(two paths racing over one request: the kind the recovery code had), refused loudly: logged with
the record's history and raised as IllegalTransition, never applied. `docs/ARCHITECTURE.md` shows
the tables (`markdown_table`; a test keeps them equal).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


class IllegalTransition(RuntimeError):
    """A move its lifecycle does not allow (a bug: refused, not applied)."""


@dataclass(frozen=True, slots=True)
class Lifecycle:
    """Named states, the first one the start, and where each may go (terminal states: nowhere)."""

    name: str
    moves: Mapping[str, tuple[str, ...]]
    meaning: Mapping[str, str]  # what each state means, and who moves a record into it

    @property
    def start(self) -> str:
        return next(iter(self.moves))

    def allows(self, old: str, new: str) -> bool:
        return new in self.moves[old]

    def terminal(self, state: str) -> bool:
        return not self.moves[state]

    def markdown_table(self) -> str:
        lines = [f"| {self.name} state | means (moved there by) | may go to |", "|---|---|---|"]
        lines += [f"| `{s}` | {self.meaning[s]} | {', '.join(f'`{t}`' for t in to) or '(ends)'} |"
                  for s, to in self.moves.items()]
        return "\n".join(lines)


@dataclass(slots=True)
class State:
    """One record's place in its lifecycle, and the way it came."""

    lifecycle: Lifecycle
    subject: str  # the request or attempt id, for the log
    now: str = ""
    history: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.now = self.now or self.lifecycle.start
        self.history.append(self.now)

    def move(self, new: str) -> None:
        """Move to `new`; IllegalTransition (logged, nothing changed) where the table forbids it."""
        if new not in self.lifecycle.moves:
            raise IllegalTransition(f"{self.lifecycle.name} {self.subject}: no state {new!r}")
        if not self.lifecycle.allows(self.now, new):
            message = (f"{self.lifecycle.name} {self.subject}: {self.now} -> {new} is not allowed "
                       f"(came {' -> '.join(self.history)})")
            logger.error("%s", message)
            raise IllegalTransition(message)
        self.now = new
        self.history.append(new)

    def is_in(self, *states: str) -> bool:
        return self.now in states

    @property
    def ended(self) -> bool:
        return self.lifecycle.terminal(self.now)


class Run(enum.StrEnum):
    RESERVING = "reserving"
    PREFILLING = "prefilling"
    STREAMING = "streaming"
    FINISHED = "finished"
    LOST = "lost"
    FAILED = "failed"


RUN = Lifecycle("run", {
    Run.RESERVING: (Run.PREFILLING, Run.FAILED),
    Run.PREFILLING: (Run.STREAMING, Run.FINISHED, Run.LOST, Run.FAILED),
    Run.STREAMING: (Run.FINISHED, Run.LOST, Run.FAILED),
    Run.FINISHED: (),
    Run.LOST: (),
    Run.FAILED: (),
}, {
    Run.RESERVING: "admitted (or resumed after a decode loss), its prefill job perhaps sent unplaced; "
                   "asking decode workers for blocks (router)",
    Run.PREFILLING: "blocks reserved; prefilled through the queue, retried on a stalled transfer, or on "
                    "decode (router)",
    Run.STREAMING: "the first output went to the client, from prefill (early first token) or decode (router)",
    Run.FINISHED: "the request's last output went out (router)",
    Run.LOST: "its decode worker went away, or its attempt failed there: the router resumes the request "
              "as a new run over prompt + tokens sent (router)",
    Run.FAILED: "an error for the client, or the client left: aborted on every worker (router)",
})


class Reservation(enum.StrEnum):
    AWAITING_KV = "awaiting_kv"
    RECEIVING = "receiving"
    RETRY_ASKED = "retry_asked"
    DECODING = "decoding"
    PREFILLING_HERE = "prefilling_here"
    ENDED = "ended"


# the reservation states in which a payload of the current attempt is wanted
WAITING_FOR_KV = (Reservation.AWAITING_KV, Reservation.RECEIVING, Reservation.RETRY_ASKED)
RESERVATION = Lifecycle("reservation", {
    Reservation.AWAITING_KV: (Reservation.AWAITING_KV, Reservation.RECEIVING, Reservation.RETRY_ASKED,
                              Reservation.DECODING, Reservation.PREFILLING_HERE, Reservation.ENDED),
    Reservation.RECEIVING: (Reservation.AWAITING_KV, Reservation.RETRY_ASKED, Reservation.DECODING,
                            Reservation.PREFILLING_HERE, Reservation.ENDED),
    Reservation.RETRY_ASKED: (Reservation.AWAITING_KV, Reservation.RECEIVING, Reservation.DECODING,
                              Reservation.PREFILLING_HERE, Reservation.ENDED),
    Reservation.DECODING: (Reservation.PREFILLING_HERE, Reservation.ENDED),
    Reservation.PREFILLING_HERE: (Reservation.ENDED,),
    Reservation.ENDED: (),
}, {
    Reservation.AWAITING_KV: "blocks held, the receiver expects the current attempt, no payload yet: the "
                             "lease runs, keepalives extend it (reserve; retarget to a new attempt)",
    Reservation.RECEIVING: "the attempt's payloads arrive: the transfer timeout runs (its KV watcher)",
    Reservation.RETRY_ASKED: "a transfer timeout, or prefill gave the attempt up: the router was asked for "
                             "a new attempt, the old one still heard until it comes (once per request)",
    Reservation.DECODING: "the final message arrived: the first token is out, the engine decodes (its "
                          "KV watcher)",
    Reservation.PREFILLING_HERE: "decode computes the prompt itself: the router's conditional "
                                 "disaggregation, the recompute failure policy, or an invalid hand-off",
    Reservation.ENDED: "its stream ended: finished, aborted, failed (lease, refusal, failure policy "
                       "`fail`), or the router left (stream, abort, fail)",
})


class Attempt(enum.StrEnum):
    COMPUTING = "computing"
    HANDING_OFF = "handing_off"
    HANDED_OFF = "handed_off"
    TIMED_OUT = "timed_out"
    FAILED = "failed"
    ABORTED = "aborted"


ATTEMPT = Lifecycle("attempt", {
    Attempt.COMPUTING: (Attempt.HANDING_OFF, Attempt.TIMED_OUT, Attempt.FAILED, Attempt.ABORTED),
    Attempt.HANDING_OFF: (Attempt.HANDED_OFF, Attempt.TIMED_OUT, Attempt.FAILED, Attempt.ABORTED),
    Attempt.HANDED_OFF: (),
    Attempt.TIMED_OUT: (),
    Attempt.FAILED: (),
    Attempt.ABORTED: (),
}, {
    Attempt.COMPUTING: "the engine took the job (placed, or waiting for its placement); its layers "
                       "stream as they are computed, keepalives go to decode (submit)",
    Attempt.HANDING_OFF: "prefill done: the first token and sampler state go in the final message, then "
                         "the flush until decode acknowledged everything (its task)",
    Attempt.HANDED_OFF: "decode has all of it; the blocks are released (its task)",
    Attempt.TIMED_OUT: "no placement named in time, or decode stopped acknowledging: decode is told the "
                       "attempt ended (its task)",
    Attempt.FAILED: "the engine or the transport failed it; the queue ends the request on decode (its task)",
    Attempt.ABORTED: "cancelled by its router or queue (a retry superseded it, the client left, its answer "
                     "was cut) (abort; one that came before the job, or before its task started, ends it "
                     "as it starts)",
})

LIFECYCLES = (RUN, RESERVATION, ATTEMPT)
