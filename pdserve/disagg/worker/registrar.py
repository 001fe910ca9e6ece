"""A worker's side of registration (`--register http://ROUTER`): once its own server answers,
POST /pd/register to every router, again every `interval_s` (the heartbeat: a router that
restarted relearns its workers within one interval), and POST /pd/deregister when the worker
starts draining. Registration only makes a worker a member: the router still sends it nothing
until its GET /pd/info says ready (membership.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import httpx

from pdserve.disagg.auth import ClusterSecret, SignedRequests
from pdserve.disagg.control import Registration, WorkerRole

logger = logging.getLogger(__name__)
_TIMEOUT_S = 2.0
_TICK_S = 0.1
_SAY_WAITING_AFTER_S = 5.0  # a worker that does not answer at its URL after this long: said (--advertise-url?)
# a router that took the registration and then stops answering is warned of only after this long: a
# restart, or `pdserve up` stopping the router before the decode workers, looks the same at first.
# NOTE: longer than `up`'s wait before it signals decode (ops/supervisor.py `Supervisor.stop`: half its
# 15 s grace) plus one announcement interval, or a deliberate stop would warn again
WARN_GONE_AFTER_S = 10.0


class Registrar:
    def __init__(self, routers: tuple[str, ...], role: WorkerRole, url: str, draining: Callable[[], bool], *,
                 interval_s: float = 2.0, secret: ClusterSecret | None = None) -> None:
        """`secret`: the cluster secret that signs every announcement (a router with one refuses others)."""
        self._auth = SignedRequests(secret)
        self._routers = [r.rstrip("/") for r in routers]
        self._body = Registration(role=role, url=url).model_dump()
        self._url = url.rstrip("/")
        self._draining = draining
        self._interval_s = interval_s
        self._answering: dict[str, bool] = {}  # router -> did it take the last announcement
        self._gone_since: dict[str, float | None] = {}  # a router that stopped answering: since when (None: warned)

    async def run(self) -> None:
        """Until cancelled; deregisters once draining starts (or on cancel, best effort)."""
        async with httpx.AsyncClient(timeout=_TIMEOUT_S, auth=self._auth) as http:
            try:
                await self._until_serving(http)
                while not self._draining():
                    await asyncio.gather(*(self._announce(http, router) for router in self._routers))
                    await self._sleep(self._interval_s)
            finally:
                await self._leave(http)

    async def _sleep(self, seconds: float) -> None:
        """`seconds`, or less once draining starts."""
        loop = asyncio.get_running_loop()
        end = loop.time() + seconds
        while not self._draining() and loop.time() < end:
            await asyncio.sleep(_TICK_S)

    async def _until_serving(self, http: httpx.AsyncClient) -> None:
        """Until this worker answers at the URL it advertises (so no router polls it before it
        listens, and a wrong --advertise-url shows up in the log). NOTE: said only once it has
        taken a while: the registrar starts before the server listens, so every start waits a little."""
        warned, waited = False, 0.0
        while not self._draining():
            try:
                if (await http.get(f"{self._url}/health")).status_code == 200:
                    return
            except httpx.HTTPError as exc:
                if not warned and waited >= _SAY_WAITING_AFTER_S:
                    logger.info("waiting to answer at %s before registering (%r)", self._url, exc)
                    warned = True
            await self._sleep(0.2)
            waited += 0.2

    async def _announce(self, http: httpx.AsyncClient, router: str) -> None:
        try:
            reply = await http.post(f"{router}/pd/register", json=self._body)
            ok, why = reply.status_code == 200, f"HTTP {reply.status_code}: {reply.text[:200]}"
        except httpx.HTTPError as exc:
            ok, why = False, repr(exc)
        if ok:
            if not self._answering.get(router):
                logger.info("registered with router %s as %s worker %s", router, self._body["role"], self._url)
            self._gone_since.pop(router, None)
        elif self._answering.get(router):
            logger.info("router %s stopped answering the registration (%s); announcing again every %g s",
                        router, why, self._interval_s)
            self._gone_since[router] = asyncio.get_running_loop().time()
        elif router not in self._gone_since:  # NOTE: never answered: said at once (a wrong --register?)
            logger.warning("router %s did not take the registration: %s", router, why)
            self._gone_since[router] = None
        elif (since := self._gone_since[router]) is not None:  # gone after answering; not warned of yet
            gone_s = asyncio.get_running_loop().time() - since
            if gone_s >= WARN_GONE_AFTER_S:
                logger.warning("router %s has not taken the registration for %.0f s: %s", router, gone_s, why)
                self._gone_since[router] = None
        self._answering[router] = ok

    async def _leave(self, http: httpx.AsyncClient) -> None:
        async def one(router: str) -> None:
            with contextlib.suppress(httpx.HTTPError):
                await http.post(f"{router}/pd/deregister", json=self._body)

        if any(self._answering.values()):
            await asyncio.gather(*(one(r) for r, ok in self._answering.items() if ok))
            logger.info("deregistered from %d router(s)", sum(self._answering.values()))
            self._answering.clear()
