"""The first token from prefill (issue 19): the router sends a request's first token to its client as
soon as the prefill worker sampled it, before decode has the KV, and the client sees exactly what it
would have seen from decode: the same outputs, the duplicate from decode dropped; a retried attempt
whose first token differs, or a decode worker lost after it, continues from the token sent. The
router tests stub the workers at the WorkerClient boundary; the last one runs a real cluster."""

from __future__ import annotations

import asyncio
import collections
import json
import threading
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import generate_texts, mark_ready, random_prompt
from pd_fixtures import start_cluster, stop_cluster

from pdserve.disagg.client import WorkerClient
from pdserve.disagg.config import RouterConfig
from pdserve.disagg.control import (
    FirstToken,
    FrameEncoder,
    HandOff,
    OutputFrame,
    PrefillJob,
    ReserveReply,
    ReserveRequest,
)
from pdserve.disagg.router.core import PDRouter, ServedModel
from pdserve.disagg.router.memory_queue import MemoryPrefillQueue
from pdserve.disagg.router.outputs import first_output
from pdserve.disagg.router.pool import WorkerPool
from pdserve.disagg.transport.errors import KVTransferError
from pdserve.disagg.transport.fake import FakeKVSender
from pdserve.disagg.worker.decode_service import DecodeService
from pdserve.engine.llm import LLM
from pdserve.engine.output import CompletionOutput, RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.model.qwen3_config import Qwen3ModelConfig
from pdserve.tokenizer import Tokenizer, load_tokenizer
from pdserve.tokenizer.detokenizer import detokenize

PREFILL, DECODE, DECODE2 = "http://prefill", "http://decode", "http://decode2"
PROMPT = [11, 12, 13, 14]
GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


class StubWorkers(WorkerClient):
    """Prefill samples the first token of each attempt from `first_tokens` (transfer id -> token),
    then waits until decode has the KV; decode streams `streams[request id]` once prefill sampled the
    request's first token and it has the KV (an exhausted list: the stream ends there)."""

    def __init__(self, first_tokens: dict[str, int], streams: dict[str, list[OutputFrame]]) -> None:
        super().__init__(timeout_s=1.0)
        self.first_tokens = first_tokens
        self.streams = streams
        self.sampled: collections.defaultdict[str, asyncio.Event] = collections.defaultdict(asyncio.Event)
        self.decode_has_kv = asyncio.Event()
        self.placed: collections.defaultdict[str, asyncio.Event] = collections.defaultdict(asyncio.Event)
        self.reserved: list[tuple[str, str, list[int]]] = []  # (decode url, request id, prompt)

    async def reserve(self, url: str, request: ReserveRequest) -> ReserveReply | None:
        self.reserved.append((url, request.request_id, request.prompt_token_ids))
        return ReserveReply(block_ids=[0], num_cached_tokens=0, kv_address="a:1", token="t")

    async def place(self, url: str, placement: Any) -> bool:
        self.placed[placement.transfer_id].set()
        return True

    async def prefill(self, url: str, job: PrefillJob, on_first_token: Any = None,
                      on_accepted: Any = None) -> HandOff | None:
        if on_accepted is not None:
            on_accepted()
        if on_first_token is not None:
            on_first_token(FirstToken(transfer_id=job.transfer_id, token_id=self.first_tokens[job.transfer_id],
                                      prefill_queue_s=0.001, prefill_compute_s=0.002))
        self.sampled[job.request_id].set()
        if not job.placed:  # NOTE: as a prefill worker: no hand-off before the job is placed
            await self.placed[job.transfer_id].wait()
        await self.decode_has_kv.wait()
        return HandOff(transfer_id=job.transfer_id, status="handed_off")

    async def retarget(self, url: str, request_id: str, transfer_id: str, replaces: str = "") -> bool:
        return True

    async def abort(self, url: str, request_id: str) -> None:
        pass

    async def stream(self, url: str, request_id: str) -> AsyncGenerator[OutputFrame, None]:
        await self.sampled[request_id].wait()
        await self.decode_has_kv.wait()
        encoder = FrameEncoder()  # the stream's cumulative frames as decode sends them: deltas
        for frame in self.streams[request_id]:
            if frame.kv_retry:
                yield encoder.signal(kv_retry=True)
                continue
            seq = CompletionOutput(0, frame.text, frame.token_ids, frame.finish_reason)
            yield encoder.frame(RequestOutput(request_id, None, [], [seq], seq.finished))


@pytest.fixture(scope="module")
def tokenizer(model_dirs: dict[str, Path]) -> Tokenizer:
    return load_tokenizer(str(model_dirs["tiny"]))


def _router(model_dir: Path, tokenizer: Tokenizer, workers: StubWorkers, decode: tuple[str, ...] = (DECODE,),
            **config: Any) -> PDRouter:
    pool = WorkerPool(workers, [PREFILL], list(decode))
    for worker in pool.members("prefill") + pool.members("decode"):
        mark_ready(worker)
    return PDRouter(RouterConfig(prefill=(PREFILL,), decode=decode, **config), ServedModel(tokenizer,
                    Qwen3ModelConfig.from_dir(model_dir), str(model_dir), 1024), pool=pool,
                    queue=MemoryPrefillQueue(pool, workers), client=workers)


def _tokens(tokenizer: Tokenizer) -> list[int]:
    """Four ordinary tokens, each whole characters."""
    ids = tokenizer.encode(" one two three four")
    assert len(ids) == 4 and not set(ids) & set(tokenizer.eos_token_ids)
    return ids


def _frame(tokenizer: Tokenizer, tokens: list[int], finish: str | None = None) -> OutputFrame:
    """Decode's cumulative output for these tokens (whole characters: the text is their decoding), as
    a frame (StubWorkers.stream sends it as the delta a decode worker would)."""
    return OutputFrame(text=detokenize(tokenizer, tokens)[0], token_ids=tokens, finish_reason=finish)


def _seen(outputs: list[Any]) -> list[tuple[list[int], str, bool]]:
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.finished) for o in outputs]


def test_the_first_token_reaches_the_client_before_decode_has_the_kv(model_dirs: dict[str, Path],
                                                                     tokenizer: Tokenizer) -> None:
    """Decode holds every frame until it has the KV, which it gets only after the first output is
    out; the outputs are those of the path without the early token (decode's copy of it dropped)."""

    async def scenario(early: bool) -> list[tuple[list[int], str, bool]]:
        t0, t1, t2, _ = _tokens(tokenizer)
        workers = StubWorkers({"r@0": t0}, {"r": [_frame(tokenizer, [t0]), _frame(tokenizer, [t0, t1]),
                                                  _frame(tokenizer, [t0, t1, t2], "length")]})
        router = _router(model_dirs["tiny"], tokenizer, workers, early_first_token=early)
        if not early:
            workers.decode_has_kv.set()
        try:
            outputs = router.generate("r", PROMPT, GREEDY)
            first = await asyncio.wait_for(anext(outputs), 10)
            assert not workers.decode_has_kv.is_set() or not early
            workers.decode_has_kv.set()
            return _seen([first] + [o async for o in outputs])
        finally:
            await router.close()

    with_early = asyncio.run(scenario(early=True))
    assert with_early == asyncio.run(scenario(early=False))
    assert [len(tokens) for tokens, _, _ in with_early] == [1, 2, 3] and with_early[-1][2]


@pytest.mark.parametrize("ending", ["another-first-token", "decode-lost"])
def test_after_an_early_token_a_retry_or_a_loss_continues_from_it(model_dirs: dict[str, Path], tokenizer: Tokenizer,
                                                                  ending: str) -> None:
    """After the first token went out from prefill: a stalled transfer's retry whose prefill sampled
    another first token (decode goes on from that one), or a decode worker lost. Either way the
    request resumes over prompt + the token sent, and the client sees one continuous output."""

    async def scenario() -> None:
        t0, t1, t2, other = _tokens(tokenizer)
        first_attempt = ([OutputFrame(kv_retry=True), _frame(tokenizer, [other]), _frame(tokenizer, [other, t1])]
                         if ending == "another-first-token" else [])
        resumed = [_frame(tokenizer, [t1]), _frame(tokenizer, [t1, t2], "length")]
        workers = StubWorkers({"r@0": t0, "r@1": other, "r~1@0": t1}, {"r": first_attempt, "r~1": resumed})
        workers.decode_has_kv.set()
        router = _router(model_dirs["tiny"], tokenizer, workers, decode=(DECODE, DECODE2), early_first_token=True)
        try:
            outputs = _seen([o async for o in router.generate("r", PROMPT, GREEDY)])
        finally:
            await router.close()
        assert outputs == [([t0], detokenize(tokenizer, [t0])[0], False),
                           ([t0, t1], detokenize(tokenizer, [t0, t1])[0], False),
                           ([t0, t1, t2], detokenize(tokenizer, [t0, t1, t2])[0], True)]
        [(first_decode, _, _), (resumed_on, rid, prompt)] = workers.reserved
        assert (rid, prompt) == ("r~1", PROMPT + [t0])
        # a decode worker that sent another token is still there; a lost one is not asked again
        assert (resumed_on == first_decode) == (ending == "another-first-token")
        assert router.stats().events.resumed == 1

    asyncio.run(scenario())


def test_a_first_token_that_ends_the_request_is_left_to_decode(model_dirs: dict[str, Path],
                                                               tokenizer: Tokenizer) -> None:
    """EOS, a stop token, a stop string, the last token allowed: only decode's output says how the
    request ends, so prefill's token is not sent early; otherwise its text is decode's (held back as
    a possible start of a stop string)."""
    t0 = _tokens(tokenizer)[0]
    text = detokenize(tokenizer, [t0])[0]
    eos = tokenizer.eos_token_ids[0]
    vocab = Qwen3ModelConfig.from_dir(model_dirs["tiny"]).vocab_size

    def first(params: SamplingParams, token: int = t0) -> Any:
        return first_output(tokenizer, 1024, vocab, len(PROMPT), params, token)

    assert first(SamplingParams(max_tokens=4)).text == text
    assert first(SamplingParams(max_tokens=4), eos) is None
    assert first(SamplingParams(max_tokens=4, ignore_eos=True), eos) is not None
    assert first(SamplingParams(max_tokens=4, min_tokens=2), eos) is not None
    assert first(SamplingParams(max_tokens=4, stop_token_ids=(t0,))) is None
    assert first(SamplingParams(max_tokens=1)) is None
    assert first(SamplingParams(max_tokens=4, stop=(text.strip(),))) is None
    held = first(SamplingParams(max_tokens=4, stop=(text + "zzz",)))
    assert held is not None and held.text == "" and held.token_ids == [t0]
    assert first(SamplingParams(max_tokens=4), vocab) is None


def _sse(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[len("data: "):])


@pytest.mark.slow
def test_a_served_first_token_comes_before_decode_applies_the_kv(model_dirs: dict[str, Path], colocated: LLM,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A real cluster whose decode worker holds the final KV message until the client has a token:
    the text is still the colocated engine's. Then a hand-off that fails after the first token went
    out ends the stream with the prefill side's error, and frees every block."""
    cluster = start_cluster(model_dirs["tiny"], "fake", 1, 1, early_first_token=True)
    decode: DecodeService = cluster.service(DecodeService)
    held = threading.Event()
    complete = decode._complete

    async def held_complete(rid: str, done: Any) -> None:
        await asyncio.to_thread(held.wait, 30)
        await complete(rid, done)

    monkeypatch.setattr(decode, "_complete", held_complete)
    prompt = random_prompt(24, seed=3)
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True}
    try:
        with httpx.Client(base_url=cluster.router.url, timeout=30) as http:
            with http.stream("POST", "/v1/completions", json=body) as reply:
                chunks = _sse(reply.iter_lines())
                texts = [next(chunks)["choices"][0]["text"]]
                assert decode.stats().completed == 0  # the KV hand-off is not applied yet
                held.set()
                texts += [c["choices"][0]["text"] for c in chunks]
            assert "".join(texts) == generate_texts(colocated, [prompt], SamplingParams(
                temperature=0, max_tokens=6, ignore_eos=True))[0]
            assert len(texts) == 6  # one chunk a token, as colocated
            cluster.wait_until_idle()

            async def lost(self: FakeKVSender, request_id: str, timeout_s: float) -> None:
                raise KVTransferError(f"request {request_id}: connection to the decode worker lost")

            # the connection goes before the final message: decode never gets it
            monkeypatch.setattr(FakeKVSender, "send_done", lambda *args, **kwargs: None)
            monkeypatch.setattr(FakeKVSender, "flush", lost)
            with http.stream("POST", "/v1/completions", json=body) as reply:
                events = list(_sse(reply.iter_lines()))
        assert reply.status_code == 200 and events[0]["choices"][0]["text"] == texts[0]
        assert "prefill failed" in events[-1]["error"]["message"]
        cluster.wait_until_idle()
    finally:
        held.set()
        stop_cluster(cluster)
