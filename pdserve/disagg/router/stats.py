"""What the PD router shows of itself: its pool (`WorkerView`) and its admission queue and counters
(`RouterStats`), as frozen snapshots.

The router (router/core.py) fills them in and satisfies `RouterState`; router/metrics.py (its /metrics
and live dashboard) and router/app.py (GET /workers, GET /router/stats) read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

from pdserve.disagg.control import WorkerRole


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """What a worker last advertised (GET /pd/info)."""

    num_running: int
    num_waiting: int
    num_free_kv_blocks: int
    num_kv_blocks: int
    block_size: int = 0  # tokens per KV block (its KV layout)
    max_lora: int = 0  # LoRA slots (0: no LoRA), and the adapters of its running and waiting requests
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One worker of the router's pool. Field order is GET /workers' JSON order."""

    role: WorkerRole
    url: str
    ready: bool  # answers GET /pd/info and says it is ready (not draining, engine alive)
    in_flight: int  # this router's requests (decode) or jobs (prefill) on it now
    draining: bool
    load: WorkerLoad | None  # None while it does not answer


@dataclass(frozen=True, slots=True)
class Rejections:
    """Requests the router refused since it started, by reason (GET /router/stats: `rejected_<reason>`)."""

    invalid: int = 0  # 400: can never run (too long, token ids out of the vocabulary)
    queue_full: int = 0  # 429: too many requests (or prompt tokens) admitted and waiting
    no_prefill_worker: int = 0  # 503: no ready prefill worker (or no live queue consumer)
    no_decode_worker: int = 0  # 503: no ready decode worker
    no_kv_room: int = 0  # 503: no decode worker had room before the reserve deadline
    queue_unavailable: int = 0  # 503: the shared queue (Redis) is unreachable
    first_token_timeout: int = 0  # 503: no first token within the router's first-token deadline


@dataclass(frozen=True, slots=True)
class RouterEvents:
    """What else the router did since it started."""

    kv_retries: int = 0  # new prefill attempts after a decode worker reported a stalled transfer
    redispatched: int = 0  # jobs queued again after their prefill worker was lost or drained (memory queue)
    resumed: int = 0  # requests moved to another decode worker after losing theirs
    prefilled_on_decode: int = 0  # conditional disaggregation: the decode worker prefilled the rest itself


@dataclass(frozen=True, slots=True)
class Recoveries:
    """Requests resumed after a decode loss, by where their prompt's KV came from
    (`pdserve:kv_recoveries_total{source}`; memory queue only: see disagg/queue/base.py)."""

    prefill_cache: int = 0  # the prefill worker took it from its prefix cache (pool or disk tier)
    recompute: int = 0  # computed again: no prefill worker held it, or decode prefilled it itself


@dataclass(frozen=True, slots=True)
class IndexResets:
    """Times the router dropped a worker's KV-event index, by reason (router/kv_index.py
    RESET_REASONS; `pdserve:kv_events_index_resets_total{worker_role, reason}`)."""

    gap: int = 0  # batches missed and not replayed
    restart: int = 0  # the worker's sequence started again at 0
    bad_batch: int = 0  # a batch that does not decode
    worker_changed: int = 0  # a new instance id or event endpoint at the worker's URL


@dataclass(frozen=True, slots=True)
class RouterStats:
    """The router's admission queue, prefill queue and counters (GET /router/stats)."""

    queued_requests: int  # admitted, first token not out yet
    queued_tokens: int  # their prompt tokens
    dispatch_pending: int  # prefill jobs waiting in the router's own FIFO (memory queue; 0 for Redis)
    queue_backlog: int  # prefill jobs no prefill worker has taken yet: the FIFO (memory) or the group's lag (Redis)
    queue: Literal["memory", "redis"]
    live_queue_consumers: int  # Redis: prefill workers pulling from the shared queue (0 for memory)
    queue_error: str  # why the queue is unreachable; "" when it is fine
    rejections: Rejections
    events: RouterEvents
    recoveries: Recoveries = field(default_factory=Recoveries)
    # the roles whose KV-cache events the router follows (--decode-policy / --prefill-policy kv-events)
    index_resets: dict[WorkerRole, IndexResets] = field(default_factory=dict)


class RouterState(Protocol):
    """What the router's metrics and dashboard (router/metrics.py) read from the PD router. Called on
    the event loop."""

    def workers(self) -> list[WorkerView]: ...

    def stats(self) -> RouterStats: ...
