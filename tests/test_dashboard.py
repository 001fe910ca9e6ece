"""The router's live page in headless Chromium: it loads, shows numbers that change while load
runs, and logs no console error. Also the JSON it polls, without a browser."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import random_prompt
from pd_fixtures import Cluster, start_cluster, stop_cluster
from server_fixtures import free_port, start_server

from pdserve.serving.dashboard import percentiles_ms

pytestmark = pytest.mark.slow  # a cluster, and headless Chromium

_LOAD_S = 60.0  # upper bound; the load stops as soon as the page has shown what the test wants


@pytest.fixture(scope="module")
def cluster(model_dirs: dict[str, Path]) -> Iterator[Cluster]:
    started = start_cluster(model_dirs["tiny"], "tcp", 1, 1)
    yield started
    stop_cluster(started)


class Load:
    """Requests one after another from a background thread until stopped."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.done = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        deadline = time.monotonic() + _LOAD_S
        with httpx.Client(base_url=self.base_url, timeout=60) as http:
            while not self._stop.is_set() and time.monotonic() < deadline:
                prompt = random_prompt(20 + self.done % 50, seed=self.done)
                reply = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "ignore_eos": True})
                if reply.status_code != 200:
                    self.failures.append(reply.text)
                self.done += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


def test_dashboard_data_aggregates_router_and_workers(cluster: Cluster) -> None:
    with httpx.Client(base_url=cluster.router.url, timeout=30) as http:
        before = http.get("/dashboard/data").json()
        reply = http.post("/v1/completions", json={"prompt": random_prompt(30, seed=8), "max_tokens": 5,
                                                   "ignore_eos": True})
        assert reply.status_code == 200, reply.text
        cluster.wait_until_idle()
        after = http.get("/dashboard/data").json()
        page = http.get("/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "<script src" not in page.text and "http://" not in page.text and "https://" not in page.text
    router = after["router"]
    assert router["finished_requests_total"] - before["router"]["finished_requests_total"] == 1
    assert router["generation_tokens_total"] - before["router"]["generation_tokens_total"] == 5
    assert router["ttft_ms"]["p50"] is not None and router["tpot_ms"]["p99"] is not None
    workers = {w["role"]: w for w in after["workers"]}
    assert set(workers) == {"prefill", "decode"} and all(w["reachable"] and w["ready"] for w in workers.values())
    assert after["ready_workers"] == {"prefill": 1, "decode": 1}
    assert workers["decode"]["kv_usage"] == 0.0  # idle again
    assert workers["decode"]["kv_transfer_bytes_total"] > before_bytes(before)
    assert workers["prefill"]["prefill_tokens_total"] >= 30


def before_bytes(data: dict[str, Any]) -> float:
    return next(w["kv_transfer_bytes_total"] for w in data["workers"] if w["role"] == "decode")


# Pixels of each role's colour (ROLE_COLORS in dashboard.html) in rows [top, bottom) of the replica chart.
_COLOURED_PIXELS = """((top, bottom) => {
  const canvas = document.getElementById("replicas");
  const data = canvas.getContext("2d").getImageData(0, top, canvas.width, bottom - top).data;
  const near = (i, rgb) => data[i + 3] > 100 && rgb.every((c, k) => Math.abs(data[i + k] - c) < 40);
  const counts = {prefill: 0, decode: 0};
  for (let i = 0; i < data.length; i += 4) {
    if (near(i, [204, 119, 51])) counts.prefill += 1;
    if (near(i, [51, 119, 170])) counts.decode += 1;
  }
  return counts;
})"""


def _check_tables(browser: Any) -> None:
    """After load: both workers listed ready, latencies shown, KV usage as a percentage."""
    rows = browser.evaluate("document.querySelectorAll('#workers tbody tr').length")
    assert rows == 2
    states = browser.evaluate("[...document.querySelectorAll('#workers tbody tr td:nth-child(3)')]"
                              ".map(td => td.textContent)")
    assert states == ["ready", "ready"]
    assert browser.evaluate("document.getElementById('ttft').textContent") != "– / – / –"
    kv = browser.evaluate("document.querySelector('#workers tbody tr:nth-child(2) td:nth-child(6)').textContent")
    assert kv.strip().endswith("%"), kv


def _check_replica_chart(browser: Any) -> None:
    """The ready workers per role, one point per poll, drawn as two lines (below the legend)."""
    assert browser.evaluate("document.getElementById('replicas-now').textContent") == "prefill 1 · decode 1"
    assert browser.evaluate("replicaHistory.length") >= 3
    assert browser.evaluate("replicaHistory.every(p => p.prefill === 1 && p.decode === 1)")
    # one worker each of a scale of 0..2: both lines near the middle row (66), nothing above or below
    middle = browser.evaluate(f"{_COLOURED_PIXELS}(60, 72)")
    assert middle["prefill"] > 20 and middle["decode"] > 20, middle
    for rows in ((20, 60), (72, 120)):
        assert browser.evaluate(f"{_COLOURED_PIXELS}{rows}") == {"prefill": 0, "decode": 0}, rows


def test_percentiles_are_nearest_rank() -> None:
    assert percentiles_ms([]) == {"p50": None, "p90": None, "p99": None}
    values = [i / 1000 for i in range(1, 101)]  # 1..100 ms
    assert percentiles_ms(values) == {"p50": 50.0, "p90": 90.0, "p99": 99.0}


def test_dashboard_in_headless_chromium(cluster: Cluster) -> None:
    from cdp import Browser, chromium_binary

    binary = chromium_binary()
    if binary is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium); CI installs it")
    browser = Browser(binary, free_port())
    load: Load | None = None
    try:
        browser.navigate(f"{cluster.router.url}/dashboard?interval=250")
        browser.pump(2.0)
        browser.evaluate("console.error('probe')")  # the capture itself works
        browser.pump(0.2)
        assert browser.errors == ["console: probe"], browser.errors
        browser.errors.clear()
        assert browser.evaluate("document.title") == "pdserve live"
        assert browser.evaluate("document.getElementById('status').className") == ""  # polled once at least

        def finished() -> int:
            text = browser.evaluate("document.getElementById('finished').textContent")
            return int(text) if text.isdigit() else -1

        start = finished()
        assert start >= 0
        load = Load(cluster.router.url)
        seen_tps: list[float] = []
        deadline = time.monotonic() + _LOAD_S
        while time.monotonic() < deadline:
            browser.pump(0.5)
            tps = browser.evaluate("document.getElementById('router-tps').textContent")
            if tps not in ("–", ""):
                seen_tps.append(float(tps))
            if finished() >= start + 3 and any(t > 0 for t in seen_tps):
                break
        load.stop()
        assert not load.failures, load.failures[:2]
        assert finished() >= start + 3, "the page's finished-request count did not follow the load"
        assert any(t > 0 for t in seen_tps), f"output tokens/s never moved: {seen_tps}"
        _check_tables(browser)
        _check_replica_chart(browser)
        browser.pump(0.5)
        assert browser.errors == [], browser.errors
    finally:
        if load is not None:
            load.stop()
        browser.close()
    cluster.wait_until_idle()


def test_the_colocated_server_has_the_dashboard_of_its_own_numbers(model_dirs: dict[str, Path]) -> None:
    """`pdserve serve` (issue 32): the same page, its one worker itself, from its own registry."""
    server = start_server(model_dirs["tiny"], "tiny-dashboard", dtype="float32", num_kv_blocks=128)
    try:
        with httpx.Client(base_url=server.base_url, timeout=30) as http:
            page = http.get("/dashboard")
            assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
            before = http.get("/dashboard/data").json()
            reply = http.post("/v1/completions", json={"prompt": random_prompt(30, seed=3), "max_tokens": 5,
                                                       "ignore_eos": True})
            assert reply.status_code == 200, reply.text
            server.wait_until_idle()
            after = http.get("/dashboard/data").json()
        assert after["router"]["finished_requests_total"] - before["router"]["finished_requests_total"] == 1
        assert after["router"]["generation_tokens_total"] - before["router"]["generation_tokens_total"] == 5
        assert after["router"]["ttft_ms"]["p50"] is not None
        (itself,) = after["workers"]
        assert itself["role"] == "colocated" and itself["url"] == server.base_url
        assert itself["reachable"] and itself["ready"] and itself["kv_usage"] == 0.0
        assert itself["generation_tokens_total"] - before["workers"][0]["generation_tokens_total"] == 5
        assert itself["prefill_tokens_total"] >= 30
        assert after["ready_workers"] == {"prefill": 0, "decode": 0, "colocated": 1}
    finally:
        server.stop()
