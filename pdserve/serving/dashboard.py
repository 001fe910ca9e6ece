"""The live page: `GET /dashboard` (one self-contained HTML file, no external resources) polls
`GET /dashboard/data`, which this module assembles from the server's own metrics and, on the
router, each worker's `/metrics` (scraped on demand, 1 s timeout each, so a dead worker shows as
unreachable instead of stalling the page), and the ready workers per role as the router's pool
sees them (the page charts them over time: the pool growing and shrinking). A colocated server
lists itself as its one worker, from its own registry. Rates (tokens/s, bytes/s) are computed by
the page from successive counter readings.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.serving.metrics import ServerMetrics
from pdserve.serving.router_stats import RouterState, WorkerView

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


async def _scrape(http: httpx.AsyncClient, worker: WorkerView) -> dict[str, Any]:
    """One worker's dashboard entry, from its /metrics (unreachable: role, url and readiness only)."""
    entry = {"role": worker.role, "url": worker.url, "ready": worker.ready, "reachable": False}
    try:
        reply = await http.get(f"{worker.url}/metrics")
        reply.raise_for_status()
    except httpx.HTTPError:
        return entry
    return entry | {"reachable": True} | parse_worker_metrics(reply.text)


def _itself(metrics: ServerMetrics, request: Request) -> dict[str, Any]:
    """A colocated server's one worker entry: itself."""
    return {"role": metrics.role, "url": str(request.base_url).rstrip("/"), "ready": True, "reachable": True,
            **parse_worker_metrics(generate_latest(metrics.registry).decode())}


def _router_summary(metrics: ServerMetrics) -> dict[str, Any]:
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


def install_dashboard(app: FastAPI, metrics: ServerMetrics, router: RouterState | None) -> None:
    """`router` lists the pool (`workers()`); None: a colocated server, its own one worker."""

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
        if router is None:
            workers, ready = [_itself(metrics, request)], {"prefill": 0, "decode": 0, metrics.role: 1}
        else:
            views = router.workers()
            workers = list(await asyncio.gather(*(_scrape(scrape_client(), w) for w in views)))
            ready = {role: sum(1 for w in views if w.role == role and w.ready) for role in ("prefill", "decode")}
        return {
            "time": time.time(),
            "model": metrics.model_name,
            "router": _router_summary(metrics),
            "workers": workers,
            "ready_workers": ready,
        }
