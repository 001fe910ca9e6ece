"""A worker's /pd/* routes answer an unexpected failure in the error envelope (a 500 with the
request id), never a plain-text 500, and the worker goes on serving."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from pd_fixtures import start_cluster, stop_cluster

from pdserve.disagg.worker.decode_service import DecodeService


def test_an_unexpected_failure_in_a_worker_route_is_an_enveloped_500(model_dirs: dict[str, Path],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = start_cluster(model_dirs["tiny"], "tcp", 1, 1)
    try:
        decode = cluster.service(DecodeService)
        url = next(served.url for served, client in cluster.workers if client is decode.client)

        async def broken(*_: object) -> int:
            raise RuntimeError("a bug")

        monkeypatch.setattr(decode, "cached_prefix_tokens", broken)
        reply = httpx.post(f"{url}/pd/prefix", json={"prompt_token_ids": [1, 2, 3]}, timeout=10)
        assert reply.status_code == 500
        error = reply.json()["error"]
        assert error["code"] == 500 and "internal server error" in error["message"]
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    finally:
        stop_cluster(cluster)
