"""The event loop: a client, a router, and colocated replicas or P prefill + D decode workers.

Model (what it includes, what it leaves out):
- Client: request i is due at its arrival offset (bench's gamma arrivals) and is sent when fewer
  than `max_concurrency` are in flight (bench's semaphore). With `dispatch_s` > 0 the client
  sends one request at a time, `dispatch_s` apart, and each reaches the router `dispatch_s` after
  it was sent: a worker that has work starts its next step at once, so a request sent as another
  finished, or the later ones of a burst, wait for the step after (as over HTTP); 0: every
  request of an instant is there when the workers schedule.
- Router: admits at most `max_queued_requests` requests waiting for their first token (else a
  429, as the real router); a request whose prompt and output cannot fit a worker's KV pool at all
  is refused. Colocated: the replica with the fewest unfinished requests. PD: first a KV
  reservation (prompt + 1 tokens) on the decode worker with the fewest unfinished requests that
  has room (requests wait at the router, in order, until one has), then the router's prefill FIFO
  (a worker takes jobs while they fit its token budget; see `_dispatch_prefill`).
- Workers: worker.py's scheduler; a step lasts the profile's step time.
- Hand-off: the prefill step that completes a prompt samples the first token; its KV then moves
  to decode over the transport model (layer-wise: only the part not hidden behind the prefill
  step remains); the client sees the first token when the KV has arrived, then decode generates
  the rest. Prefill keeps the blocks until the transfer ends. Transfers do not contend for links.
- The PD path's costs (a calibrated profile's `pd_path`, profile.PDPathCosts): the first token
  reaches the client `first_token_s + relay_delay(w)` after the prefill step that sampled it (the
  router, the `/pd/*` hops, the early first token's way back; w: the requests streaming, past
  their first token, when that step ended), and every later token and the request's end take the
  same `relay_delay(w)`; the decode worker gets a request `handoff(n)` after its transfer ended
  (the hand-off's messages, the token relay through the router; n: the other requests admitted
  and not yet at their decode worker then: a wave's hand-offs wait behind the rest of it). No
  token reaches the client before the first (the router relays them in order).
- Not modelled: network and HTTP latency beyond `dispatch_s`, detokenization, prefix caching, swap.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.sizing.profile import PDPathCosts, StepModel, TransferModel
from pdserve.sizing.sim.request import SimRequest
from pdserve.sizing.sim.worker import SimWorker, StepPlan, WorkerLimits

_ARRIVAL, _STEP_END, _TRANSFER_DONE, _DELIVER, _AT_DECODE, _END = 0, 1, 2, 3, 4, 5


@dataclass(frozen=True, slots=True)
class Topology:
    """`num_colocated` > 0: that many colocated replicas; else `num_prefill` + `num_decode`."""

    num_colocated: int = 0
    num_prefill: int = 0
    num_decode: int = 0

    def __post_init__(self) -> None:
        pd = self.num_prefill > 0 and self.num_decode > 0
        mixed = self.num_colocated > 0 and self.num_prefill + self.num_decode > 0
        if (self.num_colocated > 0) == pd or mixed or min(self.num_colocated, self.num_prefill, self.num_decode) < 0:
            raise ValueError("simulate either --colocated N or --prefill P --decode D (all >= 1)")

    @property
    def is_pd(self) -> bool:
        return self.num_colocated == 0

    @property
    def num_devices(self) -> int:
        return self.num_colocated or self.num_prefill + self.num_decode

    def __str__(self) -> str:
        return f"colocated x{self.num_colocated}" if self.num_colocated else f"PD {self.num_prefill}:{self.num_decode}"


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    topology: Topology
    step: StepModel
    colocated: WorkerLimits  # also the prefill workers' limits in PD
    decode: WorkerLimits
    transfer: TransferModel | None = None  # None: instantaneous hand-off
    kv_bytes_per_token: int = 0
    num_layers: int = 1
    layerwise: bool = True
    max_queued_requests: int = 512
    decode_step: StepModel | None = None  # PD decode workers' step model, if not `step`
    early_first_token: bool = True  # PD: the client has the first token when prefill sampled it
    dispatch_s: float = 0.0  # a request's way from the client to the router (and the gap between sends)
    prefill_step: StepModel | None = None  # PD prefill workers' step model, if not `step`
    path: PDPathCosts = PDPathCosts()  # PD: what the PD path costs beyond steps and transfers


@dataclass(frozen=True, slots=True)
class Arrival:
    prompt_len: int
    output_len: int
    offset_s: float


class Cluster:
    def __init__(self, spec: ClusterSpec, max_concurrency: int | None) -> None:
        self.spec = spec
        t = spec.topology
        if t.is_pd:
            self.prefill = [SimWorker(i, "prefill", spec.colocated, spec.prefill_step or spec.step)
                            for i in range(t.num_prefill)]
            self.decode = [SimWorker(i, "decode", spec.decode, spec.decode_step or spec.step)
                           for i in range(t.num_decode)]
        else:
            self.prefill = [SimWorker(i, "colocated", spec.colocated, spec.step) for i in range(t.num_colocated)]
            self.decode = []
        self.max_concurrency = max_concurrency or 1 << 62
        self.now_s = 0.0
        self._events: list[tuple[float, int, int, object]] = []
        self._seq = 0
        self._in_flight = 0
        self._awaiting_first = 0  # admitted, KV not yet transferred (colocated: no first token yet)
        self._streaming = 0  # PD: in flight and past the first token (handed off, not yet ended)
        self._in_handoff = 0  # PD: transferred, not yet at the decode worker (paying `PDPathCosts.handoff`)
        self._client_backlog: deque[int] = deque()
        self._router_backlog: deque[SimRequest] = deque()  # PD: waiting for decode KV room
        self._prefill_queue: deque[SimRequest] = deque()  # PD: reserved, waiting for a prefill worker
        self._arrivals: Sequence[Arrival] = ()
        self.requests: list[SimRequest] = []
        self.num_transfers = 0
        self._turn = itertools.count()  # colocated: the balancer's tie-break
        self._last_sent_s = -float("inf")
        self._batching: set[SimWorker] | None = None  # while handling one event: the workers to kick after it

    @property
    def workers(self) -> list[SimWorker]:
        return self.prefill + self.decode

    def _push(self, time_s: float, kind: int, payload: object) -> None:
        self._seq += 1
        heapq.heappush(self._events, (time_s, self._seq, kind, payload))

    def run(self, arrivals: Sequence[Arrival]) -> list[SimRequest]:
        self._arrivals = arrivals
        for i, a in enumerate(arrivals):
            self._push(a.offset_s, _ARRIVAL, i)
        while self._events:
            # NOTE: workers schedule once every event of this instant is handled, so that all it
            # released or sent (simultaneous arrivals, a finished request's successor) is batched
            self.now_s = self._events[0][0]
            self._batching = set()
            while self._events and self._events[0][0] == self.now_s:
                _, _, kind, payload = heapq.heappop(self._events)
                if kind == _ARRIVAL:
                    self._on_arrival(payload)  # type: ignore[arg-type]
                elif kind == _STEP_END:
                    self._on_step_end(*payload)  # type: ignore[misc]
                elif kind == _DELIVER:
                    self._deliver(payload)  # type: ignore[arg-type]
                elif kind == _AT_DECODE:
                    self._at_decode(payload)  # type: ignore[arg-type]
                elif kind == _END:
                    self._end(payload)  # type: ignore[arg-type]
                else:
                    self._on_transfer_done(payload)  # type: ignore[arg-type]
            workers, self._batching = self._batching, None
            for worker in sorted(workers, key=lambda w: (w.role, w.index)):
                self._kick(worker)
        return self.requests

    # -- client and router ------------------------------------------------------------------
    def _on_arrival(self, index: int) -> None:
        if self._in_flight >= self.max_concurrency:
            self._client_backlog.append(index)
        else:
            self._send(index)

    def _send(self, index: int) -> None:
        a = self._arrivals[index]
        request = SimRequest(index, a.prompt_len, a.output_len, self.now_s)
        self.requests.append(request)
        self._in_flight += 1
        if self.spec.dispatch_s <= 0:
            self._deliver(request)
            return
        self._last_sent_s = max(self.now_s, self._last_sent_s + self.spec.dispatch_s)
        self._push(self._last_sent_s + self.spec.dispatch_s, _DELIVER, request)

    def _deliver(self, request: SimRequest) -> None:
        """The request at the router: refused, or routed to a worker."""
        a = self._arrivals[request.index]
        pools = [self.spec.colocated] + ([self.spec.decode] if self.spec.topology.is_pd else [])
        # NOTE: never fits: more KV than a pool, or (without chunked prefill) a prompt over the token
        # budget; the real engine's max_model_len check refuses these with a 400
        if any(-(-(a.prompt_len + a.output_len) // p.block_size) > p.num_kv_blocks or (
                not p.enable_chunked_prefill and a.prompt_len > p.max_num_batched_tokens) for p in pools):
            self._fail(request, "too_long")
        elif self._awaiting_first >= self.spec.max_queued_requests:
            self._fail(request, "http_429")
        else:
            self._awaiting_first += 1
            if self.spec.topology.is_pd:
                self._router_backlog.append(request)
                self._drain_router()
            else:
                # NOTE: as `pdserve balancer`: least in flight, ties taken in turn
                turn, n = next(self._turn), len(self.prefill)
                self._assign(min(self.prefill, key=lambda w: (_load(w), (w.index - turn) % n)), request)

    def _assign(self, worker: SimWorker, request: SimRequest) -> None:
        request.worker = worker.index
        worker.num_unfinished += 1
        worker.waiting.append(request)
        self._kick(worker)

    def _drain_router(self) -> None:
        """PD: reserve decode KV for the requests waiting at the router, in order, then prefill them."""
        while self._router_backlog:
            request = self._router_backlog[0]
            need = -(-(request.prompt_len + 1) // self.spec.decode.block_size)
            roomy = [w for w in self.decode if w.free_blocks >= need]
            if not roomy:
                break
            self._router_backlog.popleft()
            decode = min(roomy, key=_load)
            decode.reserve(need)
            decode.num_unfinished += 1
            request.decode = decode.index
            self._prefill_queue.append(request)
        self._dispatch_prefill()

    def _dispatch_prefill(self) -> None:
        """The router's prefill FIFO (disagg/router/memory_queue.py): a prefill worker takes a job when it
        holds none, or when the job fits its token budget beside the jobs it holds (until their
        hand-off ends); a job that fits nowhere yet does not hold back smaller ones behind it."""
        budget = self.spec.colocated.max_num_batched_tokens
        kept: deque[SimRequest] = deque()
        while self._prefill_queue:
            request = self._prefill_queue.popleft()
            takers = [w for w in self.prefill if w.num_unfinished == 0 or w.held_tokens + request.prompt_len <= budget]
            if not takers:
                kept.append(request)
                if all(w.num_unfinished and w.held_tokens >= budget for w in self.prefill):
                    break  # no room anywhere for any job
                continue
            worker = min(takers, key=lambda w: (w.held_tokens, w.index))
            worker.held_tokens += request.prompt_len
            self._assign(worker, request)
        kept.extend(self._prefill_queue)
        self._prefill_queue = kept

    def _fail(self, request: SimRequest, kind: str) -> None:
        request.error_kind = kind
        self._finish(request)

    def _finish(self, request: SimRequest) -> None:
        if request.relay_s > 0 and request.error_kind is None:
            self._push(self.now_s + request.relay_s, _END, request)  # NOTE: the end's way to the client
            return
        self._end(request)

    def _end(self, request: SimRequest) -> None:
        request.finished_s = self.now_s
        self._in_flight -= 1
        if self.spec.topology.is_pd and request.token_times_s:  # NOTE: PD: a first token means a hand-off
            self._streaming -= 1
        if self._client_backlog:
            self._send(self._client_backlog.popleft())

    # -- workers ----------------------------------------------------------------------------
    def _kick(self, worker: SimWorker) -> None:
        if self._batching is not None:
            self._batching.add(worker)
            return
        if worker.busy:
            return
        plan = worker.schedule()
        if plan is not None:
            worker.busy = True
            self._push(self.now_s + plan.duration_s, _STEP_END, (worker, plan))

    def _on_step_end(self, worker: SimWorker, plan: StepPlan) -> None:
        worker.busy = False
        handoffs, finished, num_first = worker.finish_step(plan, self.now_s)
        if worker.role == "colocated":
            self._awaiting_first -= num_first
        # NOTE: a step's first tokens leave together: none of them counts the others of its step as streaming
        streaming = self._streaming
        for request in handoffs:
            self._hand_off(request, plan.duration_s, streaming)
        for request in finished:
            self._complete(worker, request)
        self._kick(worker)
        if finished and self.spec.topology.is_pd:
            self._drain_router()

    def _complete(self, worker: SimWorker, request: SimRequest) -> None:
        worker.num_unfinished -= 1
        self._finish(request)

    def _hand_off(self, request: SimRequest, prefill_s: float, streaming: int) -> None:
        """The first token out of prefill (`streaming`: the requests in flight past their first token
        when its step ended), and the KV on its way to decode."""
        spec = self.spec
        # NOTE: the load's part is a delay on the router's relay, which every later token and the end take too
        request.relay_s = spec.path.relay_delay(streaming)
        if spec.early_first_token:
            request.token_times_s[-1] += spec.path.first_token_s + request.relay_s
        self._streaming += 1
        delay = 0.0
        if spec.transfer is not None:
            num_bytes = request.prompt_len * spec.kv_bytes_per_token
            delay = (spec.transfer.exposed_s(num_bytes, prefill_s, spec.num_layers) if spec.layerwise
                     else spec.transfer.seconds(num_bytes))
        self.num_transfers += 1
        self._push(self.now_s + delay, _TRANSFER_DONE, request)

    def _on_transfer_done(self, request: SimRequest) -> None:
        prefill = self.prefill[request.worker]
        prefill.release(request)
        prefill.num_unfinished -= 1
        prefill.held_tokens -= request.prompt_len
        self._kick(prefill)
        self._dispatch_prefill()
        self._awaiting_first -= 1
        handoff_s = self.spec.path.handoff(self._awaiting_first + self._in_handoff)
        self._in_handoff += 1
        if handoff_s > 0:
            self._push(self.now_s + handoff_s, _AT_DECODE, request)
        else:
            self._at_decode(request)

    def _at_decode(self, request: SimRequest) -> None:
        """The hand-off's end: the decode worker has the request (and its KV)."""
        self._in_handoff -= 1
        if not self.spec.early_first_token:  # the client sees the first token once decode has the KV (relayed)
            request.token_times_s[-1] = self.now_s + request.relay_s
        decode = self.decode[request.decode]
        request.worker = decode.index
        request.blocks = decode.blocks_for(request.prompt_len + 1)  # its reservation
        if request.done:
            decode.release(request)
            decode.num_unfinished -= 1
            self._finish(request)
            self._drain_router()
            return
        decode.waiting.append(request)
        self._kick(decode)


def _load(worker: SimWorker) -> int:
    return worker.num_unfinished
