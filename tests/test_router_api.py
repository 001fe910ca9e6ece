"""The PD router's client API (issue 16, items 5 and 7): its key guards /v1/*, /workers,
/router/stats and /dashboard but not the probes nor the workers' /pd/* plane. (Logprobs and n > 1
through the router: tests/test_openai_parity.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from pd_fixtures import Cluster, start_cluster, stop_cluster

from pdserve.serving.config import ApiConfig

pytestmark = pytest.mark.slow  # a cluster

KEY = "router-key"


@pytest.fixture(scope="module")
def cluster(model_dirs: dict[str, Path]) -> Iterator[Cluster]:
    started = start_cluster(model_dirs["tiny"], "tcp", 1, 1, api=ApiConfig(api_key=(KEY,), max_stop_strings=2))
    yield started
    stop_cluster(started)


@pytest.fixture
def http(cluster: Cluster) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=cluster.router.url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as client:
        yield client
    cluster.wait_until_idle()


def assert_envelope(response: httpx.Response, status: int) -> dict[str, object]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status, error
    return dict(error)


ROUTES = [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
          ("GET", "/workers"), ("GET", "/router/stats"), ("GET", "/dashboard"), ("GET", "/dashboard/data")]


def test_the_routers_client_routes_need_the_key(cluster: Cluster, http: httpx.Client) -> None:
    with httpx.Client(base_url=cluster.router.url, timeout=30) as anonymous:
        for method, path in ROUTES:
            error = assert_envelope(anonymous.request(method, path, json={"prompt": "Hi"}), 401)
            assert error["type"] == "authentication_error", (path, error)
        for path in ("/health", "/ready", "/metrics"):
            assert anonymous.get(path).status_code == 200, path
        # NOTE: the workers' plane is not the clients': no client key there (the cluster secret's job)
        assert anonymous.post("/pd/register", json={"role": "decode", "url": "http://127.0.0.1:1"}).status_code == 403
    for method, path in ROUTES[3:]:
        assert http.request(method, path).status_code == 200, path
    reply = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "ignore_eos": True})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2, reply.text


def test_the_routers_caps_apply_before_tokenizing(http: httpx.Client) -> None:
    error = assert_envelope(http.post("/v1/completions", json={"prompt": "Hi", "stop": ["a", "b", "c"]}), 400)
    assert error["param"] == "stop"
    assert "surrogate" in str(assert_envelope(http.post("/v1/completions", content=b'{"prompt": "\\ud800"}',
                                                        headers={"Content-Type": "application/json"}),
                                              400)["message"])
