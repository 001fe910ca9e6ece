"""PD against colocated on the same engine flags, through the HTTP API: the same answers, and what
the PD path adds to a short prompt's first token.

    python -m pdserve.bench.pd_parity [--model DIR] [--kv-transport tcp] [--prompt-lens 4,60,300,1500]
        [--max-tokens 24] [--ttft-requests 20] [--log-dir DIR] [--save FILE] [ENGINE FLAGS...]

Starts `pdserve serve`, then `pdserve up --prefill 1 --decode 1` (one after the other: on one GPU
each has the device to itself), with the same engine flags (any flag this command does not know
goes to both, e.g. `--device cuda --dtype bfloat16 --gpu-memory-utilization 0.4`). Each gets the
same requests, all at once: every prompt greedy and seeded, streamed and not. Their texts must be
equal. Then a 4-token prompt's TTFT, one request at a time. Exit status 1 when an answer differs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from pdserve.bench.common import hardware_line, print_table
from pdserve.bench.serve.local import colocated_args, free_port, pd_args, running

_READY_TIMEOUT_S = 600.0
_VOCAB = (100, 150_000)


def make_requests(prompt_lens: list[int], max_tokens: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    out = []
    for index, n in enumerate(prompt_lens):
        prompt = rng.integers(*_VOCAB, n).tolist()
        base = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
        for stream in (False, True):
            out.append({**base, "temperature": 0.0, "stream": stream})
            out.append({**base, "temperature": 0.8, "top_p": 0.9, "seed": 1000 + index, "stream": stream})
    return out


async def _one(http: httpx.AsyncClient, body: dict[str, Any]) -> tuple[str, float]:
    """(the text, seconds to the first text) of one completion."""
    start = time.perf_counter()
    if not body.get("stream"):
        response = await http.post("/v1/completions", json=body)
        response.raise_for_status()
        return response.json()["choices"][0]["text"], time.perf_counter() - start
    text, first = [], 0.0
    async with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0]["text"]
            if delta and not first:
                first = time.perf_counter() - start
            text.append(delta)
    return "".join(text), first


async def answers(url: str, requests: list[dict[str, Any]]) -> list[str]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        return [text for text, _ in await asyncio.gather(*(_one(http, body) for body in requests))]


async def ttfts(url: str, num_requests: int) -> list[float]:
    body = {"prompt": [1000, 2000, 3000, 4000], "max_tokens": 2, "temperature": 0.0, "stream": True}
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        for _ in range(3):  # warm-up
            await _one(http, body)
        return [(await _one(http, body))[1] for _ in range(num_requests)]


def measure(name: str, cli_args: list[str], port: int, ns: argparse.Namespace,
            requests: list[dict[str, Any]]) -> dict[str, Any]:
    with running(name, cli_args, port, Path(ns.log_dir), _READY_TIMEOUT_S) as server:
        texts = asyncio.run(answers(server.url, requests))
        times = asyncio.run(ttfts(server.url, ns.ttft_requests))
    return {"texts": texts, "ttft_s": times}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory (default: the demo model)")
    p.add_argument("--kv-transport", default="tcp", choices=("tcp", "nixl"))
    p.add_argument("--prompt-lens", default="4,60,300,1500", help="comma-separated prompt lengths (tokens)")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--ttft-requests", type=int, default=20)
    p.add_argument("--log-dir", default=None, help="the servers' logs (default: a temporary directory)")
    p.add_argument("--save", default=None, help="write texts and TTFTs here (JSON)")
    return p


def main(argv: list[str] | None = None) -> int:
    ns, engine_flags = _parser().parse_known_args(argv)
    ns.log_dir = ns.log_dir or tempfile.mkdtemp(prefix="pd-parity-")
    engine_flags = [*engine_flags, *(["--model", ns.model] if ns.model else [])]
    requests = make_requests([int(n) for n in ns.prompt_lens.split(",")], ns.max_tokens)
    port = free_port()
    results = {
        "colocated": measure("colocated", colocated_args(port, 1, True, engine_flags), port, ns, requests),
        f"pd-{ns.kv_transport}": measure(
            "pd", pd_args(port, 1, 1, 1, [*engine_flags, "--kv-transport", ns.kv_transport]), port, ns, requests),
    }
    reference = results["colocated"]["texts"]
    rows = []
    for name, result in results.items():
        times = sorted(result["ttft_s"])
        result["mismatches"] = [i for i, (a, b) in enumerate(zip(reference, result["texts"], strict=True)) if a != b]
        rows.append([name, f"{len(requests) - len(result['mismatches'])}/{len(requests)}",
                     f"{statistics.median(times) * 1e3:.1f}", f"{np.percentile(times, 99) * 1e3:.1f}",
                     f"{times[-1] * 1e3:.1f}"])
    print(hardware_line())
    print_table(["system", "answers equal to colocated", "TTFT 4 tok median ms", "P99 ms", "max ms"], rows)
    if ns.save:
        Path(ns.save).write_text(json.dumps({"requests": requests, "results": results}, indent=1))
    bad = {name: r["mismatches"] for name, r in results.items() if r["mismatches"]}
    for name, indexes in bad.items():
        for i in indexes[:5]:
            print(f"{name}: request {i} {({k: v for k, v in requests[i].items() if k != 'prompt'})} differs:\n"
                  f"  colocated {reference[i]!r}\n  {name} {results[name]['texts'][i]!r}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
