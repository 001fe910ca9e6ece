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
from pdserve.disagg.router.kv_index import KVBlockIndex, KVEventsView
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
    async def order(self, candidates: list[Worker], prompt_token_ids: list[int], root: bytes = b"") -> list[Worker]:
        """`root`: the hash root the prompt's blocks chain from (kv_index.py `lora_root`: b"" for the
        base model, its LoRA adapter's otherwise), for a policy that matches cached blocks."""

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

    async def order(self, candidates: list[Worker], prompt_token_ids: list[int], root: bytes = b"") -> list[Worker]:
        return sorted(candidates, key=_load)


class RoundRobin(DecodePolicy):
    """Each request starts one worker further along the list than the previous one."""

    def __init__(self) -> None:
        self._next = itertools.count()

    async def order(self, candidates: list[Worker], prompt_token_ids: list[int], root: bytes = b"") -> list[Worker]:
        start = next(self._next) % len(candidates)
        return candidates[start:] + candidates[:start]


class PrefixAffinity(DecodePolicy):
    """The worker whose prefix cache holds the longest part of the prompt (POST /pd/prefix to
    each, concurrently), so a shared prefix is computed once; ties go to the least loaded."""

    def __init__(self, client: WorkerClient) -> None:
        self._client = client

    async def order(self, candidates: list[Worker], prompt_token_ids: list[int], root: bytes = b"") -> list[Worker]:
        # NOTE: the worker's /pd/prefix hashes from the base model's root: an adapter's prompt may
        # be ranked by blocks it cannot use (a routing cost only)
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
        self.view = KVEventsView()

    def observe(self, workers: list[Worker]) -> None:
        self.view.observe(workers)

    def index(self, url: str) -> KVBlockIndex | None:
        return self.view.index(url)

    async def order(self, candidates: list[Worker], prompt_token_ids: list[int], root: bytes = b"") -> list[Worker]:
        if len(candidates) == 1:
            return list(candidates)
        hashes: dict[int, list[int]] = {}
        cached = {w.url: self.view.num_prefix_blocks(w, prompt_token_ids, root, hashes) for w in candidates}
        # NOTE: ties (a prefix no worker holds yet) by this router's live in-flight count, then by the
        # fewest blocks cached (live, from events): new prefixes spread over the workers' caches instead
        # of piling onto one (free blocks are as of the last poll, 0.5 s ago: every new prefix in that
        # window would go to one worker, whose cache then holds more prefixes than fit and thrashes)
        return sorted(candidates, key=lambda w: (-cached[w.url], w.in_flight, self.view.num_cached(w), _load(w)))

    async def close(self) -> None:
        await self.view.close()


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
