"""Continuous batching with one token budget per step, chunked prefill and preemption.

Integer bookkeeping only. Each step:
  1. running requests, oldest first, take what they need (1 token for a decode, a chunk for an
     unfinished prefill); when blocks run out, the newest running request is preempted (swapped
     to CPU, or freed to be recomputed later);
  2. if nothing was preempted: swapped requests come back, then waiting requests are admitted
     (prefix-cache hits first advance their `num_computed_tokens`), up to `max_num_seqs`. With a
     disk tier, a waiting request whose prefix continues on disk beyond the pool's hits gets blocks
     for it and waits in `loading` while the tier reads them (the rest of the batch goes on);
     `complete_load` puts it back at the front of the waiting queue with those tokens computed.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from operator import attrgetter
from typing import TYPE_CHECKING

from pdserve.config import CacheConfig, SchedulerConfig
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler_output import ScheduledChunk, SchedulerOutput, SchedulerStatsFields, SteadyBatch

if TYPE_CHECKING:
    from pdserve.engine.kv_disk_tier import KVDiskTier

logger = logging.getLogger(__name__)
_NO_BLOCK_LOG_INTERVAL_S = 1.0
_num_new_of = attrgetter("num_new_tokens")


class Scheduler:
    """Decode role (`reserve_remote`, `complete_remote`, `recompute_remote`): requests whose prompt
    KV a prefill worker computes wait in `remote` with their blocks reserved.

    `remote_kv_quarantine_s` (decode role): how long the blocks of a reservation that ends before
    its KV arrived stay out of reuse; the KV receiver's `late_write_window_s` (nixl > 0, tcp 0)."""

    def __init__(self, sched: SchedulerConfig, cache: CacheConfig, remote_kv_quarantine_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = sched
        self.kv = KVCacheManager(cache.num_kv_blocks, cache.block_size, cache.enable_prefix_caching,
                                 cache.num_swap_blocks, clock)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.requests: dict[str, Request] = {}
        self.remote: dict[str, Request] = {}  # decode role: reserved, awaiting KV from prefill
        self.held: dict[str, Request] = {}  # prefill role: finished, blocks kept until released
        self.loading: dict[str, Request] = {}  # blocks reserved, prefix KV being read from disk
        self.disk: KVDiskTier | None = None  # see attach_disk_tier
        self.num_disk_hit_tokens = 0  # of the prefix-cache hits (`kv.num_prefix_hits`), those read from disk
        self.remote_kv_quarantine_s = remote_kv_quarantine_s
        self.num_preemptions = 0
        self.num_no_available_block = 0  # events logged as "No available block" (alert rules match it)
        self.num_cannot_allocate = 0  # requests refused as "Cannot allocate for request" (never fit)
        self._no_block_logged_at = float("-inf")
        self.max_loras = 0  # LoRA adapters one step may mix (the runner's slots); 0: no LoRA served
        self._decode_chunks: dict[str, ScheduledChunk] = {}  # see _decode_chunk; dropped by `finish`
        self._steady: SteadyBatch | None = None  # kept by `update`, taken by the next `schedule`

    def _lora_fits(self, request: Request) -> bool:
        """Whether `request` may join the running ones without their steps mixing more LoRA adapters
        than the runner has slots (every running request is in every step)."""
        name = request.params.lora_name
        if name is None or not self.max_loras:
            return True
        running = {r.params.lora_name for r in self.running if r.params.lora_name is not None}
        return name in running or len(running) < self.max_loras

    def _check_fits(self, request: Request) -> None:
        needed = -(-request.max_total_tokens // self.kv.block_size)
        if needed > self.kv.pool.num_blocks:
            message = (f"Cannot allocate for request {request.request_id}: it may need {needed} KV blocks, "
                       f"the pool has {self.kv.pool.num_blocks}")
            self.num_cannot_allocate += 1
            logger.warning(message, extra={"request_id": request.request_id})
            raise ValueError(message)

    def attach_disk_tier(self, disk: KVDiskTier) -> None:
        self.disk = disk
        self.kv.newly_cached = []

    def add_request(self, request: Request) -> None:
        self._check_fits(request)
        self.waiting.append(request)
        self.requests[request.request_id] = request

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def schedule(self) -> SchedulerOutput:
        self.kv.release_quarantined()
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        steady, self._steady = self._steady, None
        chunks = None if steady is None else steady.schedule(self.running, budget, self.kv)
        if chunks is None:
            budget = self._schedule_running(out, budget)
        else:
            out.chunks = chunks
            budget -= len(chunks)
        if not out.preempted_ids:
            budget = self._schedule_swapped(out, budget)
            if not self.swapped:
                self._schedule_waiting(out, budget)
        if steady is not None and chunks is not None and len(out.chunks) == len(steady.chunks):
            out.steady, out.num_batched_tokens = steady, len(chunks)  # NOTE: nothing joined the steady decodes
        else:
            out.num_batched_tokens = sum(map(_num_new_of, out.chunks))
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        index = 0
        running, chunks, block_size, decode_chunks = self.running, out.chunks, self.kv.block_size, self._decode_chunks
        while index < len(running) and budget > 0:
            request = running[index]
            computed = request.num_computed_tokens
            if len(request.all_token_ids) == computed + 1 and computed < len(request.block_ids) * block_size:
                # NOTE: the steady decode: its token fits the blocks it holds, so `allocate` would
                # change nothing (the exact test it makes); per request per step, kept to a minimum
                # (`_decode_chunk`'s usual case inline)
                chunk = decode_chunks.get(request.request_id)
                chunks.append(chunk if chunk is not None and chunk.request is request else self._decode_chunk(request))
                budget -= 1
                index += 1
                continue
            num_new = min(len(request.all_token_ids) - computed, budget)
            while not self.kv.allocate(request, num_new):
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is request:
                    break
            else:
                # NOTE: a decode entering a new block keeps its chunk too (`SteadyDecodes` compares them)
                out.chunks.append(self._decode_chunk(request) if num_new == 1 else ScheduledChunk(request, num_new))
                budget -= num_new
                index += 1
        return budget

    def _decode_chunk(self, request: Request) -> ScheduledChunk:
        """`ScheduledChunk(request, 1)`, made once per request (it is immutable): a decode step
        reuses last step's instead of building one per request per step."""
        chunk = self._decode_chunks.get(request.request_id)
        if chunk is None or chunk.request is not request:
            chunk = self._decode_chunks[request.request_id] = ScheduledChunk(request, 1)
        return chunk

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.num_preemptions += 1
        self._no_available_block(request, f"preempting it ({self.config.preemption_mode})")
        request.num_preemptions += 1
        # NOTE: victims come off the tail of `running`, which this step has not scheduled yet.
        out.preempted_ids.append(request.request_id)
        mapping = self.kv.swap_out(request) if self.config.preemption_mode == "swap" else None
        if mapping is not None:
            out.blocks_to_swap_out.extend(mapping)
            request.status = RequestStatus.SWAPPED
            self.swapped.appendleft(request)
            return
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.disk_checked = False
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def _no_available_block(self, request: Request, action: str) -> None:
        """Count and log the stable message `No available block` (alert rules match it). At most one
        line a second: under pressure this happens every step, and the router retries refused
        reservations every 50 ms; the counter (`pdserve:no_available_block_total`) sees them all."""
        self.num_no_available_block += 1
        now = time.monotonic()
        if now - self._no_block_logged_at < _NO_BLOCK_LOG_INTERVAL_S:
            return
        self._no_block_logged_at = now
        logger.warning("No available block for request %s: %d of %d KV blocks free; %s (%d such events so far)",
                       request.request_id, self.kv.pool.num_free_blocks, self.kv.pool.num_blocks, action,
                       self.num_no_available_block, extra={"request_id": request.request_id})

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        while self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.swapped[0]
            if not self._lora_fits(request):
                break
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            # Room for the swapped blocks plus the tokens this step adds.
            extra = self.kv.num_blocks_needed(request, num_new, len(request.swapped_block_ids))
            if len(request.swapped_block_ids) + extra > self.kv.pool.num_free_blocks:
                break
            self.swapped.popleft()
            mapping = self.kv.swap_in(request)
            assert mapping is not None and self.kv.allocate(request, num_new)
            out.blocks_to_swap_in.extend(mapping)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.chunks.append(ScheduledChunk(request, num_new))
            budget -= num_new
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if not self._lora_fits(request):
                break
            hits = self.kv.find_cached_prefix(request) if request.num_computed_tokens == 0 else []
            if request.num_computed_tokens == 0 and self._start_disk_load(request, hits):
                continue
            num_computed = request.num_computed_tokens + len(hits) * self.kv.block_size
            num_new = request.num_tokens - num_computed
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            request.num_computed_tokens = num_computed
            if not self.kv.allocate(request, num_new, hits):
                request.num_computed_tokens -= len(hits) * self.kv.block_size
                break
            self.waiting.popleft()
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
                request.num_cached_tokens = len(hits) * self.kv.block_size
                self.kv.record_prefix_query(request.num_tokens, request.num_cached_tokens)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.chunks.append(ScheduledChunk(request, num_new))
            budget -= num_new

    def _start_disk_load(self, request: Request, hits: list[int]) -> bool:
        """If the prefix continues on disk past the pool's `hits` and loading beats computing,
        reserve blocks for the hits and the disk part and start the load; True when it started."""
        if self.disk is None or request.disk_checked or request.params.prompt_logprobs is not None:
            return False
        request.disk_checked = True
        bs = self.kv.block_size
        wanted = request.block_hashes[len(hits):(request.num_tokens - 1) // bs]
        num_on_disk = self.disk.num_on_disk(wanted)
        if num_on_disk == 0 or not self.disk.cost.prefers_load(bs):
            return False
        request.num_computed_tokens = len(hits) * bs
        if not self.kv.allocate(request, num_on_disk * bs, hits):
            request.num_computed_tokens = 0
            request.disk_checked = False  # asked again when the pool has room
            return False
        self.waiting.popleft()
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        request.status = RequestStatus.LOADING
        self.loading[request.request_id] = request
        self.disk.submit_load(request.request_id, wanted[:num_on_disk])
        return True

    def complete_load(self, request_id: str, num_loaded: int) -> None:
        """The disk tier read the first `num_loaded` blocks of the request's load into its blocks
        (the runner copied them in); the blocks it could not read are freed and computed instead.
        The request goes back to the front of the waiting queue. A request aborted meanwhile is gone."""
        request = self.loading.pop(request_id, None)
        if request is None:
            return
        keep = request.num_computed_tokens // self.kv.block_size + num_loaded
        self.kv.pool.free(request.block_ids[keep:][::-1])
        del request.block_ids[keep:]
        request.num_indexed_blocks = min(request.num_indexed_blocks, keep)
        request.num_computed_tokens = keep * self.kv.block_size
        self.kv.cache_computed_blocks(request)
        if request.num_preemptions == 0 and request.num_cached_tokens == 0:
            request.num_cached_tokens = request.num_computed_tokens
            self.kv.record_prefix_query(request.num_tokens, request.num_cached_tokens)
            self.num_disk_hit_tokens += num_loaded * self.kv.block_size
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def update(self, out: SchedulerOutput, sampled: Mapping[str, int] | list[int]) -> list[Request]:
        """Advance computed counts, append sampled tokens, finish what stopped. `sampled`: the token
        of each request that sampled, by id; or, only where every chunk sampled, a list, chunk i's
        token at i (no dict to build and look up: the steady decode's case). Returns the requests that got
        a new token this step (finished ones included), in chunk order."""
        chunks = out.chunks
        if isinstance(sampled, list):
            if len(sampled) != len(chunks):
                raise ValueError(f"{len(sampled)} tokens sampled for a step of {len(chunks)} chunks")
            if out.steady is not None:
                updated, still = out.steady.update(sampled, self.kv, self.finish)
                self._steady = out.steady if still else None
            else:
                updated = self._update_each(out, sampled)
                self._steady = SteadyBatch.after_update(out, sampled, self.running)
            return updated
        return self._update_each(out, [sampled.get(chunk.request.request_id) for chunk in chunks])

    def _update_each(self, out: SchedulerOutput, tokens: list[int | None] | list[int]) -> list[Request]:
        """`update`, request by request (a step not scheduled as a steady batch)."""
        updated = []
        chunks = out.chunks
        kv = self.kv
        caching, block_size = kv.pool.enable_caching, kv.block_size
        for chunk, token in zip(chunks, tokens, strict=True):
            request = chunk.request
            computed = request.num_computed_tokens = request.num_computed_tokens + chunk.num_new_tokens
            if caching and computed // block_size > request.num_indexed_blocks:  # NOTE: what the call tests first
                kv.cache_computed_blocks(request)
            if token is None:
                continue
            updated.append(request)
            if request.matcher is None:  # NOTE: per request per step: `append_token` and `check_stop` inline
                token_ids = request.all_token_ids
                token_ids.append(token)
                if token not in request.stop_tokens and len(token_ids) < request.max_total_tokens:
                    continue  # what check_stop would find: nothing
            else:
                request.append_token(token)
            status = request.check_stop()
            if status is not None:
                self.finish(request, status)
        return updated

    def stats_fields(self) -> SchedulerStatsFields:
        """The scheduler's and its KV cache's fields of `EngineStats` (llm_engine.py), by name."""
        kv = self.kv
        return {"num_running": len(self.running), "num_waiting": len(self.waiting), "num_swapped": len(self.swapped),
                "num_kv_blocks": kv.pool.num_blocks, "num_free_kv_blocks": kv.pool.num_free_blocks,
                "num_quarantined_kv_blocks": kv.num_quarantined_blocks, "kv_cache_usage": kv.usage,
                "num_preemptions": self.num_preemptions, "num_prefix_query_tokens": kv.num_prefix_queries,
                "num_prefix_hit_tokens": kv.num_prefix_hits, "num_evictions": kv.pool.num_evictions,
                "num_no_available_block": self.num_no_available_block,
                "num_cannot_allocate": self.num_cannot_allocate, "num_remote_waiting": len(self.remote),
                "num_scheduler_requests": self.num_unfinished, "block_size": kv.block_size}

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Finish (or abort) a request in any state and release everything it holds (a prefill-role
        request that finished normally keeps its blocks in `held` until `release`)."""
        if request.request_id not in self.requests:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status == RequestStatus.SWAPPED:
            self.swapped.remove(request)
            self.kv.drop_swapped(request)
        elif request.status == RequestStatus.LOADING:
            del self.loading[request.request_id]  # NOTE: the loader reads into host memory, not these blocks
        elif request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
            del self.remote[request.request_id]
            # a peer may still be writing: quarantined, so the free below finds no blocks left
            self.kv.free_after(request, self.remote_kv_quarantine_s)
        if request.hold_blocks and status != RequestStatus.FINISHED_ABORTED:
            self.held[request.request_id] = request
        else:
            self.kv.free(request)
        request.status = status
        del self.requests[request.request_id]
        self._decode_chunks.pop(request.request_id, None)

    def release(self, request_id: str) -> None:
        """Prefill role: the KV hand-off of a finished request is over; free its blocks."""
        request = self.held.pop(request_id, None)
        if request is not None:
            self.kv.free(request)

    def reserve_remote(self, request: Request) -> bool:
        """Reserve blocks for the whole prompt of `request`, whose KV a prefill worker will write.
        Leading blocks already in the prefix cache are taken as they are: on return,
        `request.num_computed_tokens` says how many prompt tokens need no transfer. False, changing
        nothing, when the pool has no room."""
        self._check_fits(request)
        self.kv.release_quarantined()
        hits = self.kv.find_cached_prefix(request)
        request.num_computed_tokens = len(hits) * self.kv.block_size
        if not self.kv.allocate(request, request.num_prompt_tokens - request.num_computed_tokens, hits):
            request.num_computed_tokens = 0
            self._no_available_block(request, "reservation refused")
            return False
        request.num_cached_tokens = request.num_computed_tokens
        request.first_scheduled_time = time.monotonic()
        self.kv.record_prefix_query(request.num_tokens, request.num_cached_tokens)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.remote[request.request_id] = request
        self.requests[request.request_id] = request
        return True

    def recompute_remote(self, request_id: str) -> None:
        """The hand-off failed (timeout, peer gone): compute the prompt here instead. The reserved
        blocks, possibly half written, are freed after `remote_kv_quarantine_s` (a late write of
        the failed transfer must not land in blocks given to anyone else, this request's recompute
        included); blocks that were prefix hits stay indexed, so the normal waiting path finds
        them again. Goes to the front of the waiting queue."""
        request = self.remote.pop(request_id)
        self.kv.free_after(request, self.remote_kv_quarantine_s)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def complete_remote(self, request_id: str, first_token_id: int) -> Request:
        """The prompt's KV has landed and prefill sampled `first_token_id`: the request joins the
        front of the waiting queue with its prompt computed (it keeps its blocks), and decodes on."""
        request = self.remote.pop(request_id)
        request.num_computed_tokens = request.num_prompt_tokens
        self.kv.cache_computed_blocks(request)
        request.append_token(first_token_id)
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        status = request.check_stop()
        if status is not None:
            self.finish(request, status)
        return request

    def resample_remote(self, request_id: str, forks: list[Request]) -> None:
        """The prompt's KV has landed, but the first token is sampled here (n > 1, or logprobs):
        the request recomputes only its prompt's last token; each fork (another sequence of the
        same prompt) takes the request's full prompt blocks by reference, not copied, and computes
        the rest of the prompt in blocks of its own. All join the front of the waiting queue.

            request: [ full | full | last, partial ]   P prompt tokens, P-1 computed
            fork:    [ full | full ] (shared, ref count + 1) + [ own ] computed from (P-1)//bs*bs
        """
        request = self.remote.pop(request_id)
        request.num_computed_tokens = request.num_prompt_tokens - 1
        self.kv.cache_computed_blocks(request)
        request.status = RequestStatus.WAITING
        num_shared = (request.num_prompt_tokens - 1) // self.kv.block_size
        for fork in reversed(forks):
            fork.num_computed_tokens = num_shared * self.kv.block_size
            shared = self.kv.allocate(fork, 0, request.block_ids[:num_shared])
            assert shared, "no new block is needed: it only takes references"
            self.waiting.appendleft(fork)
            self.requests[fork.request_id] = fork
        self.waiting.appendleft(request)

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish(request, RequestStatus.FINISHED_ABORTED)
        return request
