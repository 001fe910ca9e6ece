"""The PD router: makes P prefill and D decode workers look like one engine to the OpenAI handlers
(`router/app.py` serves it through `serving/app.py`), so it serves the same API as a colocated server.

It owns one of each piece and runs a request through them; none of them calls back into it:
  `pool.py` (workers, readiness, load), `admission.py` (400/429/503), `policy.py` (which decode
  worker), `queue/` (how the prefill job reaches a prefill worker), `client.py` (the /pd/* calls).

One request:
  0. admission: a request that can never run is a 400, before anything is queued; no ready
     prefill or decode worker, or the queue unreachable, is a 503; too many admitted requests
     still waiting for their first token is a 429.
  1. the decode policy orders the ready decode workers; reserve the prompt's blocks on the first
     with room (POST /pd/reserve). No room anywhere: wait and retry until `reserve_deadline_s`,
     then 503.
  2. conditional disaggregation: when what the decode worker does not already cache is shorter
     than `pd_threshold` tokens, it prefills that itself (POST /pd/prefill_here). Otherwise the
     prefill job goes onto the prefill queue.
  3. stream the decode worker's outputs (GET /pd/stream/{id}) back as RequestOutputs; the first
     token, where it is exactly what decode would send, comes from the prefill worker as soon as
     it is sampled (`early_first_token`, router/outputs.py), before decode has the KV. A
     `kv_retry` frame (the transfer stalled) makes a new prefill attempt. A decode worker lost
     mid-stream: the request resumes on another one, prefilled over prompt + tokens already sent
     (its job goes to the prefill worker whose cache, pool or disk tier, holds the prompt's KV:
     that worker re-sends it and computes only the sent tokens; `kv_recoveries` counts which),
     so the client sees no duplicated and no missing token (exact for greedy decoding; a sampled
     continuation is a fresh sample). No decode worker left: it waits for one (restarted, new) until
     `reserve_deadline_s`, then the error reaches the client.
  Until its first output the request runs under the first-token deadline (`first_token_timeout_s`):
  past it, a 503, and the request is aborted as below.
  Leaving early (client gone) aborts the request on every worker, which frees every block.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass

from pdserve.disagg.auth import load_cluster_secret
from pdserve.disagg.client import WorkerClient
from pdserve.disagg.config import RouterConfig
from pdserve.disagg.queue import PrefillQueue
from pdserve.disagg.router.admission import Admission
from pdserve.disagg.router.errors import RouterError
from pdserve.disagg.router.kv_index import KVEventsView, lora_root
from pdserve.disagg.router.membership import Membership, Registry
from pdserve.disagg.router.memory_queue import make_queue
from pdserve.disagg.router.outputs import AttemptFailed, DecodeLost, after_sent, continuation, next_within
from pdserve.disagg.router.policy import DecodePolicy, KVEventsPolicy, make_decode_policy
from pdserve.disagg.router.pool import WorkerPool
from pdserve.disagg.router.request_run import Instance, RequestRun, RouterParts, RunEvents, instance
from pdserve.disagg.router.stats import IndexResets, Recoveries, RouterEvents, RouterStats, WorkerRole, WorkerView
from pdserve.engine.lora_manager import LoRAInfo
from pdserve.engine.output import CompletionOutput, RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.model.qwen3_config import Qwen3ModelConfig
from pdserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
_CONNECT_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class ServedModel:
    """What the router knows of the model its workers serve."""

    tokenizer: Tokenizer
    config: Qwen3ModelConfig
    path: str
    max_model_len: int


class PDRouter:
    """EngineClient over remote workers (see serving/engine_client.py for the contract) and the
    RouterState its metrics and dashboard read (router/stats.py). Used from one event loop."""

    def __init__(self, config: RouterConfig, model: ServedModel, *, pool: WorkerPool, queue: PrefillQueue,
                 client: WorkerClient, membership: Membership | None = None) -> None:
        config.validate()
        tokenizer, model_config, max_model_len = model.tokenizer, model.config, model.max_model_len
        self.config = config
        self.tokenizer = tokenizer
        self.model_path = model.path
        self.max_model_len = max_model_len
        self.pool = pool
        self.membership = membership or Membership(pool, config)
        self.queue = queue
        self.client = client
        self.vocab_size = model_config.vocab_size
        self.admission = Admission(config, pool, queue, max_model_len, model_config.vocab_size)
        self.policy: DecodePolicy = make_decode_policy(config.decode_policy, client)
        # --prefill-policy kv-events: the prefill workers' caches from their events (memory queue)
        self.prefill_view = KVEventsView() if config.prefill_policy == "kv-events" else None
        # the adapters' records (name, digest) the router knows (app.py: its RouterLoRAAdmin's), for
        # the hash root of a prompt under one
        self.lora_infos: Callable[[str], LoRAInfo | None] = lambda _: None
        self._events = RunEvents()
        self.parts = RouterParts(config, tokenizer, max_model_len, self.vocab_size, pool, self.policy, queue, client,
                                 self.admission, self._events, queue.places_later(), self.lora_root,
                                 self.prefill_view)

    @classmethod
    def from_config(cls, config: RouterConfig, tokenizer: Tokenizer, model_config: Qwen3ModelConfig,
                    model_path: str, max_model_len: int) -> PDRouter:
        """The router with its client, pool (`config`'s members: URLs, DNS names, registrations)
        and queue (`config.queue`)."""
        # NOTE: no read timeout: a prefill job's POST answers once its hand-off ended, a stream
        # lasts as long as its request; until its first output, the first-token deadline bounds it.
        client = WorkerClient(timeout_s=None, connect_timeout_s=_CONNECT_TIMEOUT_S,
                              secret=load_cluster_secret(config.cluster_secret_file), frame_mux=config.frame_mux)
        pool = WorkerPool(client)
        registry = Registry(config.registration_ttl_s) if config.accept_registrations else None
        membership = Membership(pool, config, registry=registry)
        queue = make_queue(config.queue, pool, client)
        model = ServedModel(tokenizer, model_config, model_path, max_model_len)
        return cls(config, model, pool=pool, queue=queue, client=client, membership=membership)

    @property
    def alive(self) -> bool:
        return not self.unready_reason

    @property
    def unready_reason(self) -> str:
        """Why a request would get a 503 now ("" when none): the queue is unreachable, or no
        prefill or no decode worker is ready (GET /ready, Kubernetes' readiness probe)."""
        if self.queue.error:
            return self.queue.error
        if not self.queue.ready:
            return "no prefill worker is ready"
        if not self.pool.any_ready("decode"):
            return "no decode worker is ready"
        return ""

    def workers(self) -> list[WorkerView]:
        return self.pool.views()

    def stats(self) -> RouterStats:
        queue = self.queue.stats()
        events = RouterEvents(kv_retries=self._events.kv_retries, redispatched=queue.num_redispatched,
                              resumed=self._events.resumed, prefilled_on_decode=self._events.prefilled_on_decode)
        return RouterStats(queued_requests=self.admission.num_queued, queued_tokens=self.admission.num_queued_tokens,
                           dispatch_pending=queue.num_pending, queue_backlog=queue.num_backlog, queue=queue.kind,
                           live_queue_consumers=queue.num_live_consumers, queue_error=queue.error,
                           rejections=self.admission.rejections(), events=events,
                           recoveries=Recoveries(self._events.recovered_from_prefill_cache,
                                                 self._events.recovered_by_recompute),
                           index_resets=self._index_resets())

    def _index_resets(self) -> dict[WorkerRole, IndexResets]:
        decode_view = self.policy.view if isinstance(self.policy, KVEventsPolicy) else None
        views: dict[WorkerRole, KVEventsView | None] = {"decode": decode_view, "prefill": self.prefill_view}
        return {role: IndexResets(**view.stats.resets) for role, view in views.items() if view is not None}

    async def refresh(self) -> None:
        """Update the membership, poll the pool (the heartbeat), then let the queue take another
        look at it."""
        await self.membership.refresh()
        await self.pool.refresh()
        self.policy.observe(self.pool.members("decode"))
        if self.prefill_view is not None:
            self.prefill_view.observe(self.pool.members("prefill"))
        await self.queue.refresh()

    def lora_root(self, lora_name: str | None) -> bytes:
        """The hash root a prompt under `lora_name` chains its blocks from on the workers."""
        return lora_root(lora_name, None if lora_name is None else self.lora_infos(lora_name))

    async def watch(self, interval_s: float = 0.5) -> None:
        """Keep the view of the pool fresh (readiness and load) until cancelled. A round that fails
        unexpectedly is logged and the next one tried: a router that stopped watching would route
        on a stale pool (its /health says so only if this loop ends)."""
        while True:
            try:
                await self.refresh()
            except Exception:
                logger.exception("refreshing the worker pool failed; trying again")
            await asyncio.sleep(interval_s)

    async def close(self) -> None:
        await self.policy.close()
        if self.prefill_view is not None:
            await self.prefill_view.close()
        await self.queue.close()
        await self.client.close()

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.admission.validate(prompt_token_ids, params)

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """The request's outputs. The router's edge: a RouterError from anywhere inside becomes
        the client's OpenAIError here (errors.py), before the first output or after it."""
        try:
            async with contextlib.aclosing(self._generate(request_id, prompt_token_ids, params)) as outputs:
                async for output in outputs:
                    yield output
        except RouterError as exc:
            raise exc.client_error() from exc

    async def _generate(self, request_id: str, prompt_token_ids: list[int],
                        params: SamplingParams) -> AsyncGenerator[RequestOutput, None]:
        self.validate_request(prompt_token_ids, params)
        await self.admission.admit(len(prompt_token_ids))
        outputs = self._run(request_id, prompt_token_ids, params)
        try:
            try:
                first = await self._first_output(request_id, outputs)
            finally:
                self.admission.release(len(prompt_token_ids))
            if first is None:
                return
            yield first
            async for output in outputs:
                yield output
        finally:
            await outputs.aclose()

    async def _first_output(self, request_id: str,
                            outputs: AsyncGenerator[RequestOutput, None]) -> RequestOutput | None:
        """The request's first output, within the first-token deadline: past it, a 503 (counted as
        `first_token_timeout`), and the request is aborted on every worker (None: no output at all)."""
        # NOTE: the deadline cancels the generator wherever it waits (a reservation, the queue, a
        # prefill, a resume); its `finally` blocks abort the request on decode and cancel its job.
        try:
            return await next_within(outputs, self.config.first_token_timeout_s or None)
        except StopAsyncIteration:
            return None
        except TimeoutError:
            logger.warning("request %s: no first token within %g s; aborted", request_id,
                           self.config.first_token_timeout_s)
            self.admission.reject("first_token_timeout", f"no first token within the router's first-token deadline "
                                  f"({self.config.first_token_timeout_s:g} s)")

    def run(self, request_id: str, prompt: list[int], params: SamplingParams, resume: int = 0) -> RequestRun:
        """The request's `resume`-th run (request_run.py), for it to take every step with."""
        return RequestRun(self.parts, request_id, prompt, params, resume)

    async def _run(self, request_id: str, prompt: list[int],
                   params: SamplingParams) -> AsyncGenerator[RequestOutput, None]:
        """The request on one decode worker after another, until it finishes (n > 1: on one only)."""
        sent = CompletionOutput(0, "", [], logprobs=None if params.logprobs is None else [])  # out before a loss
        lost: set[Instance] = set()  # the decode workers that lost it
        prompt_logprobs = None  # asked for: from the first frame that has them (prefill computed them)
        for resume in range(self.config.max_resumes + 1):
            run = self.run(request_id, prompt + sent.token_ids,
                           continuation(self.tokenizer, params, sent.token_ids, sent.text), resume)
            if resume == 0:
                await run.dispatch_unplaced()
            decode = await run.reserve(lost)
            last: RequestOutput | None = None
            try:
                async for output in run.outputs():
                    prompt_logprobs = prompt_logprobs or output.prompt_logprobs
                    if output.finished and prompt_logprobs is None and params.prompt_logprobs is not None:
                        raise RouterError("decode_broke", f"decode worker {decode.url} did not send the prompt's "
                                          "logprobs (an older version?)")
                    last = after_sent(request_id, prompt, sent, output, prompt_logprobs)
                    yield last
                return
            except DecodeLost as exc:
                if not isinstance(exc, AttemptFailed):  # its worker is still there
                    lost.add(instance(decode))
                if last is not None:
                    sent = last.outputs[0]
                # NOTE: n sequences that share a prompt's KV are not resumed one by one
                if resume == self.config.max_resumes or params.n > 1:
                    raise RouterError("decode_broke", str(exc)) from exc
                self._events.resumed += 1
                logger.warning("request %s: %s; resuming on another decode worker after %d tokens", request_id, exc,
                               len(sent.token_ids))
