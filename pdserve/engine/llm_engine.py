"""The engine: scheduler + model runner + output processing, driven one `step()` at a time."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from pdserve.config import EngineArgs, EngineConfig, create_engine_config
from pdserve.engine.host_memory import keep_large_allocations_on_heap
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.output import RequestOutput, RequestState
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.model.loader import load_model
from pdserve.tokenizer import Tokenizer, load_tokenizer


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Plain numbers; the serving layer turns them into metrics."""

    num_running: int
    num_waiting: int
    num_swapped: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    kv_cache_usage: float
    num_preemptions: int
    num_prefix_query_tokens: int
    num_prefix_hit_tokens: int
    num_evictions: int
    num_steps: int
    schedule_time_s: float  # total time in schedule() + update() bookkeeping
    step_time_s: float  # total wall time of steps


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if config.device.type == "cpu":
            keep_large_allocations_on_heap()
        model = load_model(config.model_path, config.dtype, config.device, config.scheduler.max_model_len,
                           batch_size_hint=min(config.scheduler.max_num_seqs, 64))
        self.runner = ModelRunner(config, model)
        self.scheduler = Scheduler(config.scheduler, config.cache)
        self._states: dict[str, RequestState] = {}
        self._children: dict[str, tuple[RequestState, int]] = {}
        self._num_steps = 0
        self._schedule_time_s = 0.0
        self._step_time_s = 0.0

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        config = create_engine_config(args)
        return cls(config, load_tokenizer(config.model_path))

    # -- requests -----------------------------------------------------------------------------
    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises ValueError for a request that can never run; the server answers it with a 400.
        Pure reads of frozen config: safe to call from any thread."""
        max_len = self.config.scheduler.max_model_len
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_token_ids) >= max_len:
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens; max_model_len is {max_len}, "
                             f"so at most {max_len - 1} prompt tokens fit")
        vocab = self.config.model.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        # NOTE: the sampler indexes logits with stop ids (min_tokens masking); an id out of range
        # would raise inside step() and stop the engine for everyone.
        bad = next((t for t in params.stop_token_ids if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"stop_token_ids: token id {bad} is outside the vocabulary [0, {vocab})")

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        if request_id in self._states:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.validate_request(token_ids, params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        state = RequestState(request_id, prompt_text, token_ids, params.n, self.tokenizer,
                             params.skip_special_tokens, params.logprobs is not None, params.stop,
                             params.include_stop_str_in_output, params.min_tokens, arrival)
        children = []
        for index in range(params.n):
            child_params = params
            if index > 0 and params.seed is not None:
                # Distinct per sequence, and unlike seed + index, not another request's seed.
                child_params = dataclasses.replace(params, seed=hash((params.seed, index)) & (2**63 - 1))
            child_id = request_id if params.n == 1 else f"{request_id}#{index}"
            children.append(Request(child_id, token_ids, child_params, self.tokenizer.eos_token_ids,
                                    self.config.scheduler.max_model_len, arrival, self.config.device))
        for child in children:  # validated all before adding any
            self.scheduler.add_request(child)
        for index, child in enumerate(children):
            self._children[child.request_id] = (state, index)
        self._states[request_id] = state

    def abort_request(self, request_id: str) -> RequestOutput | None:
        state = self._states.pop(request_id, None)
        if state is None:
            return None
        for child_id, (owner, index) in list(self._children.items()):
            if owner is state:
                self.scheduler.abort(child_id)
                state.finish(index, RequestStatus.FINISHED_ABORTED, None)
                del self._children[child_id]
        return state.snapshot()

    def has_unfinished_requests(self) -> bool:
        return bool(self._states)

    # -- the loop -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduling step + one model forward. Returns a cumulative snapshot for every
        request that produced a token (or finished) during the step."""
        start = time.perf_counter()
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        scheduled = time.perf_counter()
        sampled = self.runner.execute(out)
        executed = time.perf_counter()
        updated = self.scheduler.update(out, {rid: token for rid, (token, _) in sampled.items()})
        touched: dict[str, RequestState] = {}
        for request in updated:
            state, index = self._children[request.request_id]
            stop = state.add_token(index, request.all_token_ids[-1], sampled[request.request_id][1])
            if stop is not None:
                # A stop string wins over a token-level stop in the same step.
                self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
                request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, stop
            if request.status.finished:
                state.finish(index, request.status, request.stop_reason)
                del self._children[request.request_id]
            if request.num_cached_tokens:
                state.num_cached_tokens = request.num_cached_tokens
            touched[state.request_id] = state
        outputs = [state.snapshot() for state in touched.values()]
        for output in outputs:
            if output.finished:
                del self._states[output.request_id]
        done = time.perf_counter()
        self._num_steps += 1
        self._schedule_time_s += (scheduled - start) + (done - executed)
        self._step_time_s += done - start
        return outputs

    def stats(self) -> EngineStats:
        kv = self.scheduler.kv
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_swapped=len(self.scheduler.swapped),
            num_kv_blocks=kv.pool.num_blocks,
            num_free_kv_blocks=kv.pool.num_free_blocks,
            kv_cache_usage=kv.usage,
            num_preemptions=self.scheduler.num_preemptions,
            num_prefix_query_tokens=kv.num_prefix_queries,
            num_prefix_hit_tokens=kv.num_prefix_hits,
            num_evictions=kv.pool.num_evictions,
            num_steps=self._num_steps,
            schedule_time_s=self._schedule_time_s,
            step_time_s=self._step_time_s,
        )
