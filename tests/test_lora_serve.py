"""LoRA adapters on `pdserve serve` (colocated, the engine in its own process): the request's
`model` picks the adapter, concurrent requests under two adapters and the base model answer what
the offline engine does (itself equal to transformers + PEFT, tests/test_lora.py); /v1/models lists
the adapters with their parent; adapters are loaded and unloaded at run time with vLLM's routes,
bodies and status codes; bad adapters are refused by name and the server keeps serving;
vllm:lora_requests_info is exported."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import greedy, random_prompt, token_prompts
from lora_helpers import write_lora_models
from server_fixtures import ServerHandle, start_server

from pdserve import LLM, LoRARequest

pytestmark = pytest.mark.slow  # an engine process

MAX_TOKENS = 8
PROMPTS = [random_prompt(n, seed=4800 + n) for n in (6, 21, 40)]
ENGINE = {"dtype": "float32", "num_kv_blocks": 96, "max_num_batched_tokens": 32, "enable_lora": True,
          "max_lora_rank": 16, "max_loras": 2}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, Path]]]:
    return write_lora_models(tmp_path_factory.mktemp("lora-serve"))


@pytest.fixture(scope="module")
def server(models: dict[str, tuple[Path, dict[str, Path]]]) -> Iterator[ServerHandle]:
    model_dir, adapters = models["dense"]
    handle = start_server(model_dir, "base", **ENGINE, lora_modules=(f"sql={adapters['sql']}",))
    yield handle
    handle.stop()


def offline(model_dir: Path, adapters: dict[str, Path], batch: list[tuple[list[int], str | None]]
            ) -> list[tuple[str, list[float]]]:
    """(text, token logprobs) of each (prompt, adapter) from the offline engine."""
    llm = LLM(model=str(model_dir), **ENGINE)
    loras = [None if name is None else LoRARequest(name, 1, str(adapters[name])) for _, name in batch]
    outputs = llm.generate(token_prompts([p for p, _ in batch]), greedy(MAX_TOKENS, logprobs=0), lora_request=loras)
    result = []
    for output in outputs:
        seq = output.outputs[0]
        assert seq.logprobs is not None
        result.append((seq.text, [lp.logprob for lp in seq.logprobs]))
    return result


async def _complete(http: httpx.AsyncClient, model: str, prompt: list[int]) -> dict[str, Any]:
    response = await http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                         "temperature": 0.0, "ignore_eos": True, "logprobs": 1})
    assert response.status_code == 200, response.text
    return response.json()


def _served(server: ServerHandle, batch: list[tuple[list[int], str]]) -> list[tuple[str, list[float]]]:
    async def run() -> list[dict[str, Any]]:
        async with server.async_http() as http:
            return await asyncio.gather(*(_complete(http, model, prompt) for prompt, model in batch))

    answers = asyncio.run(run())
    return [(a["choices"][0]["text"], a["choices"][0]["logprobs"]["token_logprobs"]) for a in answers]


def _assert_same(served: list[tuple[str, list[float]]], expected: list[tuple[str, list[float]]]) -> None:
    for (text, logprobs), (want_text, want_logprobs) in zip(served, expected, strict=True):
        assert text == want_text
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) < 1e-4


def test_adapters_by_model_name_equal_offline_and_load_at_run_time(
        server: ServerHandle, models: dict[str, tuple[Path, dict[str, Path]]]) -> None:
    model_dir, adapters = models["dense"]
    http = server.http()
    cards = {card["id"]: card for card in http.get("/v1/models").json()["data"]}
    assert set(cards) == {"base", "sql"} and cards["sql"]["parent"] == "base" and cards["base"]["parent"] is None
    assert cards["sql"]["root"] == str(adapters["sql"])
    # not loaded yet: the model does not exist
    response = http.post("/v1/completions", json={"model": "chat", "prompt": PROMPTS[0], "max_tokens": 2})
    assert response.status_code == 404 and response.json()["error"]["param"] == "model"
    response = http.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": str(adapters["chat"])})
    assert response.status_code == 200 and response.text == "Success: LoRA adapter 'chat' added successfully."
    assert {card["id"] for card in http.get("/v1/models").json()["data"]} == {"base", "sql", "chat"}
    batch = [(PROMPTS[2], "base"), (PROMPTS[2], "sql"), (PROMPTS[2], "chat"), (PROMPTS[0], "chat"),
             (PROMPTS[1], "sql"), (PROMPTS[1], "base")]
    expected = offline(model_dir, adapters, [(p, None if m == "base" else m) for p, m in batch])
    assert expected[0][0] != expected[1][0] != expected[2][0]  # the adapters change the answer
    _assert_same(_served(server, batch), expected)
    server.wait_until_idle()
    metrics = http.get("/metrics").text
    [line] = [line for line in metrics.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert 'max_lora="2"' in line and 'running_lora_adapters=""' in line and float(line.rsplit(" ", 1)[1]) > 1e9
    response = http.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
    assert response.status_code == 200 and response.text == "Success: LoRA adapter 'chat' removed successfully."
    response = http.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
    assert response.status_code == 404 and "cannot be found" in response.json()["error"]["message"]
    chat = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
    response = http.post("/v1/chat/completions", json=chat)
    assert response.status_code == 404
    server.wait_until_idle()


def test_bad_adapters_are_refused_by_name_and_the_server_keeps_serving(
        server: ServerHandle, models: dict[str, tuple[Path, dict[str, Path]]], tmp_path: Path) -> None:
    _, adapters = models["dense"]
    http = server.http()
    big = tmp_path / "big"
    big.mkdir()
    for file in adapters["chat"].iterdir():
        (big / file.name).write_bytes(file.read_bytes())
    config = json.loads((big / "adapter_config.json").read_text())
    (big / "adapter_config.json").write_text(json.dumps({**config, "r": 64}))
    cases = [({"lora_name": "big", "lora_path": str(big)}, 400, "'big'"),
             ({"lora_name": "nowhere", "lora_path": str(tmp_path / "none")}, 400, "'nowhere'"),
             ({"lora_name": "sql", "lora_path": str(adapters["sql"])}, 400, "has already been loaded"),
             ({"lora_name": "x"}, 400, "Both 'lora_name' and 'lora_path' must be provided")]
    for body, status, message in cases:
        response = http.post("/v1/load_lora_adapter", json=body)
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert message in error["message"] and error["type"] == "invalid_request_error"
    assert {card["id"] for card in http.get("/v1/models").json()["data"]} == {"base", "sql"}
    response = http.post("/v1/unload_lora_adapter", json={"lora_name": "big"})
    assert response.status_code == 404
    answer = http.post("/v1/completions", json={"model": "sql", "prompt": PROMPTS[0], "max_tokens": 2})
    assert answer.status_code == 200 and answer.json()["model"] == "sql"  # the model asked for, as vLLM
    server.wait_until_idle()
