"""LoRA adapters across a PD cluster: the router's `LoRAAdmin` (serving/lora_routes.py).

Every worker of both roles must hold an adapter for a request under it to run (prefill computes
its prompt's KV under it, decode its tokens; the hand-off names the adapter and its digest and
decode refuses a mismatch). So the router keeps the workers alike:

    load / unload     sent to every worker of both roles at once; the same result on each, or none:
                      a load that fails on some worker is undone on the others, and the reply
                      names the workers and their reasons
    refresh           (every `REFRESH_S` while requests come, for GET /v1/models, and for a
                      request naming a model not known yet) asks each worker's GET
                      /v1/lora_adapters; an adapter some worker lacks (one that joined later, or
                      restarted) is loaded there from the path the others have it at
    prepare           before a request under an adapter runs: the workers that lack it as far as
                      the router knows (joined since the last refresh) get it first, so the
                      request finds it on whichever workers it is routed to
    names             the adapters served: those the workers held at the last refresh, or loaded
                      through this router since
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import httpx

from pdserve.disagg.router.stats import WorkerView
from pdserve.engine.lora_manager import LoRAInfo, lora_info
from pdserve.serving.lora_routes import LoRAAdmin

logger = logging.getLogger(__name__)
REFRESH_S = 2.0
_TIMEOUT_S = 60.0
_LOOKUP_S = 0.5


class RouterLoRAAdmin(LoRAAdmin):
    """Contract: event loop only; `workers()` is the router's pool now (both roles)."""

    def __init__(self, workers: Callable[[], list[WorkerView]]) -> None:
        self._workers = workers
        self._infos: dict[str, LoRAInfo] = {}
        self._held: dict[str, frozenset[str]] = {}  # worker URL -> the adapters it holds, as last seen
        self._refreshed_at = float("-inf")
        self._refreshing: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()  # NOTE: one change (or refresh) at a time: workers see them in one order

    def names(self) -> frozenset[str]:
        if time.monotonic() - self._refreshed_at > REFRESH_S and (self._refreshing is None or self._refreshing.done()):
            self._refreshing = asyncio.get_running_loop().create_task(self.refresh())
        return frozenset(self._infos)

    def info(self, name: str) -> LoRAInfo | None:
        """Adapter `name`'s record (its digest: the KV-event policies hash its prompts from it), as
        last seen; None when not known."""
        return self._infos.get(name)

    async def adapters(self) -> list[LoRAInfo]:
        await self.refresh()
        return list(self._infos.values())

    async def refresh(self) -> None:
        """Ask every worker what it serves; load what some lack where they lack it."""
        async with self._lock:
            self._refreshed_at = time.monotonic()
            urls = self._urls()
            async with httpx.AsyncClient(timeout=_TIMEOUT_S) as http:
                held = await asyncio.gather(*(_adapters(http, url) for url in urls))
                known: dict[str, LoRAInfo] = dict(self._infos)
                for infos in held:
                    for info in infos:
                        known.setdefault(info.name, info)
                self._held = {url: frozenset(i.name for i in infos) for url, infos in zip(urls, held, strict=True)}
                self._infos = known
                for url in urls:
                    for name in known.keys() - self._held[url]:
                        await self._load_on(http, url, name)

    async def lookup(self, name: str) -> None:
        """An unknown name: ask the workers again, at most every `_LOOKUP_S` (a client naming models
        that do not exist makes no more calls than that)."""
        if name not in self._infos and time.monotonic() - self._refreshed_at > _LOOKUP_S:
            await self.refresh()

    async def prepare(self, name: str) -> None:
        """Load adapter `name` now on the workers that lack it (one that joined since the last
        refresh): a request under it may be routed to any of them. No call when all hold it."""
        if all(name in self._held.get(url, ()) for url in self._urls()):
            return
        async with self._lock, httpx.AsyncClient(timeout=_TIMEOUT_S) as http:
            for url in self._urls():
                if name not in self._held.get(url, ()) and name in self._infos:
                    await self._load_on(http, url, name)

    async def _load_on(self, http: httpx.AsyncClient, url: str, name: str) -> None:
        """Load a known adapter on the worker at `url` from the path the others have it at."""
        status, text = await _post(http, url, "/v1/load_lora_adapter",
                                   {"lora_name": name, "lora_path": self._infos[name].path})
        if status == 200 or "has already been loaded" in text:
            self._held[url] = self._held.get(url, frozenset()) | {name}
        else:
            logger.warning("LoRA adapter %r could not be loaded on %s: %s", name, url, text)

    async def load(self, name: str, path: str) -> LoRAInfo:
        async with self._lock:
            urls = self._urls()
            if not urls:
                raise ValueError("no worker to load the LoRA adapter on")
            async with httpx.AsyncClient(timeout=_TIMEOUT_S) as http:
                body = {"lora_name": name, "lora_path": path}
                results = await asyncio.gather(*(_post(http, url, "/v1/load_lora_adapter", body) for url in urls))
                failed = [(url, text) for url, (status, text) in zip(urls, results, strict=True) if status != 200]
                if failed:
                    done = [url for url, (status, _) in zip(urls, results, strict=True) if status == 200]
                    await asyncio.gather(*(_post(http, url, "/v1/unload_lora_adapter", {"lora_name": name})
                                           for url in done))
                    raise ValueError(_refusal(name, failed, len(urls)))
                [info] = [i for i in await _adapters(http, urls[0]) if i.name == name] or [LoRAInfo(name, path, "", 0)]
            self._infos[name] = info
            for url in urls:
                self._held[url] = self._held.get(url, frozenset()) | {name}
            return info

    async def unload(self, name: str) -> None:
        async with self._lock:
            urls = self._urls()
            async with httpx.AsyncClient(timeout=_TIMEOUT_S) as http:
                body = {"lora_name": name}
                results = await asyncio.gather(*(_post(http, url, "/v1/unload_lora_adapter", body) for url in urls))
            statuses = [status for status, _ in results]
            if name not in self._infos and all(status == 404 for status in statuses):
                raise LookupError(f"The lora adapter '{name}' cannot be found.")
            failed = [(url, text) for url, (status, text) in zip(urls, results, strict=True)
                      if status not in (200, 404)]
            self._infos.pop(name, None)
            for url in urls:
                self._held[url] = self._held.get(url, frozenset()) - {name}
            if failed:
                raise ValueError(_refusal(name, failed, len(urls)))

    def _urls(self) -> list[str]:
        return [worker.url for worker in self._workers() if worker.load is not None]


def _refusal(name: str, failed: list[tuple[str, str]], num_workers: int) -> str:
    reasons = "; ".join(f"{url}: {text}" for url, text in failed)
    return f"LoRA adapter '{name}': refused by {len(failed)} of {num_workers} workers ({reasons})"


async def _post(http: httpx.AsyncClient, url: str, path: str, body: dict[str, str]) -> tuple[int, str]:
    """(status, the error's message or the reply's text); a worker that does not answer is a 503."""
    try:
        response = await http.post(url + path, json=body)
    except httpx.HTTPError as exc:
        return 503, f"no answer ({exc!r})"
    if response.status_code == 200:
        return 200, response.text
    try:
        return response.status_code, str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.status_code, response.text


async def _adapters(http: httpx.AsyncClient, url: str) -> list[LoRAInfo]:
    """What the worker at `url` serves (none when it does not answer or serves no LoRA)."""
    try:
        response = await http.get(url + "/v1/lora_adapters")
        if response.status_code != 200:
            return []
        return [lora_info(value) for value in response.json()["data"]]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return []
