"""Which decode worker gets a request: `DecodePolicy` and its implementations, chosen by name
(`RouterConfig.decode_policy`). To add one: subclass `DecodePolicy`, add it to `_POLICIES`, and
its name to `disagg.config.DECODE_POLICIES`."""

from __future__ import annotations

import abc
import asyncio
import itertools
import logging
from collections.abc import Callable

from pdserve.disagg.client import WorkerClient
from pdserve.disagg.config import DecodePolicyName
from pdserve.disagg.router.kv_index import (
    EventSource,
    KVBlockIndex,
    KVEventSubscription,
    prompt_block_hashes,
    source_of,
)
from pdserve.disagg.router.pool import Worker, reach

logger = logging.getLogger(__name__)


class DecodePolicy(abc.ABC):
    """Orders the candidate decode workers for one request, best first.

    Called by the router (`RequestRun.reserve`) on its event loop for each reservation round of a
    request: once, then again every 50 ms while no candidate has KV room, so it must be cheap or
    bound its own I/O. `candidates` are the ready decode workers the request has not lost (never
    empty). The router reserves on them in the returned order and takes the first with room, so
    return a permutation of `candidates`. A policy may keep state across calls (a position) but
    owns no request and nothing to release. One that asks the workers must survive a worker that
    does not answer: it ranks last, and leaves the pool until its next poll (`pool.reach`)."""

    @abc.abstractmethod
    async def order(self, candidates: list[Worker], prompt_token_ids: list[int]) -> list[Worker]: ...

    def observe(self, workers: list[Worker]) -> None:
        """The decode workers after each poll of the pool (`PDRouter.refresh`), ready or not, for a
        policy that follows them (kv-events: whom to subscribe to). Must not block."""
        return

    async def close(self) -> None:
        """The router stops: end what the policy runs."""
        return


def _load(worker: Worker) -> tuple[int, int]:
    """Sort key, least loaded first: most free KV blocks, then fewest requests from this router."""
    return -(worker.info.num_free_kv_blocks if worker.info else 0), worker.in_flight


class LeastLoaded(DecodePolicy):
    """The worker with the most free KV blocks (ties: fewest requests in flight from this router)."""

    async def order(self, candidates: list[Worker], prompt_token_ids: list[int]) -> list[Worker]:
        return sorted(candidates, key=_load)


class RoundRobin(DecodePolicy):
    """Each request starts one worker further along the list than the previous one."""

    def __init__(self) -> None:
        self._next = itertools.count()

    async def order(self, candidates: list[Worker], prompt_token_ids: list[int]) -> list[Worker]:
        start = next(self._next) % len(candidates)
        return candidates[start:] + candidates[:start]


class PrefixAffinity(DecodePolicy):
    """The worker whose prefix cache holds the longest part of the prompt (POST /pd/prefix to
    each, concurrently), so a shared prefix is computed once; ties go to the least loaded."""

    def __init__(self, client: WorkerClient) -> None:
        self._client = client

    async def order(self, candidates: list[Worker], prompt_token_ids: list[int]) -> list[Worker]:
        if len(candidates) == 1:
            return list(candidates)
        cached = await asyncio.gather(*(self._cached_tokens(w, prompt_token_ids) for w in candidates))
        by_url = dict(zip((w.url for w in candidates), cached, strict=True))
        return sorted(candidates, key=lambda w: (-by_url[w.url], _load(w)))

    async def _cached_tokens(self, worker: Worker, prompt_token_ids: list[int]) -> int:
        cached = await reach(worker, self._client.prefix(worker.url, prompt_token_ids))
        return -1 if cached is None else cached


class KVEventsPolicy(DecodePolicy):
    """The worker whose prefix cache holds the most leading blocks of the prompt, as its KV-cache
    events say (router/kv_index.py: a subscription per worker advertising an endpoint, kept by
    `observe`); ties, and workers that publish none (they count 0 blocks), go to the one with the
    fewest requests in flight from this router, then the fewest blocks cached, then the least loaded.
    No call to any worker on the request's path. The prompt is hashed with each worker's block
    size (its KV layout's)."""

    def __init__(self) -> None:
        import zmq.asyncio  # NOTE: only a router with this policy loads pyzmq

        self._context = zmq.asyncio.Context()
        self._subscriptions: dict[str, tuple[tuple[str, EventSource], KVEventSubscription]] = {}
        self._closing: set[asyncio.Task[None]] = set()  # subscriptions of workers gone, closing

    def observe(self, workers: list[Worker]) -> None:
        listed = {w.url for w in workers}
        for url in [u for u in self._subscriptions if u not in listed]:
            self._drop(url)
        for worker in workers:
            if worker.info is None:
                continue  # NOTE: unreachable now: its subscription stays (ZMQ reconnects), a restart shows in its info
            source = source_of(worker.info, worker.url)
            key = None if source is None else (worker.info.instance_id, source)
            held = self._subscriptions.get(worker.url)
            if held is not None and held[0] == key:
                continue
            if held is not None:
                logger.info("KV events: %s changed (restarted, or a new endpoint); its index starts over", worker.url)
                self._drop(worker.url)
            if source is not None and key is not None:
                self._subscriptions[worker.url] = (key, KVEventSubscription(self._context, source, worker.url))
                logger.info("KV events: following %s at %s", worker.url, source.publish)

    def _drop(self, url: str) -> None:
        _, subscription = self._subscriptions.pop(url)
        task = asyncio.get_running_loop().create_task(subscription.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def index(self, url: str) -> KVBlockIndex | None:
        held = self._subscriptions.get(url)
        return None if held is None else held[1].index

    def num_prefix_blocks(self, worker: Worker, prompt_token_ids: list[int],
                          hashes_by_size: dict[int, list[int]]) -> int:
        index = self.index(worker.url)
        if index is None or worker.info is None:
            return 0
        block_size = int(worker.info.kv_layout.get("block_size", 0)) or index.block_size
        if not block_size:
            return 0
        if block_size not in hashes_by_size:
            hashes_by_size[block_size] = prompt_block_hashes(prompt_token_ids, block_size)
        return index.num_prefix_blocks(hashes_by_size[block_size])

    async def order(self, candidates: list[Worker], prompt_token_ids: list[int]) -> list[Worker]:
        if len(candidates) == 1:
            return list(candidates)
        hashes: dict[int, list[int]] = {}
        cached = {w.url: self.num_prefix_blocks(w, prompt_token_ids, hashes) for w in candidates}
        # NOTE: ties (a prefix no worker holds yet) by this router's live in-flight count, then by the
        # fewest blocks cached (live, from events): new prefixes spread over the workers' caches instead
        # of piling onto one (free blocks are as of the last poll, 0.5 s ago: every new prefix in that
        # window would go to one worker, whose cache then holds more prefixes than fit and thrashes)
        return sorted(candidates, key=lambda w: (-cached[w.url], w.in_flight, self._num_cached(w), _load(w)))

    def _num_cached(self, worker: Worker) -> int:
        index = self.index(worker.url)
        return 0 if index is None else len(index.hashes)

    async def close(self) -> None:
        for url in list(self._subscriptions):
            _, subscription = self._subscriptions.pop(url)
            await subscription.close()
        self._context.destroy(linger=0)


_POLICIES: dict[DecodePolicyName, Callable[[WorkerClient], DecodePolicy]] = {
    "least-loaded": lambda _: LeastLoaded(),
    "round-robin": lambda _: RoundRobin(),
    "prefix-affinity": PrefixAffinity,
    "kv-events": lambda _: KVEventsPolicy(),
}


def make_decode_policy(name: DecodePolicyName, client: WorkerClient) -> DecodePolicy:
    """The policy called `name` (one of disagg.config.DECODE_POLICIES); `client` for those that ask workers."""
    if name not in _POLICIES:
        raise ValueError(f"decode policy must be one of {tuple(_POLICIES)}, got {name!r}")
    return _POLICIES[name](client)
