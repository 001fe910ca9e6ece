"""Which decode worker gets a request: `DecodePolicy` and its implementations, chosen by name
(`RouterConfig.decode_policy`). To add one: subclass `DecodePolicy`, add it to `_POLICIES`, and
its name to `disagg.config.DECODE_POLICIES`."""

from __future__ import annotations

import abc
import asyncio
import itertools
from collections.abc import Callable

from pdserve.disagg.client import WorkerClient
from pdserve.disagg.config import DecodePolicyName
from pdserve.disagg.router.pool import Worker, reach


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


_POLICIES: dict[DecodePolicyName, Callable[[WorkerClient], DecodePolicy]] = {
    "least-loaded": lambda _: LeastLoaded(),
    "round-robin": lambda _: RoundRobin(),
    "prefix-affinity": PrefixAffinity,
}


def make_decode_policy(name: DecodePolicyName, client: WorkerClient) -> DecodePolicy:
    """The policy called `name` (one of disagg.config.DECODE_POLICIES); `client` for those that ask workers."""
    if name not in _POLICIES:
        raise ValueError(f"decode policy must be one of {tuple(_POLICIES)}, got {name!r}")
    return _POLICIES[name](client)
