"""The Qwen3 family and structured outputs through `pdserve up` (issues 31 and 32): router, prefill
and decode as processes, over tcp and nixl, against the offline engine on the same checkpoint.

One checkpoint carries everything at once: a tiny Qwen3-MoE (a dense layer among sparse ones,
top-2, GQA) with YaRN rope over an original window of 64 positions (prompts and generations run
past it), stored in block FP8 (24 x 24 blocks, partial edge blocks). The offline engine on it is
checked against transformers in tests/test_qwen3_family.py; here PD must give its text exactly,
greedy, for plain and JSON-schema-constrained requests, with the KV cache in float32 (tcp) and in
FP8 on both roles (nixl; the offline reference then uses an FP8 pool with the same scales), and
with every worker's model over two tensor-parallel ranks (tcp)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from helpers import random_prompt
from test_up import pdserve_up

from pdserve import LLM, SamplingParams
from pdserve.disagg.transport import nixl_available
from pdserve.engine.structured import StructuredOutput
from pdserve.model.demo_checkpoint import PRESETS, ModelVariant, quantize_checkpoint, write_checkpoint

pytestmark = pytest.mark.slow  # the whole cluster as processes, through the CLI

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
PROMPTS = [random_prompt(n, seed=7300 + n) for n in (5, 90)]  # 90 + 16: past the original 64 positions
MAX_TOKENS = 16
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                   "tag": {"enum": ["a", "b", "c"]}},
    "required": ["id", "tag"], "additionalProperties": False}
SCHEMA_MAX_TOKENS = 60  # the schema completes within ~15 tokens


@pytest.fixture(scope="module")
def family_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("up-family")
    shape = dataclasses.replace(PRESETS["tiny-moe"], max_position_embeddings=256)
    dense = write_checkpoint(root / "moe-yarn", shape, seed=21, variant=ModelVariant(rope_scaling=YARN))
    return quantize_checkpoint(dense, root / "moe-yarn-fp8", (24, 24))


def _offline(model: Path, kv_cache_dtype: str) -> tuple[list[str], str]:
    """Greedy texts of PROMPTS and the JSON-schema-constrained text of PROMPTS[0], offline, one
    prompt at a time in 32-token chunks as the prefill worker computes them: in an FP8 pool a chunk
    attends to its own K/V as computed and to earlier chunks' as stored, so the chunking shows."""
    llm = LLM(model=str(model), dtype="float32", kv_cache_dtype=kv_cache_dtype, num_kv_blocks=128,
              max_num_batched_tokens=32, enable_prefix_caching=False)
    try:
        plain = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        texts = [llm.generate([{"prompt_token_ids": p}], plain)[0].outputs[0].text for p in PROMPTS]
        constrained = SamplingParams(temperature=0, max_tokens=SCHEMA_MAX_TOKENS,
                                     structured=StructuredOutput("json", json.dumps(SCHEMA)))
        (out,) = llm.generate([{"prompt_token_ids": PROMPTS[0]}], constrained)
        return texts, out.outputs[0].text
    finally:
        del llm


@pytest.fixture(scope="module")
def offline(family_model: Path) -> dict[str, tuple[list[str], str]]:
    return {kv: _offline(family_model, kv) for kv in ("auto", "fp8")}


@pytest.mark.parametrize(("transport", "kv_cache_dtype", "tp"), [
    ("tcp", "auto", 1),
    pytest.param("nixl", "fp8", 1, marks=pytest.mark.skipif(not nixl_available(), reason="nixl_cu12 is not installed")),
    ("tcp", "auto", 2),  # every worker's experts split over two ranks
])
def test_moe_yarn_fp8_model_through_pdserve_up_answers_as_offline(
        family_model: Path, offline: dict[str, tuple[list[str], str]], tmp_path: Path, transport: str,
        kv_cache_dtype: str, tp: int) -> None:
    texts, constrained = offline[kv_cache_dtype]
    jsonschema.validate(json.loads(constrained), SCHEMA)  # the reference itself is valid
    # NOTE: no prefix caching: a repeated prompt's uncached tail would be a chunk of its own (see _offline)
    flags = ["--kv-transport", transport, "--kv-cache-dtype", kv_cache_dtype, "--no-enable-prefix-caching",
             "--tensor-parallel-size", str(tp)]
    with pdserve_up(family_model, tmp_path, *flags) as up, \
            httpx.Client(base_url=up.url, timeout=120) as http:
        for prompt, text in zip(PROMPTS, texts, strict=True):
            for stream in (False, True):
                body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                        "stream": stream}
                assert _completion(http, body) == text, (transport, stream)
        for stream in (False, True):
            body = {"prompt": PROMPTS[0], "max_tokens": SCHEMA_MAX_TOKENS, "temperature": 0, "stream": stream,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}}
            got = _completion(http, body)
            jsonschema.validate(json.loads(got), SCHEMA)
            assert got == constrained, (transport, stream)
        assert "float8" in up.text() if kv_cache_dtype == "fp8" else "float8" not in up.text()


def _completion(http: httpx.Client, body: dict[str, Any]) -> str:
    if not body["stream"]:
        reply = http.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        return str(reply.json()["choices"][0]["text"])
    text = []
    with http.stream("POST", "/v1/completions", json=body) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[len("data: "):])
                assert "error" not in chunk, chunk
                text += [choice["text"] for choice in chunk["choices"]]
    return "".join(text)
