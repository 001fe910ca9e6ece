"""`pdserve balancer`: one OpenAI endpoint in front of N colocated replicas (`pdserve serve`), each
request passed whole to the ready replica with the fewest requests in flight from this balancer.

This is the baseline the seed's claim is about (DIGEST 18-19): N devices used as N colocated
replicas, against P + D = N devices disaggregated behind the PD router. `pdserve up --colocated N`
starts one with N replicas. It is deliberately thin: it parses nothing, so whatever a replica
answers (errors, streams, usage) reaches the client byte for byte, and the bench measures the
replicas, not a proxy's translation of them.

- Readiness: GET /ready of every replica every `poll_s`; a replica whose connection fails leaves
  the rotation at once, until its next 200.
- A request whose replica fails before answering (the connection refused, or broken off before
  the status line: a replica that died) is tried on the next ready replica, each replica once: a
  completion has no effect but its answer, and nothing of it reached the client yet. A replica
  that dies mid-response ends that response, as the colocated server itself would.
- A client that goes away closes the upstream stream, so the replica aborts the request.
- GET /workers lists the replicas (role "replica") as the PD router lists its workers, which is
  what `pdserve up`'s supervisor reads.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from http import HTTPStatus

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.serving.config import ApiConfig
from pdserve.serving.errors import error_response

logger = logging.getLogger(__name__)

# NOTE: hop-by-hop and length headers are the proxy's own business on each leg
_DROPPED_HEADERS = frozenset({"host", "content-length", "connection", "keep-alive", "transfer-encoding",
                              "te", "upgrade", "proxy-connection"})


@dataclass
class Replica:
    url: str
    ready: bool = False
    in_flight: int = 0

    def view(self) -> dict[str, object]:
        return {"role": "replica", "url": self.url, "ready": self.ready, "in_flight": self.in_flight,
                "draining": False, "load": None}


class Balancer:
    """The replicas and the choice among them (least in flight, ties in turn)."""

    def __init__(self, urls: list[str], poll_s: float = 0.5) -> None:
        if not urls:
            raise ValueError("a balancer needs at least one --replica URL")
        self.replicas = [Replica(url.rstrip("/")) for url in urls]
        self.poll_s = poll_s
        self._turn = itertools.count()

    def pick(self, exclude: set[str]) -> Replica | None:
        ready = [r for r in self.replicas if r.ready and r.url not in exclude]
        if not ready:
            return None
        turn = next(self._turn)
        return min(ready, key=lambda r: (r.in_flight, (self.replicas.index(r) - turn) % len(self.replicas)))

    async def poll(self, http: httpx.AsyncClient) -> None:
        async def one(replica: Replica) -> None:
            try:
                ready = (await http.get(f"{replica.url}/ready", timeout=2.0)).status_code == 200
            except httpx.HTTPError:
                ready = False
            if ready != replica.ready:
                logger.info("replica %s %s", replica.url, "ready" if ready else "not ready")
            replica.ready = ready

        await asyncio.gather(*(one(r) for r in self.replicas))

    async def watch(self, http: httpx.AsyncClient) -> None:
        while True:
            await self.poll(http)
            await asyncio.sleep(self.poll_s)

    @property
    def unready_reason(self) -> str:
        return "" if any(r.ready for r in self.replicas) else "no replica is ready"


def create_balancer_app(balancer: Balancer, api: ApiConfig | None = None) -> FastAPI:
    from pdserve.serving.app import install_middleware

    state: dict[str, object] = {}

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # NOTE: no read timeout: a long generation streams for as long as it streams
        async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=None)) as http:
            state["http"] = http
            await balancer.poll(http)
            watcher = asyncio.create_task(balancer.watch(http))
            try:
                yield
            finally:
                watcher.cancel()

    app = FastAPI(title="pdserve balancer", lifespan=lifespan)
    install_middleware(app, api or ApiConfig())
    _add_routes(app, balancer, state)
    return app


def _add_routes(app: FastAPI, balancer: Balancer, state: dict[str, object]) -> None:
    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        if why := balancer.unready_reason:
            return error_response(why, HTTPStatus.SERVICE_UNAVAILABLE)
        return JSONResponse({"status": "ready"})

    @app.get("/workers")
    async def workers() -> JSONResponse:
        return JSONResponse([r.view() for r in balancer.replicas])

    @app.api_route("/v1/{path:path}", methods=["GET", "POST"])
    async def proxy(path: str, request: Request) -> Response:
        http = state["http"]
        assert isinstance(http, httpx.AsyncClient)
        return await forward(balancer, http, request, f"/v1/{path}")


async def forward(balancer: Balancer, http: httpx.AsyncClient, request: Request, path: str) -> Response:
    """`request` on the least busy ready replica, its answer streamed back as it comes."""
    body = await request.body()
    headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROPPED_HEADERS}
    tried: set[str] = set()
    broken_off: httpx.HTTPError | None = None
    while (replica := balancer.pick(tried)) is not None:
        tried.add(replica.url)
        upstream = http.build_request(request.method, f"{replica.url}{path}", params=request.query_params,
                                      headers=headers, content=body)
        replica.in_flight += 1
        try:
            reply = await http.send(upstream, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # nothing reached it: another may take it
            replica.in_flight -= 1
            replica.ready = False
            logger.warning("replica %s unreachable (%r): trying another", replica.url, exc)
            continue
        except httpx.HTTPError as exc:  # it took the request and broke off (died?): another one answers it
            replica.in_flight -= 1
            replica.ready = False  # NOTE: until its next good probe
            broken_off = exc
            logger.warning("replica %s failed a request before answering (%r): trying another", replica.url, exc)
            continue
        except BaseException:
            replica.in_flight -= 1
            raise
        return StreamingResponse(_relay(replica, reply), status_code=reply.status_code,
                                 headers={k: v for k, v in reply.headers.items() if k.lower() not in _DROPPED_HEADERS})
    if broken_off is not None:
        return error_response("the replica serving this request failed before answering "
                              f"({type(broken_off).__name__})", HTTPStatus.BAD_GATEWAY)
    return error_response(balancer.unready_reason or "every ready replica refused the connection",
                          HTTPStatus.SERVICE_UNAVAILABLE)


async def _relay(replica: Replica, reply: httpx.Response) -> AsyncIterator[bytes]:
    try:
        async for chunk in reply.aiter_raw():
            yield chunk
    except httpx.HTTPError as exc:  # the replica died mid-answer: the client sees the stream end
        logger.warning("replica %s broke off an answer: %r", replica.url, exc)
    finally:
        replica.in_flight -= 1
        await reply.aclose()
