"""One prefill attempt's record on its prefill worker (worker/prefill_service.py)."""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass

from pdserve.disagg.attempt_states import State
from pdserve.disagg.control import FirstToken, HandOff


@dataclass(slots=True)
class PrefillAttempt:
    """One prefill attempt, from the engine taking it until its hand-off ended. Event-loop only."""

    task: asyncio.Task[HandOff]  # computes it, hands it off, releases its blocks
    decode_url: str  # the decode worker expecting it, told it is alive ("": nobody to tell)
    num_uncomputed_tokens: int  # prompt tokens still to compute (0 once the first token is out)
    token: str  # the decode reservation's, which every KV message of the attempt presents
    state: State  # where it is in its lifecycle (attempt_states.ATTEMPT)
    seeded: bool = True  # has a seeded generator, whose state decode needs (Request.generator)
    # the sender (handle) to its decode worker, once its reservation is known (at once for a placed job)
    placed: asyncio.Future[int] = dataclasses.field(
        default_factory=lambda: asyncio.get_running_loop().create_future())
    # the sender a placement under way hands to the engine, before `placed` is set: the attempt's
    # end releases through it too (a send it started must stop reading the blocks before they go)
    placing: int | None = None
    # a placement that came, while its sender connects to the decode worker (the first placement
    # there, a handshake): `_placement` waits for that beside the transfer timeout
    connecting: asyncio.Future[int] | None = None
    # the LoRA adapter it runs under and its weights' digest here (the hand-off names both); asked
    # of the engine beside the job, so the hand-off never waits for it
    lora: asyncio.Future[tuple[str | None, str]] | None = None
    # its first token once sampled, before the hand-off (None: it ended without one)
    first_token: asyncio.Future[FirstToken | None] = dataclasses.field(
        default_factory=lambda: asyncio.get_running_loop().create_future())
    # done once the stream its router pushed the job on closed (PrefillService.held_open)
    held: asyncio.Future[None] | None = None
    started: bool = False  # its task took its first step: from then on an abort cancels it
    aborted: bool = False  # an abort came before that (or before the record): the task ends so at once
