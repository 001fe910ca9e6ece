"""Every phase before the first token has a bound: the decode reservation's lease, the prefill
side's explicit failure message, and the router's first-token deadline. Each test ends with no
block held on any worker."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from helpers import random_prompt
from pd_fixtures import start_cluster, stop_cluster

from pdserve.disagg.decode_service import DecodeService

pytestmark = pytest.mark.slow  # every test starts a cluster

PROMPT = random_prompt(40, seed=7)


def test_a_reservation_whose_kv_never_comes_is_freed_by_its_lease(model_dirs: dict[str, Path]) -> None:
    """The prefill worker computes the prompt but never sends a byte of it, and its hand-off then
    times out on its side (which is not reported: decode's clocks decide). Without a lease the
    reservation would wait for ever; with it, the client gets an error and every block is free."""
    lease_s = 1.0
    cluster = start_cluster(model_dirs["tiny"], "fake", 1, 1, timeout_s=0.3, prefill_options={"stall_after_layers": 0},
                            worker_options={"reservation_lease_s": lease_s})
    try:
        with httpx.Client(base_url=cluster.router.url, timeout=30) as http:
            start = time.monotonic()
            reply = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
            elapsed = time.monotonic() - start
        assert reply.status_code == 503, reply.text
        assert "reservation lease" in reply.json()["error"]["message"]
        assert lease_s <= elapsed < lease_s + 5.0, elapsed
        decode: DecodeService = cluster.service(DecodeService)
        assert decode.stats().lease_expired == 1
        cluster.wait_until_idle()
        assert decode.num_in_flight == 0
    finally:
        stop_cluster(cluster)


def test_keepalives_extend_the_lease_of_a_reservation_nobody_streams(model_dirs: dict[str, Path]) -> None:
    """A reservation made straight on decode (a router that died before reading its stream): kept
    while a prefill worker says the attempt is being computed, freed a lease after that stops."""
    lease_s = 0.6
    cluster = start_cluster(model_dirs["tiny"], "fake", 1, 1, worker_options={"reservation_lease_s": lease_s})
    decode_url = cluster.workers[0][0].url
    decode: DecodeService = cluster.service(DecodeService)
    try:
        with httpx.Client(base_url=decode_url, timeout=30) as http:
            body = {"request_id": "orphan", "transfer_id": "orphan@0", "prompt_token_ids": PROMPT,
                    "params": {"fields": {"max_tokens": 4}}}
            assert http.post("/pd/reserve", json=body).status_code == 200
            for _ in range(8):  # 2.4 s, four leases: kept alive
                time.sleep(lease_s / 2)
                http.post("/pd/alive", json={"transfer_ids": ["orphan@0"]})
            assert decode.num_in_flight == 1 and cluster.leaks()
            assert decode.stats().lease_expired == 0
        cluster.wait_until_idle(timeout_s=lease_s + 3.0)
        assert decode.num_in_flight == 0 and decode.stats().lease_expired == 1
    finally:
        stop_cluster(cluster)
