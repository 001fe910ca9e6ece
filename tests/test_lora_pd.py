"""LoRA adapters through the PD path (router, prefill and decode workers in process over tcp and
nixl, and `pdserve up` as processes): a batch of concurrent requests mixing two adapters and the
base model answers what the offline engine does (itself equal to transformers + PEFT:
tests/test_lora.py), dense and MoE (attention targets); adapters loaded and unloaded through the
router land on every worker of both roles; a worker that lacks an adapter gets it before a request
under it runs; decode refuses KV computed under another version of an adapter, by name."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import greedy, random_prompt, token_prompts
from lora_helpers import write_lora_models
from pd_fixtures import MODEL, Cluster, start_cluster, stop_cluster
from test_up import pdserve_up

from pdserve import LLM, LoRARequest
from pdserve.disagg.transport import nixl_available

pytestmark = pytest.mark.slow  # clusters

MAX_TOKENS = 6
PROMPTS = [random_prompt(n, seed=4900 + n) for n in (7, 20, 38)]
LORA = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 16}
_NO_NIXL = pytest.mark.skipif(not nixl_available(), reason="nixl_cu12 is not installed")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, Path]]]:
    return write_lora_models(tmp_path_factory.mktemp("lora-pd"))


def _cluster(model_dir: Path, transport: str, modules: tuple[str, ...], **options: Any) -> Cluster:
    engine = LORA | {"lora_modules": modules}
    return start_cluster(model_dir, transport, 1, 1, max_num_batched_tokens=32, enable_lora=True,
                         engine_options={"prefill": engine, "decode": engine}, **options)


def _offline(model_dir: Path, adapters: dict[str, Path], batch: list[tuple[list[int], str]]) -> list[str]:
    llm = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=32, **LORA)
    loras = [None if model == MODEL else LoRARequest(model, 1, str(adapters[model])) for _, model in batch]
    outputs = llm.generate(token_prompts([p for p, _ in batch]), greedy(MAX_TOKENS), lora_request=loras)
    return [output.outputs[0].text for output in outputs]


def _served(url: str, batch: list[tuple[list[int], str]]) -> list[httpx.Response]:
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json={
                "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
                for prompt, model in batch))

    return asyncio.run(run())


def _worker_adapters(cluster: Cluster) -> list[set[str]]:
    return [{a["name"] for a in httpx.get(served.url + "/v1/lora_adapters").json()["data"]}
            for served, _ in cluster.workers]


@pytest.fixture
def cleanup() -> Iterator[list[Cluster]]:
    clusters: list[Cluster] = []
    yield clusters
    for cluster in clusters:
        stop_cluster(cluster)


@pytest.mark.parametrize(("transport", "kind"), [("tcp", "dense"), ("tcp", "moe"),
                                                 pytest.param("nixl", "dense", marks=_NO_NIXL)])
def test_mixed_adapters_through_pd_equal_offline_and_load_through_the_router(
        transport: str, kind: str, models: dict[str, tuple[Path, dict[str, Path]]], cleanup: list[Cluster]) -> None:
    model_dir, adapters = models[kind]
    cluster = _cluster(model_dir, transport, (f"sql={adapters['sql']}",))
    cleanup.append(cluster)
    http = httpx.Client(base_url=cluster.router.url, timeout=60)
    cards = {card["id"]: card for card in http.get("/v1/models").json()["data"]}
    assert set(cards) == {MODEL, "sql"} and cards["sql"]["parent"] == MODEL and cards[MODEL]["parent"] is None
    base = MODEL
    # loaded through the router: on every worker of both roles
    response = http.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": str(adapters["chat"])})
    assert response.status_code == 200, response.text
    assert _worker_adapters(cluster) == [{"sql", "chat"}] * 2
    batch = [(PROMPTS[2], base), (PROMPTS[2], "sql"), (PROMPTS[2], "chat"), (PROMPTS[0], "chat"),
             (PROMPTS[1], "sql"), (PROMPTS[1], base)]
    expected = _offline(model_dir, adapters, batch)
    assert len({expected[0], expected[1], expected[2]}) == 3  # the adapters change the answer
    responses = _served(cluster.router.url, batch)
    assert [r.status_code for r in responses] == [200] * len(batch), [r.text for r in responses]
    assert [r.json()["choices"][0]["text"] for r in responses] == expected
    cluster.wait_until_idle()
    for url in (cluster.router.url, *(served.url for served, _ in cluster.workers)):  # every role exports it
        [line] = [x for x in httpx.get(url + "/metrics").text.splitlines() if x.startswith("vllm:lora_requests_info{")]
        assert 'max_lora="2"' in line, line
    # unloaded through the router: from every worker; a second time is a 404
    response = http.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
    assert response.status_code == 200, response.text
    assert _worker_adapters(cluster) == [{"sql"}] * 2
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "chat"}).status_code == 404
    response = http.post("/v1/completions", json={"model": "chat", "prompt": PROMPTS[0], "max_tokens": 2})
    assert response.status_code == 404
    # a bad adapter is refused by every worker and left nowhere
    response = http.post("/v1/load_lora_adapter", json={"lora_name": "gone", "lora_path": "/nonexistent"})
    assert response.status_code == 400 and "'gone'" in response.json()["error"]["message"]
    assert _worker_adapters(cluster) == [{"sql"}] * 2


def test_a_worker_missing_an_adapter_gets_it_and_decode_refuses_another_version(
        models: dict[str, tuple[Path, dict[str, Path]]], cleanup: list[Cluster]) -> None:
    model_dir, adapters = models["dense"]
    cluster = _cluster(model_dir, "tcp", (), policy="fail")
    cleanup.append(cluster)
    decode_url, prefill_url = (served.url for served, _ in cluster.workers)
    # only decode has "sql": the first request for it has the router ask its workers, and load it on
    # prefill before the request runs there
    assert httpx.post(decode_url + "/v1/load_lora_adapter",
                      json={"lora_name": "sql", "lora_path": str(adapters["sql"])}).status_code == 200
    [response] = _served(cluster.router.url, [(PROMPTS[0], "sql")])
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == _offline(model_dir, adapters, [(PROMPTS[0], "sql")])[0]
    assert _worker_adapters(cluster) == [{"sql"}] * 2
    # "mix" is one adapter on prefill and another on decode: decode refuses prefill's KV by name
    for url, name in ((prefill_url, "sql"), (decode_url, "chat")):
        assert httpx.post(url + "/v1/load_lora_adapter",
                          json={"lora_name": "mix", "lora_path": str(adapters[name])}).status_code == 200
    response = httpx.post(cluster.router.url + "/v1/completions", timeout=60, json={
        "model": "mix", "prompt": PROMPTS[1], "max_tokens": 3, "temperature": 0, "ignore_eos": True})
    assert response.status_code >= 500, response.text
    assert "LoRA adapter 'mix' differs between the prefill worker" in response.json()["error"]["message"]
    cluster.wait_until_idle()


def test_through_pdserve_up(models: dict[str, tuple[Path, dict[str, Path]]], tmp_path: Path) -> None:
    """`pdserve up --enable-lora --lora-modules ...`: the router and every worker as processes, the
    LoRA flags passed on to the workers; mixed adapters equal the offline engine; load and unload
    through the router."""
    model_dir, adapters = models["dense"]
    flags = ["--enable-lora", "--lora-modules", f"sql={adapters['sql']}", "--max-loras", "2", "--max-lora-rank", "16"]
    with pdserve_up(model_dir, tmp_path, *flags) as up, httpx.Client(base_url=up.url, timeout=120) as http:
        deadline = time.monotonic() + 30
        while "sql" not in {card["id"] for card in http.get("/v1/models").json()["data"]}:
            assert time.monotonic() < deadline, "the router never listed the workers' adapter"
            time.sleep(0.2)
        response = http.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": str(adapters["chat"])})
        assert response.status_code == 200, response.text
        base = next(card["id"] for card in http.get("/v1/models").json()["data"] if card["parent"] is None)
        batch = [(PROMPTS[2], base), (PROMPTS[2], "sql"), (PROMPTS[2], "chat"), (PROMPTS[0], "chat")]
        expected = _offline(model_dir, adapters, [(p, MODEL if m == base else m) for p, m in batch])
        responses = _served(up.url, batch)
        assert [r.json()["choices"][0]["text"] for r in responses] == expected
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "chat"}).status_code == 200
        assert http.post("/v1/completions", json={"model": "chat", "prompt": PROMPTS[0]}).status_code == 404
