"""The engine: scheduler + model runner + output processing, driven one `step()` at a time."""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from pdserve import envs
from pdserve.config import EngineArgs, EngineConfig, create_engine_config
from pdserve.engine.disk_offload import DiskOffload
from pdserve.engine.engine_lora import EngineLoRA
from pdserve.engine.engine_types import EngineStats, RemoteReservation, check_handoff, check_request
from pdserve.engine.host_memory import keep_large_allocations_on_heap
from pdserve.engine.kv_cache_manager import prompt_prefix_digests
from pdserve.engine.kv_event_publisher import dropped_batches, start_kv_events
from pdserve.engine.kv_transfer import KVTransferSetup, LayerObserver, StreamTargets, TransferExpectations
from pdserve.engine.logprobs import PromptLogprobs, TokenLogprobs
from pdserve.engine.lora_manager import LoRAInfo
from pdserve.engine.output import (
    OutputSettings,
    RequestDelta,
    RequestFailure,
    RequestOutput,
    RequestState,
    SteadyAlone,
    StepTokens,
)
from pdserve.engine.request import ModelContext, Request, RequestStatus, child_request_id
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.scheduler_output import SchedulerOutput
from pdserve.engine.step_log import StepLog, StepWork
from pdserve.engine.structured import GrammarCache
from pdserve.engine.tensor_parallel import make_runner
from pdserve.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if config.device.type == "cpu" and envs.heap_tuning():
            keep_large_allocations_on_heap()
        self.runner = make_runner(config)
        self.scheduler = Scheduler(config.scheduler, config.cache)
        self.lora = self.runner.lora  # with --enable-lora (engine/lora_manager.py)
        self.loras = EngineLoRA(self.lora, self.scheduler)
        self.offload = None if config.kv_disk is None else DiskOffload(config, self.scheduler, self.runner)
        self._states: dict[str, RequestState] = {}
        self._children: dict[str, tuple[RequestState, int]] = {}
        self._alone = SteadyAlone()  # the engine core's steady decode: a step of the same requests, all alone
        # decode role, n > 1: sequences 1..n-1 of a reservation, which start once its KV arrived
        self._forks: dict[str, list[Request]] = {}
        self._num_steps = 0
        self._schedule_time_s = 0.0
        self._step_time_s = 0.0
        self._num_prefill_tokens = 0
        self._last_prefill_batch = (0, 0)  # (requests, tokens) with a prefill chunk in the last step
        self.layer_observer: LayerObserver | None = None  # see configure_kv_transfer
        self.stream_targets: StreamTargets | None = None
        self.expectations: TransferExpectations | None = None
        self.step_log = StepLog.from_env()  # PDSERVE_STEP_LOG: each step's time and work
        self._failures: list[RequestFailure] = []  # requests failed on their own; see take_failures
        # False in the engine core process (engine/core_proc.py): outputs carry token ids, no text;
        # its API process detokenizes and applies stop strings (`stop_sequence`). Set before requests.
        self.detokenize = True
        self.grammars = GrammarCache(tokenizer, config.model.vocab_size)  # structured outputs
        self.kv_events, self.kv_event_publisher = start_kv_events(  # --kv-events-config; each step publishes
            config.kv_events, self.scheduler.kv.pool, config.cache.block_size)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        config = create_engine_config(args)
        return cls(config, load_tokenizer(config.model_path))

    def configure_kv_transfer(self, setup: KVTransferSetup) -> None:
        """Hook a worker's KV transport in. The transport binds to this engine's pool, so it exists
        only after the engine: call this once it does, before the engine thread starts (`AsyncLLM`
        does); from then on only that thread reads these."""
        self.layer_observer = setup.layer_observer
        self.stream_targets = setup.stream_targets
        self.expectations = setup.expectations
        self.scheduler.remote_kv_quarantine_s = setup.remote_kv_quarantine_s

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises ValueError for a request that can never run; the server answers it with a 400.
        Pure reads of frozen config: safe to call from any thread."""
        check_request(prompt_token_ids, params, self.config.scheduler.max_model_len, self.config.model.vocab_size)
        self.loras.root(params)

    def add_lora(self, name: str, path: str) -> LoRAInfo:
        """Load and register an adapter (all or nothing); raises LoRAError (a ValueError) naming it."""
        return self.loras.add(name, path)

    def remove_lora(self, name: str) -> None:
        """Unregister an adapter no unfinished request runs under; raises LoRAError otherwise."""
        self.loras.remove(name)

    def list_loras(self) -> list[LoRAInfo]:
        return self.loras.list()

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, prefill_only: bool = False) -> None:
        """`prefill_only` (prefill role): compute the prompt, sample the first token, finish, and
        keep the blocks until `release_kv` (the KV hand-off reads them)."""
        if prefill_only and params.n != 1:
            raise ValueError("a disaggregated request has n == 1")
        if request_id in self._states:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.validate_request(token_ids, params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        state = self._new_state(request_id, prompt_text, token_ids, params, arrival)
        children = self._child_requests(request_id, token_ids, params, arrival)
        for child in children:
            if prefill_only:
                child.hold_blocks = True
                child.max_total_tokens = len(token_ids) + 1
        for child in children:  # validated all before adding any
            self.scheduler.add_request(child)
        for index, child in enumerate(children):
            self._children[child.request_id] = (state, index)
        self._states[request_id] = state

    def _child_requests(self, request_id: str, token_ids: list[int], params: SamplingParams,
                        arrival: float) -> list[Request]:
        """The `n` engine sequences of one user request; with n > 1 each has its own id and seed."""
        children = []
        model = ModelContext(self.tokenizer.eos_token_ids, self.config.scheduler.max_model_len, self.config.device)
        root = self.loras.root(params)
        for index in range(params.n):
            matcher = None
            if params.structured is not None:
                replay = token_ids[len(token_ids) - params.structured_replay:] if params.structured_replay else []
                matcher = self.grammars.matcher(params.structured, replay)
            child_params = params
            if index > 0 and params.seed is not None:
                # Distinct per sequence, and unlike seed + index, not another request's seed.
                child_params = dataclasses.replace(params, seed=hash((params.seed, index)) & (2**63 - 1))
            if index > 0 and params.prompt_logprobs is not None:  # the prompt's are computed once, by child 0
                child_params = dataclasses.replace(child_params, prompt_logprobs=None)
            child_id = child_request_id(request_id, index)  # a reservation is child 0
            child = Request(child_id, token_ids, child_params, model, arrival, matcher)
            child.hash_root = root
            children.append(child)
        return children

    def abort_request(self, request_id: str) -> RequestOutput | None:
        state = self._states.pop(request_id, None)
        if state is None:
            return None
        self._forks.pop(request_id, None)
        for child_id, (owner, index) in list(self._children.items()):
            if owner is state:
                self.scheduler.abort(child_id)
                state.finish(index, RequestStatus.FINISHED_ABORTED, None)
                del self._children[child_id]
        return state.snapshot()

    def release_kv(self, request_id: str) -> None:
        """Prefill role: the hand-off of a `prefill_only` request ended (acknowledged, failed, its
        lease expired, or cut short while computing): stop it if it still runs, free its blocks."""
        self.abort_request(request_id)
        self.scheduler.release(request_id)

    def reserve_remote(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> RemoteReservation | None:
        """Decode role: reserve blocks for a prompt whose KV a prefill worker computes. None when
        the pool has no room now (the caller retries or picks another worker)."""
        if request_id in self._states:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate_request(prompt_token_ids, params)
        children = self._child_requests(request_id, list(prompt_token_ids), params, time.monotonic())
        request = children[0]
        if not self.scheduler.reserve_remote(request):
            return None
        state = self._new_state(request_id, None, list(prompt_token_ids), params, request.arrival_time)
        state.num_cached_tokens = request.num_cached_tokens
        self._states[request_id] = state
        for index, child in enumerate(children):
            self._children[child.request_id] = (state, index)
        if len(children) > 1:
            self._forks[request_id] = children[1:]
        return RemoteReservation(tuple(request.block_ids), request.num_cached_tokens)

    def num_cached_prefix_tokens(self, prompt_token_ids: list[int], lora_name: str | None = None) -> int:
        """How many leading tokens of this prompt (under LoRA adapter `lora_name`) the prefix cache
        holds now, in the pool and then on the disk tier (read-only; what a prefix-affinity router
        compares across workers)."""
        kv, disk = self.scheduler.kv, self.scheduler.disk
        if not kv.pool.enable_caching:
            return 0
        if not self.loras.serves(lora_name):
            return 0
        root = self.loras.root(SamplingParams(lora_name=lora_name))
        digests = prompt_prefix_digests(root, prompt_token_ids, kv.block_size)
        num_in_pool = next((i for i, d in enumerate(digests) if kv.pool.lookup(d) is None), len(digests))
        # NOTE: the prefix may continue on the disk tier past the pool's hits (what a prefill job
        # would load instead of computing: a decode loss recovered from prefill's cache)
        num_on_disk = 0 if disk is None else disk.num_on_disk(digests[num_in_pool:], count_miss=False)
        return (num_in_pool + num_on_disk) * kv.block_size

    def complete_remote(self, request_id: str, first_token_id: int, generator_state: bytes | None = None,
                        prefill_cached_tokens: int = 0,
                        prompt_logprobs: list[PromptLogprobs | None] | None = None,
                        lora: tuple[str | None, str] = (None, "")) -> RequestState | None:
        """Decode role: the prompt's KV is in the reserved blocks; `first_token_id` was sampled by
        prefill, whose seeded generator state continues here. Returns the request's output state
        with the first token, to be emitted at once as a snapshot or a delta (None: the first
        tokens are sampled here, see below).
        `prefill_cached_tokens`: the prompt's leading tokens prefill found in its prefix cache;
        `prompt_logprobs`: what prefill computed, for a request that asked for them; `lora`: the
        LoRA adapter (name, digest) prefill computed the KV under, which must be this request's here."""
        request = self.scheduler.remote[request_id]
        self.loras.check_handoff(request, *lora)
        # NOTE: checked before anything changes: a peer's bad value must not reach the sampler
        check_handoff(request, first_token_id, generator_state, prefill_cached_tokens, self.config.model.vocab_size)
        request.take_prompt_logprobs(prompt_logprobs, self.config.model.vocab_size)  # the last check: it sets them
        # Both hits are leading prefixes of the same prompt: their union is the longer one (a block
        # held by both workers counts once). Decode's hit was not sent, prefill's not recomputed.
        request.num_cached_tokens = max(request.num_cached_tokens, prefill_cached_tokens)
        self._states[request_id].num_cached_tokens = request.num_cached_tokens
        forks = self._forks.pop(request_id, [])
        if forks or request.params.logprobs is not None:
            # NOTE: sequences 1..n-1 need the prompt's last logits, which prefill does not send, and
            # so do the first token's logprobs: each sequence samples its first token here, from its
            # own generator, still fresh, as a colocated engine does; prefill's first token goes unused.
            self.scheduler.resample_remote(request_id, forks)
            return None
        if generator_state is not None and request.generator is not None:
            request.generator.set_state(torch.frombuffer(bytearray(generator_state), dtype=torch.uint8))
            request.pending_draws = 0  # prefill's generator skipped them already
        self.scheduler.complete_remote(request_id, first_token_id)
        states = self._emit([request], [None])
        if not states:  # its output processing raised: it is ended already (see take_failures)
            raise RuntimeError(f"request {request_id} failed in the engine")
        return states[0]

    def prefill_locally(self, request_id: str) -> None:
        """Decode role, failure policy "recompute": the KV will not arrive; this engine computes
        the prompt itself (and samples the first token with the request's own generator)."""
        self.scheduler.recompute_remote(request_id)
        for fork in self._forks.pop(request_id, []):  # n > 1: the other sequences start as usual
            self.scheduler.add_request(fork)

    def release_quarantined_blocks(self) -> float | None:
        """Free blocks whose quarantine ended (`Scheduler.remote_kv_quarantine_s`); seconds until
        the next one ends, None when none is held. `step()` does this too; an idle loop calls it."""
        return self.scheduler.kv.release_quarantined()

    def close(self) -> None:
        """Stop the disk tier's threads once the blocks queued for writing are written, and the
        other tensor-parallel ranks."""
        if self.offload is not None:
            self.offload.tier.close()
        if self.step_log is not None:
            self.step_log.close()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.close()
        self.runner.close()

    def has_unfinished_requests(self) -> bool:
        return bool(self._states)

    def has_runnable_requests(self) -> bool:
        """Whether `step()` has anything to do. False while the only requests are reservations
        waiting for their KV: they become runnable through `complete_remote`/`prefill_locally`."""
        scheduler = self.scheduler
        return bool(scheduler.running or scheduler.waiting or scheduler.swapped or scheduler.loading)

    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """One scheduling step + one model forward. Returns a cumulative snapshot for every
        request that produced a token (or finished) during the step; `final_only`: for those that
        finished only (what `LLM.generate` keeps)."""
        return [state.snapshot() for state in self._step() if not final_only or state.finished]

    def step_deltas(self, alone: StepTokens | None = None) -> list[RequestDelta]:
        """`step`, returning what each touched request gained since its last delta (the engine core
        process's messages): no snapshot of whole outputs, O(new tokens) a step. `alone`: where the
        requests whose delta would be one token and nothing else go instead (`StepTokens`)."""
        return [state.delta() for state in self._step(alone)]

    def _step(self, alone: StepTokens | None = None) -> list[RequestState]:
        start = time.perf_counter()
        self.publish_kv_events()  # what commands changed since the last step (a reservation's evictions)
        if self.offload is not None:
            self.offload.apply_finished_loads()
        out = self.scheduler.schedule()
        if out.is_empty:
            if self.offload is not None:
                self.offload.wait_for_loads()  # only disk loads are pending: nothing to compute
            return []
        scheduled = time.perf_counter()
        self._count_prefill(out)
        work = None if self.step_log is None else StepWork.of(out.chunks)
        observer = self.layer_observer
        layer_done = None if observer is None else (lambda layer: observer(layer, out.chunks))
        sampled = self.runner.execute(out, layer_done)
        executed = time.perf_counter()
        updated = self.scheduler.update(out, sampled.tokens)
        if self.offload is not None:
            self.offload.observe_step(self._last_prefill_batch[1], executed - scheduled)
            self.offload.save_new_blocks()
        tokens, logprobs = sampled.tokens, sampled.logprobs
        steady = alone is not None and type(tokens) is list and self._alone.take(updated, tokens, logprobs, alone)
        states = [] if steady else self._emit(updated, logprobs, alone)
        self.publish_kv_events()
        done = time.perf_counter()
        self._num_steps += 1
        self._schedule_time_s += (scheduled - start) + (done - executed)
        self._step_time_s += done - start
        if work is not None and self.step_log is not None:
            self.step_log.record(work, done - start, start, self.has_runnable_requests())
        return states

    def publish_kv_events(self) -> None:
        """Hand the KV-cache events recorded since the last call to the publisher (it never waits)."""
        if self.kv_events is not None and len(self.kv_events) and self.kv_event_publisher is not None:
            self.kv_event_publisher.publish(self.kv_events.take())

    def _count_prefill(self, out: SchedulerOutput) -> None:
        # NOTE: a chunk below the prompt's end is prefill (recomputation after preemption too); `out.steady`: none
        prefill = [] if out.steady is not None else [
            c.num_new_tokens for c in out.chunks if c.request.num_computed_tokens < len(c.request.prompt_token_ids)]
        self._last_prefill_batch = (len(prefill), sum(prefill))
        self._num_prefill_tokens += self._last_prefill_batch[1]

    def _new_state(self, request_id: str, prompt_text: str | None, token_ids: list[int], params: SamplingParams,
                   arrival_time: float) -> RequestState:
        return RequestState.of_request(request_id, prompt_text, token_ids, params,
                                       OutputSettings(self.tokenizer, self.detokenize), arrival_time)

    def _emit(self, updated: list[Request], step_logprobs: list[TokenLogprobs | None], alone: StepTokens | None = None
              ) -> list[RequestState]:
        """Feed each request's newest token to its output state (detokenize, stop strings) and
        return the touched user requests' states, but those `alone` took; finished ones are forgotten."""
        touched: dict[str, RequestState] = {}
        children, short = self._children, alone is not None
        # NOTE: `alone`'s lists appended to here, not through its method: this loop runs per request per step
        alone_ids, alone_tokens = ([], []) if alone is None else (alone.request_ids, alone.token_ids)
        first = len(alone_ids)
        for request, logprobs in zip(updated, step_logprobs, strict=True):
            if (entry := children.get(request.request_id)) is None:
                continue  # a sibling failed in this step: the whole request ended
            state, index = entry
            try:
                if short and state.add_token_alone(request, logprobs):
                    alone_ids.append(state.request_id)
                    alone_tokens.append(request.all_token_ids[-1])
                    continue
                self._advance(state, index, request, logprobs)
            except Exception as exc:  # noqa: BLE001 - this request's fault: end it, keep the engine
                logger.exception("request %s failed; ending it alone", state.request_id)
                touched.pop(state.request_id, None)
                self.abort_request(state.request_id)
                self._failures.append(RequestFailure(state.request_id, f"request failed in the engine: {exc!r}"))
                continue
            touched[state.request_id] = state
        # the next step, if it is this one's requests again, goes to `alone` at once (SteadyAlone); not after a
        # step that went through every state (`add_token` appends without counting the token sent)
        every = short and not touched and len(alone_ids) - first == len(updated)
        self._alone.remember(updated if every else [], alone_ids[first:] if every else [], self._states)
        for state in touched.values():
            if state.finished:
                del self._states[state.request_id]
        return list(touched.values())

    def _advance(self, state: RequestState, index: int, request: Request, logprobs: TokenLogprobs | None) -> None:
        """Feed one sequence's newest token to its request's output state."""
        stop = state.add_token(index, request.all_token_ids[-1], logprobs)
        if stop is not None:
            # A stop string wins over a token-level stop in the same step.
            self._stop(request, stop)
        if request.status.finished:
            state.finish(index, request.status, request.stop_reason)
            del self._children[request.request_id]
        if state.metrics.first_scheduled_time is None:
            state.metrics.first_scheduled_time = request.first_scheduled_time
        if request.num_cached_tokens:
            state.num_cached_tokens = request.num_cached_tokens
        if (state.prompt_logprobs is None and request.prompt_logprobs is not None
                and len(request.prompt_logprobs) == request.num_prompt_tokens):
            state.prompt_logprobs = list(request.prompt_logprobs)  # complete: the prompt's last chunk sampled

    def _stop(self, request: Request, stop: str) -> None:
        self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
        request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, stop

    def stop_sequence(self, request_id: str, index: int, stop: str) -> None:
        """Engine core process: the API process found stop string `stop` in sequence `index` of this
        request (`detokenize` False). Ends that sequence as `_advance` would have, frees its blocks;
        nothing is emitted (the API process has the output). A sequence already ended is left so."""
        child_id = child_request_id(request_id, index)
        entry = self._children.get(child_id)
        request = self.scheduler.requests.get(child_id)
        if entry is None or request is None:
            return
        state, _ = entry
        self._stop(request, stop)
        state.finish(index, request.status, stop)
        del self._children[child_id]
        if state.finished:
            del self._states[request_id]

    def has_request(self, request_id: str) -> bool:
        return request_id in self._states

    def take_failures(self) -> list[RequestFailure]:
        """The requests ended since the last call because handling them raised (`RequestFailure`);
        each caller tells its request's client."""
        failures, self._failures = self._failures, []
        return failures

    def prefill_request(self, request_id: str) -> Request | None:
        """Prefill role: a `prefill_only` request, running or finished with its blocks held (None: gone)."""
        return self.scheduler.requests.get(request_id) or self.scheduler.held.get(request_id)

    def held_block_ids(self, request_id: str) -> list[int]:
        """Prefill role: the blocks a finished `prefill_only` request still holds, in token order."""
        return list(self.scheduler.held[request_id].block_ids)

    def generator_state(self, request_id: str) -> bytes | None:
        """Prefill role: the seeded generator's state after the first token of a finished
        `prefill_only` request whose blocks are still held, for the decode side (None: unseeded)."""
        generator = self.scheduler.held[request_id].generator
        return None if generator is None else bytes(generator.get_state().cpu().numpy())

    def stats(self) -> EngineStats:
        # NOTE: "current batch" means now: an idle engine has none, whatever its last step was.
        batch = self._last_prefill_batch if self.has_runnable_requests() else (0, 0)
        lora_running, lora_waiting = self.loras.requests_info()
        return EngineStats(
            **self.scheduler.stats_fields(),
            num_prefill_tokens=self._num_prefill_tokens,
            num_batch_prefill_requests=batch[0], num_batch_prefill_tokens=batch[1],
            num_steps=self._num_steps, schedule_time_s=self._schedule_time_s, step_time_s=self._step_time_s,
            kv_tier=None if self.offload is None else self.offload.stats(),
            num_engine_requests=len(self._states),
            max_lora=self.loras.max_loras,
            running_lora_adapters=lora_running, waiting_lora_adapters=lora_waiting,
            num_kv_events_dropped_batches=dropped_batches(self.kv_event_publisher),
        )
