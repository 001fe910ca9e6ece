"""Through the router against colocated: usage.prompt_tokens_details.cached_tokens on PD is the
prompt tokens neither worker computed for the request, i.e. the longer of decode's prefix hit (not
sent) and prefill's (not recomputed), the same number colocated reports for the same sequence of
requests; `echo` is served the same (with logprobs: tests/test_openai_parity.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from helpers import random_prompt
from pd_fixtures import MODEL, Cluster, start_cluster, stop_cluster
from server_fixtures import ServerHandle, start_server

from pdserve.disagg import wire
from pdserve.disagg.handoff import HandOffDone, HandOffError

SHARED = random_prompt(40, seed=11)  # two whole 16-token blocks and a part
LONGER = SHARED + random_prompt(30, seed=12)


@pytest.fixture(scope="module")
def servers(model_dirs: dict[str, Path]) -> Iterator[tuple[ServerHandle, Cluster]]:
    colocated = start_server(model_dirs["tiny"], MODEL, dtype="float32", num_kv_blocks=256)
    # round-robin over two decode workers: SHARED lands on decode 0, LONGER first on decode 1
    # (only prefill holds the shared prefix), then on decode 0 (both hold part of it)
    cluster = start_cluster(model_dirs["tiny"], "tcp", 1, 2, decode_policy="round-robin")
    yield colocated, cluster
    stop_cluster(cluster)
    colocated.stop()


def cached_tokens(client: openai.OpenAI, prompt: list[int]) -> int:
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    return reply.usage.prompt_tokens_details.cached_tokens or 0


@pytest.mark.slow  # a server and a cluster
def test_cached_tokens_on_pd_count_prefill_hits_once_like_colocated(servers: tuple[ServerHandle, Cluster]) -> None:
    colocated, cluster = servers
    colocated_client, router = (openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
                                for url in (colocated.base_url, cluster.router.url))
    expected = [cached_tokens(colocated_client, p) for p in (SHARED, LONGER, LONGER)]
    assert expected[0] == 0 and 0 < expected[1] < expected[2]  # 32 of SHARED, then 64 of LONGER
    got = [cached_tokens(router, p) for p in (SHARED, LONGER)]
    decode0, decode1 = (cluster.workers[i][1].engine for i in (0, 1))
    assert decode1.num_cached_prefix_tokens(SHARED) == 32 and decode0.num_cached_prefix_tokens(LONGER) == 32
    got.append(cached_tokens(router, LONGER))  # decode 0's 32 and prefill's 64 overlap: 64, not 96
    assert got == expected
    colocated.wait_until_idle()
    cluster.wait_until_idle()


@pytest.mark.slow
def test_router_echoes_like_colocated(servers: tuple[ServerHandle, Cluster]) -> None:
    colocated, cluster = servers
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 3, "temperature": 0, "echo": True}
    texts = [httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
             for url in (colocated.base_url, cluster.router.url)]
    assert texts[0] == texts[1] and texts[0].startswith("The quick brown fox") and texts[0] != body["prompt"]
    cluster.wait_until_idle()


def test_a_hand_off_record_without_prefill_cached_tokens_parses_as_zero() -> None:
    done = HandOffDone(7, prefill_cached_tokens=48)
    assert HandOffDone.decode(done.encode()) == done
    old = wire.to_json_obj(done)
    del old["prefill_cached_tokens"]
    assert HandOffDone.decode(json.dumps(old).encode()).prefill_cached_tokens == 0
    del old["first_token_id"]  # a field without a default is still required
    with pytest.raises(HandOffError, match="expected keys"):
        HandOffDone.decode(json.dumps(old).encode())
