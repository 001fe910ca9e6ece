"""The live page: `GET /dashboard` (one self-contained HTML file, no external resources) polls
`GET /dashboard/data`, which this module assembles from the server's own metrics and, on a server
in front of a pool (the PD router: disagg/router/metrics.py), each member's `/metrics` (scraped on
demand, 1 s timeout each, so a dead member shows as unreachable instead of stalling the page), and
the ready members per role as the pool's owner sees them (the page charts them over time: the pool
growing and shrinking). A colocated server lists itself as its one worker, from its own registry.
Rates (tokens/s, bytes/s) are computed by the page from successive counter readings.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.serving.metrics import ServerMetrics

_PAGE = Path(__file__).with_name("dashboard.html")
_SCRAPE_TIMEOUT_S = 1.0
# Worker series the page shows: sample name -> key in the JSON (summed over label sets).
_WORKER_SERIES = {
    "vllm:num_requests_running": "num_running",
    "vllm:num_requests_waiting": "num_waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:prompt_tokens_total": "prompt_tokens_total",
    "vllm:generation_tokens_total": "generation_tokens_total",
    "pdserve:prefill_tokens_total": "prefill_tokens_total",
    "pdserve:kv_transfer_bytes_total": "kv_transfer_bytes_total",
    "pdserve:kv_transfer_timeouts_total": "kv_transfer_timeouts_total",
    "vllm:num_preemptions_total": "num_preemptions_total",
}
_CHARTED_ROLES = ("prefill", "decode")  # the page's ready-workers chart (dashboard.html: ROLE_COLORS)


@dataclass(frozen=True, slots=True)
class PoolMember:
    """One server of the pool behind this one, as the page lists it; its numbers are scraped."""

    role: str
    url: str
    ready: bool  # as the pool's owner sees it (answers and takes work)


Pool = Callable[[], Sequence[PoolMember]]  # the members now; called on the event loop at every poll


def percentiles_ms(values: list[float]) -> dict[str, float | None]:
    """Nearest-rank P50/P90/P99 of recent latencies, in milliseconds."""
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    ordered = sorted(values)

    def rank(q: float) -> float:
        return round(1000 * ordered[min(len(ordered) - 1, max(0, int(q * len(ordered) + 0.999999) - 1))], 3)

    return {"p50": rank(0.5), "p90": rank(0.9), "p99": rank(0.99)}


def parse_worker_metrics(text: str) -> dict[str, float]:
    values = dict.fromkeys(_WORKER_SERIES.values(), 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = _WORKER_SERIES.get(sample.name)
            if key is not None:
                values[key] += sample.value
    return values


async def _scrape(http: httpx.AsyncClient, member: PoolMember) -> dict[str, Any]:
    """One member's dashboard entry, from its /metrics (unreachable: role, url and readiness only)."""
    entry = {"role": member.role, "url": member.url, "ready": member.ready, "reachable": False}
    try:
        reply = await http.get(f"{member.url}/metrics")
        reply.raise_for_status()
    except httpx.HTTPError:
        return entry
    return entry | {"reachable": True} | parse_worker_metrics(reply.text)


def _itself(metrics: ServerMetrics, request: Request) -> dict[str, Any]:
    """A colocated server's one worker entry: itself."""
    return {"role": metrics.role, "url": str(request.base_url).rstrip("/"), "ready": True, "reachable": True,
            **parse_worker_metrics(generate_latest(metrics.registry).decode())}


def _own_summary(metrics: ServerMetrics) -> dict[str, Any]:
    """The serving process's own numbers (the router's, or a colocated server's)."""

    def value(name: str) -> float:
        return metrics.registry.get_sample_value(name, metrics.labels) or 0.0

    return {
        "num_running": value("vllm:num_requests_running"),
        "num_waiting": value("vllm:num_requests_waiting"),
        "prompt_tokens_total": value("vllm:prompt_tokens_total"),
        "generation_tokens_total": value("vllm:generation_tokens_total"),
        "finished_requests_total": value("vllm:e2e_request_latency_seconds_count"),
        "ttft_ms": percentiles_ms(list(metrics.recent_ttft_s)),
        "tpot_ms": percentiles_ms(list(metrics.recent_tpot_s)),
    }


def install_dashboard(app: FastAPI, metrics: ServerMetrics, pool: Pool | None) -> None:
    """`pool` lists the members to scrape; None: a colocated server, its own one worker."""

    clients: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}  # made on the first poll

    def scrape_client() -> httpx.AsyncClient:
        # NOTE: one for the router's life (per event loop: its pooled connections belong to one):
        # building an httpx client (its TLS context) blocks the event loop, and with it every
        # request the router serves, for 50-200 ms.
        loop = asyncio.get_running_loop()
        if loop not in clients:
            clients.clear()
            clients[loop] = httpx.AsyncClient(timeout=_SCRAPE_TIMEOUT_S)
        return clients[loop]

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(_PAGE.read_text(encoding="utf-8"))

    @app.get("/dashboard/data", include_in_schema=False)
    async def dashboard_data(request: Request) -> dict[str, Any]:
        if pool is None:
            workers = [_itself(metrics, request)]
        else:
            workers = list(await asyncio.gather(*(_scrape(scrape_client(), m) for m in pool())))
        return {
            "time": time.time(),
            "model": metrics.model_name,
            "router": _own_summary(metrics),  # NOTE: the key the page reads, whatever this server is
            "workers": workers,
            "ready_workers": _ready_per_role(workers),
        }


def _ready_per_role(workers: list[dict[str, Any]]) -> dict[str, int]:
    """The charted roles always (0 when none), and any other role with a ready member."""
    ready = dict.fromkeys(_CHARTED_ROLES, 0)
    for worker in workers:
        if worker["ready"]:
            ready[worker["role"]] = ready.get(worker["role"], 0) + 1
    return ready
