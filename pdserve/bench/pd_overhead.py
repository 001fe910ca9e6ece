"""The fixed per-request cost of the PD path: time to first token of short prompts, colocated vs
disaggregated over each KV transport, with the router's TTFT phase breakdown.

    python -m pdserve.bench.pd_overhead [--prompt-lens 4,64,1024,2000+20] [--requests 30]
                                        [--systems engine,colocated,pd-tcp,pd-nixl] [--model DIR]

Systems, each started by this command and stopped before the next:
- `engine`: the offline engine in this process (`LLMEngine`: add the request, step until its first
  token). What the serving path adds is `colocated` minus `engine`.
- `colocated`: `pdserve serve`.
- `pd-tcp`, `pd-nixl`: `pdserve up --prefill 1 --decode 1 --kv-transport tcp|nixl`.
Every engine gets `--threads` torch threads. Rows: a prompt length (random token ids, so no prefix
hit), or `P+T`: a T-token tail after a P-token prefix that the warm-up requests cached.

Requests go one at a time (sequential: only fixed costs, no queueing), streamed, `max_tokens` 2,
greedy, after `--warmup` requests per row. TTFT is from sending the request to the first chunk
that carries a token. The phase columns are the means of the router's `pdserve:ttft_phase_seconds`
over the row's requests (its /metrics scraped before and after the row): where a PD request's
TTFT goes (router queue, prefill queue, prefill compute, transfer = the rest, first decode step).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from pdserve.bench.common import hardware_line, print_table
from pdserve.bench.serve import local
from pdserve.bench.serve.metrics import percentile
from pdserve.ops.signals import HistogramSnapshot, histograms_by_label, mean

SYSTEMS = ("engine", "colocated", "pd-tcp", "pd-nixl")
PHASES = ("router_queue", "prefill_queue", "prefill_compute", "transfer", "first_decode_step")
_PHASE_METRIC = "pdserve:ttft_phase_seconds"
_MAX_TOKENS = 2
_MIN_TOKEN_ID = 100
_MAX_TOKEN_ID = 32000


@dataclass(frozen=True, slots=True)
class RowSpec:
    """One row's prompts: `tail_len` fresh tokens after `prefix_len` tokens every request shares."""

    prefix_len: int
    tail_len: int

    @classmethod
    def parse(cls, text: str) -> RowSpec:
        prefix, _, tail = text.partition("+")
        return cls(int(prefix), int(tail)) if tail else cls(0, int(prefix))

    def __str__(self) -> str:
        return f"{self.prefix_len}+{self.tail_len}" if self.prefix_len else str(self.tail_len)

    def prompts(self, num: int, seed: int) -> list[list[int]]:
        rng = random.Random(seed)
        prefix = [rng.randrange(_MIN_TOKEN_ID, _MAX_TOKEN_ID) for _ in range(self.prefix_len)]
        return [prefix + [rng.randrange(_MIN_TOKEN_ID, _MAX_TOKEN_ID) for _ in range(self.tail_len)]
                for _ in range(num)]


@dataclass(frozen=True, slots=True)
class Row:
    system: str
    spec: RowSpec
    ttfts_s: tuple[float, ...]
    phases_s: dict[str, float]  # phase -> mean over the row ({} when the system has none)

    @property
    def median_s(self) -> float:
        return statistics.median(self.ttfts_s)


def ttft_s(http: httpx.Client, model: str, prompt: list[int]) -> float:
    """One streamed completion; seconds from sending it to the first chunk carrying a token."""
    body = {"model": model, "prompt": prompt, "max_tokens": _MAX_TOKENS, "temperature": 0.0, "stream": True,
            "ignore_eos": True}
    first: float | None = None
    start = time.perf_counter()
    with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read()[:300]!r}")
        for line in response.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                raise RuntimeError(f"error frame: {chunk['error']}")
            if first is None and chunk.get("choices"):
                first = time.perf_counter() - start
    if first is None:
        raise RuntimeError("the stream carried no token")
    return first


def phase_means(before: str, after: str) -> dict[str, float]:
    """Mean of each TTFT phase observed between two scrapes of a router's /metrics ({} if none)."""
    old, new = histograms_by_label(before, _PHASE_METRIC, "phase"), histograms_by_label(after, _PHASE_METRIC, "phase")
    means = {phase: mean(old.get(phase, HistogramSnapshot.empty()), snap) for phase, snap in new.items()}
    return {phase: value for phase, value in means.items() if value is not None}


def measure_server(system: str, url: str, specs: list[RowSpec], num_requests: int, warmup: int,
                   seed: int) -> list[Row]:
    rows = []
    with httpx.Client(base_url=url, timeout=300) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        for i, spec in enumerate(specs):
            prompts = spec.prompts(warmup + num_requests, seed + i)
            for prompt in prompts[:warmup]:
                ttft_s(http, model, prompt)
            before = http.get("/metrics").text
            ttfts = tuple(ttft_s(http, model, prompt) for prompt in prompts[warmup:])
            rows.append(Row(system, spec, ttfts, phase_means(before, http.get("/metrics").text)))
    return rows


def measure_engine(model: str, threads: int, specs: list[RowSpec], num_requests: int, warmup: int,
                   seed: int) -> list[Row]:
    """The same prompts through the offline engine in this process: add, step to the first token."""
    import torch

    from pdserve.config import EngineArgs
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.sampling_params import SamplingParams

    torch.set_num_threads(threads)
    engine = LLMEngine.from_engine_args(EngineArgs(model=model))
    params = SamplingParams(temperature=0.0, max_tokens=_MAX_TOKENS, ignore_eos=True)
    rows = []
    for i, spec in enumerate(specs):
        ttfts = []
        for n, prompt in enumerate(spec.prompts(warmup + num_requests, seed + i)):
            rid = f"r{i}-{n}"
            start = time.perf_counter()
            engine.add_request(rid, prompt, params)
            first = None
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if first is None and out.outputs[0].token_ids:
                        first = time.perf_counter() - start
            if n >= warmup and first is not None:
                ttfts.append(first)
        rows.append(Row("engine", spec, tuple(ttfts), {}))
    engine.close()
    return rows


def launch_args(system: str, port: int, threads: int, engine_args: list[str]) -> list[str]:
    if system == "colocated":
        return local.colocated_args(port, threads, True, engine_args)
    transport = system.removeprefix("pd-")
    return local.pd_args(port, 1, 1, threads, [*engine_args, "--kv-transport", transport])


@contextmanager
def _server(system: str, threads: int, engine_args: list[str], log_dir: Path, timeout_s: float) -> Iterator[str]:
    port = local.free_port()
    args = launch_args(system, port, threads, engine_args)
    print(f"-- {system}: pdserve {' '.join(args)}", flush=True)
    with local.running(system, args, port, log_dir, timeout_s) as server:
        yield server.url


def table(rows: list[Row]) -> tuple[list[str], list[list[str]]]:
    """One line per system and row; `+ms` is the median above colocated's for the same row."""
    base = {r.spec: r.median_s for r in rows if r.system == "colocated"}
    headers = ["system", "prompt", "TTFT median ms", "P99 ms", "max ms", "+ms vs colocated",
               *(f"{p} ms" for p in PHASES)]
    lines = []
    for r in rows:
        ms = [1000 * t for t in r.ttfts_s]
        extra = f"{1000 * (r.median_s - base[r.spec]):+.1f}" if r.spec in base else "-"
        phases = [f"{1000 * r.phases_s[p]:.1f}" if p in r.phases_s else "-" for p in PHASES]
        lines.append([r.system, str(r.spec), f"{statistics.median(ms):.1f}", f"{percentile(ms, 99):.1f}",
                      f"{max(ms):.1f}", extra, *phases])
    return headers, lines


def run(ns: argparse.Namespace) -> list[Row]:
    from pdserve.model.demo_checkpoint import default_model_dir

    model = ns.model or str(default_model_dir("tiny"))
    specs = [RowSpec.parse(s) for s in ns.prompt_lens.split(",")]
    engine_args = ["--model", model, *ns.engine_args.split()]
    log_dir = ns.log_dir or Path(tempfile.mkdtemp(prefix="pdserve-pd-overhead-"))
    rows: list[Row] = []
    for system in ns.systems.split(","):
        if system not in SYSTEMS:
            raise ValueError(f"unknown system {system!r}; choose from {', '.join(SYSTEMS)}")
        if system == "engine":
            rows += measure_engine(model, ns.threads, specs, ns.requests, ns.warmup, ns.seed)
            continue
        with _server(system, ns.threads, engine_args, log_dir, ns.ready_timeout) as url:
            rows += measure_server(system, url, specs, ns.requests, ns.warmup, ns.seed)
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the random `tiny` preset)")
    parser.add_argument("--prompt-lens", default="4,64,1024", help="rows: lengths, or P+T (T tokens after a cached P)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {', '.join(SYSTEMS)}")
    parser.add_argument("--requests", type=int, default=30, help="measured requests per row")
    parser.add_argument("--warmup", type=int, default=5, help="requests per row before measuring")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every engine")
    parser.add_argument("--engine-args", default="", help="more flags for every server")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    parser.add_argument("--log-dir", type=Path, default=None, help="servers' logs (default: a temp dir)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    ns = parse_args(argv)
    print(f"hardware: {hardware_line()}")
    print(f"model: {ns.model or 'tiny (random)'}; {ns.requests} sequential streamed requests per row after "
          f"{ns.warmup} warm-up, max_tokens {_MAX_TOKENS}, {ns.threads} torch thread(s) per engine", flush=True)
    print_table(*table(run(ns)))


if __name__ == "__main__":
    main()
