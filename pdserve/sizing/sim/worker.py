"""One simulated worker: the engine's scheduler in counts only (vLLM v1 style, as pdserve's).

Each step: running requests first (a decode token each, or their next prefill chunk), then waiting
requests in arrival order while the token budget, `max_num_seqs` and free KV blocks allow (no
admission in a step that had to preempt). A request that needs a block when none is free preempts
the most recently admitted running request, which frees all its blocks and later recomputes its
prompt and what it generated (preemption by recomputation).

Roles: `colocated` (prefill and decode), `prefill` (a request leaves once its prompt is computed
and its first token sampled; its blocks stay until the KV transfer ends), `decode` (requests
arrive with their KV; blocks were reserved when the router chose this worker).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pdserve.sizing.profile import StepModel
from pdserve.sizing.sim.request import SimRequest


@dataclass(frozen=True, slots=True)
class WorkerLimits:
    num_kv_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool = True


@dataclass(slots=True)
class StepPlan:
    """What one step computes: (request, new prompt tokens) chunks, and decoding requests."""

    chunks: list[tuple[SimRequest, int]]
    decodes: list[SimRequest]
    duration_s: float


class SimWorker:
    def __init__(self, index: int, role: str, limits: WorkerLimits, step: StepModel) -> None:
        self.index, self.role, self.limits, self.step_model = index, role, limits, step
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.free_blocks = limits.num_kv_blocks
        self.peak_blocks_used = 0
        self.busy = False
        self.num_steps = 0
        self.num_preemptions = 0
        self.num_unfinished = 0  # requests assigned here and not finished (the router's load)
        self.held_tokens = 0  # PD prefill: prompt tokens of the jobs it holds until their hand-off ends

    # -- KV blocks --------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.limits.block_size)

    def take(self, request: SimRequest, num_blocks: int) -> None:
        # NOTE: invariant: never more blocks in use than the pool has
        assert 0 <= num_blocks <= self.free_blocks, "KV over capacity"
        self.free_blocks -= num_blocks
        request.blocks += num_blocks
        self.peak_blocks_used = max(self.peak_blocks_used, self.limits.num_kv_blocks - self.free_blocks)

    def reserve(self, num_blocks: int) -> None:
        """PD decode: blocks held for a request whose KV is still on its way (not yet its own)."""
        assert 0 <= num_blocks <= self.free_blocks, "KV over capacity"
        self.free_blocks -= num_blocks
        self.peak_blocks_used = max(self.peak_blocks_used, self.limits.num_kv_blocks - self.free_blocks)

    def release(self, request: SimRequest) -> None:
        self.free_blocks += request.blocks
        request.blocks = 0
        assert self.free_blocks <= self.limits.num_kv_blocks, "freed more KV blocks than taken"

    def _grow(self, request: SimRequest, num_tokens: int) -> bool:
        """Blocks for `num_tokens` of KV in all, preempting newer running requests if needed."""
        need = self.blocks_for(num_tokens) - request.blocks
        while need > self.free_blocks:
            victim = next((r for r in reversed(self.running) if r is not request), None)
            if victim is not None:
                self._preempt(victim)
            elif not self._evict_waiting(request):
                return False
        if need > 0:
            self.take(request, need)
        return True

    def _preempt(self, request: SimRequest) -> None:
        self.running.remove(request)
        self.release(request)
        request.computed, request.target = 0, request.prompt_len + request.generated
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _evict_waiting(self, head: SimRequest) -> bool:
        """Nothing runs and the head cannot start: the newest waiting request that holds blocks (a
        hand-off's KV on a decode worker) gives them up and will recompute, so the head can grow."""
        victim = next((r for r in reversed(self.waiting) if r is not head and r.blocks), None)
        if victim is None:
            return False
        self.release(victim)
        victim.computed, victim.target = 0, victim.prompt_len + victim.generated
        victim.num_preemptions += 1
        self.num_preemptions += 1
        return True

    # -- scheduling -------------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        return self._schedule_decodes() or self._schedule()

    def _schedule_decodes(self) -> StepPlan | None:
        """The common step, fast: everything running decodes, within the budget, and every request
        that needs a new block gets one without preempting. None: not that case (nothing changed
        but blocks taken that the request needs anyway)."""
        running, block_size = self.running, self.limits.block_size
        if not running or self.waiting or len(running) > self.limits.max_num_batched_tokens:
            return None
        context = crossing = 0
        for r in running:
            if r.computed < r.target:
                return None
            n = r.prompt_len + r.generated
            context += n
            crossing += n >= r.blocks * block_size
        if crossing > self.free_blocks:
            return None
        if crossing:
            for r in running:
                if r.prompt_len + r.generated >= r.blocks * block_size:
                    self.take(r, 1)
        return StepPlan([], list(running), self.step_model.step_s(0, 0, len(running), context))

    def _schedule(self) -> StepPlan | None:
        budget = self.limits.max_num_batched_tokens
        block_size = self.limits.block_size
        chunks: list[tuple[SimRequest, int]] = []
        decodes: list[SimRequest] = []
        preempted = self.num_preemptions
        for request in list(self.running):
            if budget <= 0:
                break
            if self.num_preemptions != preempted and request not in self.running:
                continue  # preempted by an earlier request of this step
            if request.computed < request.target:
                n = min(request.target - request.computed, budget)
                if not self._grow(request, request.computed + n):
                    continue
                chunks.append((request, n))
                budget -= n
            else:
                # NOTE: fast path (most steps): the next token's slot is in a block it holds
                if request.prompt_len + request.generated >= request.blocks * block_size and \
                        not self._grow(request, request.prompt_len + request.generated + 1):
                    continue
                decodes.append(request)
                budget -= 1
        if self.num_preemptions != preempted:
            chunks = [(r, n) for r, n in chunks if r in self.running]
            decodes = [r for r in decodes if r in self.running]
        else:
            budget = self._admit(chunks, decodes, budget)
        if not chunks and not decodes:
            return None
        return StepPlan(chunks, decodes, self._duration(chunks, decodes))

    def _admit(self, chunks: list[tuple[SimRequest, int]], decodes: list[SimRequest], budget: int) -> int:
        limits = self.limits
        while self.waiting and budget > 0 and len(self.running) < limits.max_num_seqs:
            request = self.waiting[0]
            remaining = request.target - request.computed
            n = min(remaining, budget)
            if n < remaining and not limits.enable_chunked_prefill:
                break
            tokens = request.context_len + 1 if remaining == 0 else request.computed + n
            need = self.blocks_for(tokens) - request.blocks
            if need > self.free_blocks:
                if self.running or not self._evict_waiting(request):
                    break
                continue
            self.waiting.popleft()
            if need > 0:
                self.take(request, need)
            self.running.append(request)
            if remaining > 0:
                chunks.append((request, n))
                budget -= n
            else:  # a hand-off on a decode worker: its KV arrived, it decodes at once
                decodes.append(request)
                budget -= 1
        return budget

    def _duration(self, chunks: list[tuple[SimRequest, int]], decodes: list[SimRequest]) -> float:
        tokens = sum(n for _, n in chunks)
        pairs = sum(n * (r.computed + n / 2) for r, n in chunks)
        context = sum([r.prompt_len for r in decodes]) + sum([r.generated for r in decodes])
        return self.step_model.step_s(tokens, pairs, len(decodes), context)

    def finish_step(self, plan: StepPlan, now_s: float) -> tuple[list[SimRequest], list[SimRequest], int]:
        """Apply a step's results at its end: (requests whose prompt completed here, for a prefill
        worker to hand off; requests that finished; how many produced their first token)."""
        self.num_steps += 1
        handoffs: list[SimRequest] = []
        finished: list[SimRequest] = []
        num_first = 0
        for request, n in plan.chunks:
            request.computed += n
            if request.prefilling:
                continue
            request.add_token(now_s)  # the step that completes a prompt samples the next token
            num_first += request.generated == 1
            if self.role == "prefill":
                self.running.remove(request)
                handoffs.append(request)
            elif request.done:
                finished.append(request)
        for request in plan.decodes:
            request.generated += 1
            request.token_times_s.append(now_s)
            if request.generated >= request.output_len:
                finished.append(request)
        for request in finished:
            self.running.remove(request)
            self.release(request)
        return handoffs, finished, num_first
