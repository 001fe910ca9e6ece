"""Prefix-aware decode routing from KV-cache events against the router's default, in one run: the same
shared-prefix workload through a `pdserve up` cluster (1 prefill + 2 decode workers, tiny demo model)
with `--decode-policy least-loaded`, then `kv-events` (then `prefix-affinity`, which asks every worker
per request), each cluster started fresh with the same flags.

Workload: `--groups` system prompts of `--prefix-tokens` tokens, each request one of them plus a
unique suffix, groups interleaved at random (seeded). Each decode worker's pool holds about
`--groups-per-pool` groups, fewer than there are: a worker that sees every group keeps evicting
them. With `--pd-threshold` above the suffix, a decode worker that caches the prefix prefills the
rest itself (no prefill trip, no KV transfer), so where a request lands decides its TTFT.

Prefix hit rate: the decode workers' `vllm:prefix_cache_hits` / `vllm:prefix_cache_queries` over the
measured requests (tokens). TTFT: as the client saw it (streamed), mean and p90.

    python -m pdserve.bench.kv_events_routing [--groups 8] [--requests 64] [--concurrency 2] \
        [--policies least-loaded,kv-events,prefix-affinity]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from pdserve.bench.common import hardware_line, print_table
from pdserve.bench.serve.local import free_port, pd_args, running

_BLOCK = 16
_EVENTS = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"}'
_METRIC = re.compile(r"^(vllm:prefix_cache_(?:hits|queries))_total(?:\{[^}]*\})? ([0-9.e+]+)$", re.M)


def workload(groups: int, prefix_tokens: int, suffix_tokens: int, requests: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(100, 150_000) for _ in range(prefix_tokens)] for _ in range(groups)]
    order = [g for g in range(groups) for _ in range(requests // groups)]
    rng.shuffle(order)
    return [prefixes[g] + [rng.randrange(100, 150_000) for _ in range(suffix_tokens)] for g in order]


async def _prefix_counters(http: httpx.AsyncClient, router: str) -> tuple[float, float]:
    """(hit tokens, queried tokens) summed over the decode workers."""
    workers = (await http.get(f"{router}/workers")).json()
    hits = queries = 0.0
    for worker in workers:
        if worker["role"] != "decode":
            continue
        text = (await http.get(f"{worker['url']}/metrics")).text
        for name, value in _METRIC.findall(text):
            if name.endswith("hits"):
                hits += float(value)
            else:
                queries += float(value)
    return hits, queries


async def _one(http: httpx.AsyncClient, router: str, model: str, prompt: list[int]) -> float:
    start = time.perf_counter()
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True}
    async with http.stream("POST", f"{router}/v1/completions", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                return time.perf_counter() - start
    raise RuntimeError("no token streamed")


async def _measure(router: str, prompts: list[list[int]], concurrency: int) -> tuple[float, list[float]]:
    async with httpx.AsyncClient(timeout=120) as http:
        models = (await http.get(f"{router}/v1/models")).json()["data"]
        name = models[0]["id"]
        hits0, queries0 = await _prefix_counters(http, router)
        queue = list(enumerate(prompts))
        ttfts = [0.0] * len(prompts)

        async def client() -> None:
            while queue:
                at, prompt = queue.pop(0)
                ttfts[at] = await _one(http, router, name, prompt)

        await asyncio.gather(*(client() for _ in range(concurrency)))
        await asyncio.sleep(1.0)  # NOTE: the workers' stats reach their /metrics every few ms; a margin
        hits1, queries1 = await _prefix_counters(http, router)
    return (hits1 - hits0) / max(1.0, queries1 - queries0), ttfts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--groups-per-pool", type=float, default=7.0)
    parser.add_argument("--prefix-tokens", type=int, default=256)
    parser.add_argument("--suffix-tokens", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--pd-threshold", type=int, default=64)
    parser.add_argument("--policies", default="least-loaded,kv-events,prefix-affinity")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    prompts = workload(args.groups, args.prefix_tokens, args.suffix_tokens, args.requests, args.seed)
    blocks_per_group = -(-(args.prefix_tokens + args.suffix_tokens + 4) // _BLOCK)
    num_blocks = int(args.groups_per_pool * blocks_per_group)
    engine = ["--num-kv-blocks", str(num_blocks), "--block-size", str(_BLOCK), "--kv-events-config", _EVENTS,
              "--pd-threshold", str(args.pd_threshold), "--max-model-len", "2048"]
    rows = []
    log_dir = Path(tempfile.mkdtemp(prefix="pdserve-kv-events-routing-"))
    for policy in args.policies.split(","):
        port = free_port()
        cli = pd_args(port, 1, 2, 1, [*engine, "--decode-policy", policy])
        with running(policy, cli, port, log_dir, ready_timeout_s=180) as server:
            hit_rate, ttfts = asyncio.run(_measure(server.url, prompts, args.concurrency))
        ttfts.sort()
        rows.append([policy, f"{hit_rate:.1%}", f"{statistics.mean(ttfts) * 1e3:.0f}",
                     f"{ttfts[int(0.9 * (len(ttfts) - 1))] * 1e3:.0f}"])
    print(f"hardware: {hardware_line()} (shared machine: compare rows, not absolute times)")
    print(f"workload: tiny demo model, 1 prefill + 2 decode workers (`pdserve up`), {args.requests} requests in "
          f"{args.groups} groups of a {args.prefix_tokens}-token prefix + {args.suffix_tokens} unique tokens, "
          f"4 tokens out, {args.concurrency} clients; {num_blocks} KV blocks of {_BLOCK} per worker "
          f"(~{args.groups_per_pool:g} groups), --pd-threshold {args.pd_threshold}")
    base = float(rows[0][2])
    print_table(["decode policy", "decode prefix hit rate", "TTFT mean (ms)", "TTFT p90 (ms)", "TTFT vs first"],
                [[*row, f"{float(row[2]) / base:.2f}"] for row in rows])


if __name__ == "__main__":
    main()
