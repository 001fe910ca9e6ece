"""The load client: sends a workload to an OpenAI-compatible server and records what each request saw.

One asyncio task per request; a semaphore caps how many are in flight (fixed concurrency), and
arrival offsets (Poisson/gamma) decide when each may start. Every request ends as one
`RequestRecord`, never as an exception: an HTTP error status, an in-band error frame, a timeout or
a dropped connection is a failure of a named kind, and the run goes on.

Timing: `time.perf_counter()` when the request is sent, when each content-bearing chunk arrives,
and when the response ends. TTFT is the first content chunk; ITL the gaps between content chunks;
output tokens come from the usage block (`stream_options.include_usage`), because one chunk may
carry several tokens (or none, while a detokenizer holds back half a UTF-8 character).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from pdserve.bench.serve.workloads import RequestSpec, Workload, arrival_offsets_s

Endpoint = Literal["completions", "chat"]
# A non-streaming request picked for cancellation is dropped after a delay uniform in this range.
_NON_STREAM_CANCEL_S = (0.05, 1.0)


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What one request saw. Times are seconds; `sent_s` counts from the start of the run, the
    others from `sent_s`."""

    index: int
    sent_s: float
    e2e_s: float
    prompt_tokens: int
    output_tokens: int
    ttft_s: float | None = None  # None when not streamed (or no content arrived)
    chunk_times_s: tuple[float, ...] = ()  # arrival of every content-bearing chunk
    error_kind: str | None = None  # None: success; "http_429", "error_frame", "timeout", "connection", ...
    error: str = ""
    cancelled: bool = False  # the client dropped it on purpose (--cancel-rate): neither success nor failure

    @property
    def ok(self) -> bool:
        return self.error_kind is None and not self.cancelled


@dataclass(frozen=True, slots=True)
class LoadConfig:
    """How to drive the server (built once from the command line)."""

    base_url: str
    model: str | None = None  # None: the first id of GET /v1/models
    endpoint: Endpoint = "completions"
    stream: bool = True
    max_concurrency: int | None = None  # None: no cap (only the arrival process paces)
    request_rate: float = math.inf
    burstiness: float = 1.0
    cancel_rate: float = 0.0
    seed: int = 0
    timeout_s: float = 600.0
    progress: bool = True
    ignore_eos: bool = True  # vLLM's extra field; servers that refuse unknown fields need it off
    api_key: str | None = None  # sent as `Authorization: Bearer`; None: no header

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True, slots=True)
class LoadResult:
    records: tuple[RequestRecord, ...]
    duration_s: float
    model: str
    config: LoadConfig = field(repr=False)


@dataclass(frozen=True, slots=True)
class CancelPlan:
    """When the client drops one request on purpose (both None: never)."""

    after_chunks: int | None = None  # streaming: drop the stream after this many content chunks
    after_s: float | None = None  # not streaming: drop the request after this delay


def request_body(spec: RequestSpec, config: LoadConfig, model: str) -> dict[str, Any]:
    """The JSON body: exact output length (`ignore_eos` + `max_tokens`, vLLM's extra field), greedy.
    Without `ignore_eos` (`--no-ignore-eos`) a request may end early at an end-of-sequence token."""
    body: dict[str, Any] = {"model": model, "max_tokens": spec.max_tokens, "temperature": 0.0,
                            "stream": config.stream}
    if config.ignore_eos:
        body["ignore_eos"] = True
    if config.stream:
        body["stream_options"] = {"include_usage": True}
    if config.endpoint == "chat":
        prompt = spec.prompt if isinstance(spec.prompt, str) else " ".join(map(str, spec.prompt))
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = spec.prompt
    return body


def _content_of(chunk: dict[str, Any]) -> str:
    text = ""
    for choice in chunk.get("choices") or ():
        if "text" in choice:
            text += choice.get("text") or ""
        delta = choice.get("delta") or {}
        text += (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return text


def _error_message(payload: Any) -> str:
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        return str(payload["error"].get("message", payload["error"]))
    return str(payload)[:200]


class _Failure(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


async def _stream(http: httpx.AsyncClient, path: str, body: dict[str, Any], start: float,
                  cancel: CancelPlan) -> tuple[list[float], dict[str, Any] | None, bool]:
    """Read an SSE response: content-chunk arrival times, the usage block, whether it was cancelled."""
    times: list[float] = []
    usage = None
    async with http.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            raise _Failure(f"http_{response.status_code}", _error_message(_json_or_text(await response.aread())))
        done = finished = False
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise _Failure("error_frame", _error_message(chunk))
            if _content_of(chunk):
                times.append(time.perf_counter() - start)
                if cancel.after_chunks is not None and len(times) >= cancel.after_chunks:
                    return times, usage, True
            usage = chunk.get("usage") or usage
            finished = finished or any(c.get("finish_reason") for c in chunk.get("choices") or ())
        # NOTE: some servers (transformers serve) end the stream without [DONE]; a closed stream
        # whose choice finished is complete, one that just stops is not.
        if not done and not finished:
            raise _Failure("incomplete", f"stream ended without [DONE] after {len(times)} content chunks")
    return times, usage, False


def _json_or_text(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


def _usage_of_reply(response: httpx.Response) -> dict[str, Any] | None:
    payload = _json_or_text(response.content)
    if response.status_code != 200:
        raise _Failure(f"http_{response.status_code}", _error_message(payload))
    if not isinstance(payload, dict) or "error" in payload:
        raise _Failure("bad_response", _error_message(payload))
    return payload.get("usage")


def _failed(index: int, sent_s: float, start: float, spec: RequestSpec, kind: str, message: str) -> RequestRecord:
    return RequestRecord(index, sent_s, time.perf_counter() - start, spec.prompt_len, 0, error_kind=kind,
                         error=message)


@dataclass(frozen=True, slots=True)
class Shot:
    """One request of a run: its index in the workload, what it asks, when the client gives up on it."""

    index: int
    spec: RequestSpec
    cancel: CancelPlan


async def send_one(http: httpx.AsyncClient, shot: Shot, config: LoadConfig, model: str,
                   run_start: float) -> RequestRecord:
    """Send one request and time it. Never raises (except CancelledError): errors become records."""
    index, spec, cancel = shot.index, shot.spec, shot.cancel
    path = "/v1/chat/completions" if config.endpoint == "chat" else "/v1/completions"
    body = request_body(spec, config, model)
    start = time.perf_counter()
    sent_s = start - run_start
    try:
        if config.stream:
            times, usage, cancelled = await _stream(http, path, body, start, cancel)
        else:
            try:
                response = await asyncio.wait_for(http.post(path, json=body), cancel.after_s)
            except asyncio.TimeoutError:
                return RequestRecord(index, sent_s, time.perf_counter() - start, spec.prompt_len, 0, cancelled=True)
            times, usage, cancelled = [], _usage_of_reply(response), False
        e2e_s = time.perf_counter() - start
    except _Failure as exc:
        return _failed(index, sent_s, start, spec, exc.kind, str(exc))
    except httpx.TimeoutException as exc:
        return _failed(index, sent_s, start, spec, "timeout", repr(exc))
    except httpx.TransportError as exc:
        return _failed(index, sent_s, start, spec, "connection", repr(exc))
    except ValueError as exc:  # a chunk that is not JSON
        return _failed(index, sent_s, start, spec, "bad_response", repr(exc))
    except Exception as exc:  # noqa: BLE001 - one odd reply must not end a long run
        return _failed(index, sent_s, start, spec, "other", repr(exc))
    usage = usage or {}
    output_tokens = int(usage.get("completion_tokens", len(times)))
    prompt_tokens = int(usage.get("prompt_tokens", spec.prompt_len))
    ttft = times[0] if times else None
    return RequestRecord(index, sent_s, e2e_s, prompt_tokens, output_tokens, ttft, tuple(times),
                         cancelled=cancelled)


def cancel_plans(workload: Workload, config: LoadConfig) -> list[CancelPlan]:
    """Which requests the client drops, and when; seeded, so a rerun drops the same ones."""
    rng = random.Random(config.seed + 1)
    plans = []
    for spec in workload.requests:
        if rng.random() >= config.cancel_rate:
            plans.append(CancelPlan())
        elif config.stream:
            plans.append(CancelPlan(after_chunks=rng.randint(1, max(1, spec.max_tokens - 1))))
        else:
            plans.append(CancelPlan(after_s=rng.uniform(*_NON_STREAM_CANCEL_S)))
    return plans


async def served_model(http: httpx.AsyncClient) -> str:
    """The first model id of GET /v1/models (RuntimeError when the server cannot say)."""
    try:
        response = await http.get("/v1/models")
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
        url = f"{str(http.base_url).rstrip('/')}/v1/models"
        raise RuntimeError(f"cannot read the model id from {url} ({exc!r}); pass --model") from exc


async def run_load(workload: Workload, config: LoadConfig) -> LoadResult:
    """Send every request of `workload` (arrival offsets and concurrency cap from `config`) and
    wait for all of them. The duration runs from the first send to the last response."""
    from tqdm import tqdm

    offsets = arrival_offsets_s(len(workload.requests), config.request_rate, config.burstiness, config.seed)
    plans = cancel_plans(workload, config)
    cap = config.max_concurrency or len(workload.requests) or 1
    limits = httpx.Limits(max_connections=cap, max_keepalive_connections=cap)
    timeout = httpx.Timeout(config.timeout_s, connect=min(config.timeout_s, 30.0))
    async with httpx.AsyncClient(base_url=config.base_url, limits=limits, timeout=timeout,
                                 headers=config.headers) as http:
        model = config.model or await served_model(http)
        semaphore = asyncio.Semaphore(cap)
        bar = tqdm(total=len(workload.requests), disable=not config.progress, unit="req", smoothing=0.1)
        run_start = time.perf_counter()

        async def one(index: int, spec: RequestSpec) -> RequestRecord:
            delay = offsets[index] - (time.perf_counter() - run_start)
            if delay > 0:
                await asyncio.sleep(delay)
            async with semaphore:
                record = await send_one(http, Shot(index, spec, plans[index]), config, model, run_start)
            bar.update(1)
            return record

        records = await asyncio.gather(*(one(i, spec) for i, spec in enumerate(workload.requests)))
        duration_s = time.perf_counter() - run_start
        bar.close()
    return LoadResult(tuple(records), duration_s, model, config)
