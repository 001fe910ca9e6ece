"""Structured outputs (engine/structured.py): a random-weight model's output is random text, so an
output that matches its JSON schema, regex or choice on every request is the test of the mask.
Engine: the constraint holds greedy, seeded and with n > 1, in a batch with unconstrained
requests (whose tokens do not change), a replayed matcher continues exactly where the first one
was (what a resumed request does), and invalid constraints are refused naming what is wrong.
Served: the request surface (`response_format`, `structured_outputs`, `guided_*`, tool_choice)
on the colocated server; through the PD router over tcp and nixl, greedy text identical to
colocated's. (A decode worker killed mid-stream under a schema: tests/test_worker_loss.py.)"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import torch
from helpers import make_request, random_prompt, token_prompts
from pd_fixtures import MODEL, start_cluster, stop_cluster
from server_fixtures import ServerHandle, parse_sse, start_server

from pdserve import LLM, SamplingParams
from pdserve.disagg.transport import nixl_available
from pdserve.engine import structured
from pdserve.engine.sampler import Sampler
from pdserve.engine.structured import MaskFiller, StructuredOutput, check_structured, chunk_maxima, row_argmax
from pdserve.serving.config import ApiConfig
from pdserve.serving.protocol import ChatCompletionRequest, CompletionRequest

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "pet": {"enum": ["cat", "dog", "fish"]},
                   "ok": {"type": "boolean"}},
    "required": ["name", "age", "pet", "ok"], "additionalProperties": False}
REGEX = "[a-z]{2,5}-[0-9]{3}"
CHOICES = ["red", "green", "blue", "purple"]
PROMPTS = [random_prompt(n, seed=7000 + n) for n in (3, 40, 70)]
MAX_TOKENS = 120  # the schema completes within ~30 tokens; the rest is a margin


def check_json(text: str) -> None:
    jsonschema.validate(json.loads(text), SCHEMA)


def check_regex(text: str) -> None:
    assert re.fullmatch(REGEX, text), text


def check_choice(text: str) -> None:
    assert text in CHOICES, text


# (the spec, its request parameters, what checks an output)
CASES: dict[str, tuple[StructuredOutput, dict[str, Any], Callable[[str], None]]] = {
    "json": (StructuredOutput("json", json.dumps(SCHEMA)),
             {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA,
                                                                         "strict": True}}}, check_json),
    "regex": (StructuredOutput("regex", REGEX), {"structured_outputs": {"regex": REGEX}}, check_regex),
    "choice": (StructuredOutput("choice", json.dumps(CHOICES)), {"guided_choice": CHOICES}, check_choice),
}


def constrained(kind: str, **kwargs: Any) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, structured=CASES[kind][0], **kwargs)


# -- engine --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(CASES))
def test_constrained_outputs_are_valid_greedy_seeded_and_with_n(colocated: LLM, kind: str) -> None:
    check = CASES[kind][2]
    for params in (constrained(kind, temperature=0), constrained(kind, temperature=1.0, seed=11),
                   constrained(kind, temperature=1.0, n=3), constrained(kind, temperature=1.0, top_p=0.9)):
        outputs = colocated.generate(token_prompts(PROMPTS), params)
        for output in outputs:
            assert len(output.outputs) == params.n
            for seq in output.outputs:
                assert seq.finish_reason == "stop", (seq.text, seq.finish_reason)  # the grammar ended it
                check(seq.text)
        if params.greedy or params.seed is not None:  # deterministic: the same again
            again = colocated.generate(token_prompts(PROMPTS), params)
            assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outputs]


def test_constrained_and_free_requests_share_a_batch(colocated: LLM) -> None:
    """One batch: the mask touches only the constrained rows (free ones keep their greedy tokens)."""
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = colocated.generate(token_prompts(PROMPTS), free)
    params = [free, constrained("json", temperature=0), free, constrained("regex", temperature=0),
              constrained("choice", temperature=0), free]
    mixed = colocated.generate(token_prompts(PROMPTS + PROMPTS), params)
    assert [mixed[i].outputs[0].token_ids for i in (0, 2)] == [alone[i].outputs[0].token_ids for i in (0, 2)]
    assert mixed[5].outputs[0].token_ids == alone[2].outputs[0].token_ids
    check_json(mixed[1].outputs[0].text)
    check_regex(mixed[3].outputs[0].text)
    check_choice(mixed[4].outputs[0].text)


def _bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """llguidance's layout: int32 words, bit b of word w for token 32w + b."""
    rows, vocab = allowed.shape
    bits = torch.zeros(rows, (vocab + 31) // 32 * 32, dtype=torch.int64)
    bits[:, :vocab] = allowed
    words = (bits.view(rows, -1, 32) << torch.arange(32)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@pytest.mark.parametrize("vocab", [128 * 40, 1000])
def test_the_masked_choice_is_that_of_the_masked_logits(vocab: int) -> None:
    """The sampler's choice under the bitmask (greedy: the argmax checked against the mask, the
    other rows gathered or biased; seeded: the masked rows sampled) is the token that argmax, or the seeded
    race, picks from the logits with every refused token at -inf: ties, NaN allowed or refused,
    rows all -inf, masks allowing one token, most, all or none; row_argmax is argmax."""
    gen = torch.Generator().manual_seed(0)
    num_rows = 16
    logits = (torch.randn(num_rows, vocab, generator=gen) * 2).round()  # many ties
    density = [0.9, 0.1, 0.5, 1.0, 0.0, 0.001, 0.9, 0.1, 0.5, 0.5, 0.9, 0.1, 0.5, 0.9, 0.3, 0.7]
    allowed = torch.rand(num_rows, vocab, generator=gen) < torch.tensor(density)[:, None]
    allowed[5] = False
    allowed[5, 77] = True  # one token
    logits[6, ::7] = float("nan")  # NaN, refused and allowed
    logits[7, allowed[7].nonzero()[3, 0]] = float("nan")  # one NaN, allowed
    logits[8] = float("-inf")
    logits[9, allowed[9]] = float("-inf")  # every allowed token at -inf
    logits[10, ~allowed[10]] = float("inf")  # refused tokens the best
    assert torch.equal(row_argmax(logits), logits.argmax(dim=-1))
    masked = logits.masked_fill(~allowed, float("-inf"))
    seeded = [11, 12, 13, 14, 15]

    def sampler_choice(rows: list[int], constrained: bool) -> list[int]:
        requests = [make_request(str(i), [0], **({"temperature": 1.0, "seed": i} if i in seeded else
                                                 {"temperature": 0.0})) for i in rows]
        sampler = Sampler(0, torch.device("cpu"))
        if constrained:
            for request in requests:
                request.matcher = object()  # type: ignore[assignment]
            done: Future[torch.Tensor] = Future()
            done.set_result(_bitmask(allowed[rows]))
            sampler._pending = ([r.request_id for r in requests], done)
        return sampler((logits if constrained else masked)[rows].clone(), requests).token_ids

    every = list(range(num_rows))
    assert sampler_choice(every, True) == sampler_choice(every, False)
    greedy = [i for i in every if i not in seeded]
    assert sampler_choice(greedy, True) == masked[greedy].argmax(dim=-1).tolist()
    assert sampler_choice([12, 3, 14, 6], True) == sampler_choice([12, 3, 14, 6], False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("rows", "vocab", "threads"), [(16, 1000, 2), (8, 128 * 300, 2), (8, 128 * 300, 1)])
def test_row_argmax_is_argmax_on_every_path(dtype: torch.dtype, rows: int, vocab: int, threads: int) -> None:
    """numpy's argmax (float32/64, small or one thread) and the chunks (the rest) both give
    torch's argmax: the first best of ties, the first NaN, index 0 of a row all -inf; strided rows too."""
    gen = torch.Generator().manual_seed(rows)
    logits = (torch.randn(rows, vocab, generator=gen) * 2).round().to(dtype)  # many ties
    logits[1, 5::9] = float("nan")
    logits[2] = float("-inf")
    logits[3, -1] = float("inf")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert torch.equal(row_argmax(logits), logits.argmax(dim=-1))
        assert torch.equal(row_argmax(logits[::2, 1:]), logits[::2, 1:].argmax(dim=-1))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(("top_chunks", "sparse_words"), [(4, 8), (32, 32), (1, 0)])
def test_the_gathered_choice_is_that_of_the_masked_logits(monkeypatch: pytest.MonkeyPatch, top_chunks: int,
                                                          sparse_words: int) -> None:
    """A greedy row whose best token is refused is answered from a few gathered tokens (its best
    chunks of 128, or a sparse mask's own tokens) where that is exact, by the bias pass elsewhere:
    either way the masked row's argmax (the first best). Ties across chunks and inside one, NaN, a
    row whose best chunks hold no allowed token, a tie with the best chunk left out, masks allowing
    one token or none, refused +inf; the logits rows are not the bitmask rows."""
    monkeypatch.setattr(structured, "_TOP_CHUNKS", top_chunks)
    monkeypatch.setattr(structured, "_SPARSE_WORDS", sparse_words)
    monkeypatch.setattr(structured, "_GATHER_MIN_ROWS", 1)
    gen = torch.Generator().manual_seed(3)
    num_rows, vocab = 24, 128 * 40
    logits = torch.randn(num_rows, vocab, generator=gen).round()  # values in -4..4: many ties
    allowed = torch.rand(num_rows, vocab, generator=gen) < 0.3
    allowed[:, 7] = False
    logits[:, 7] = 50.0  # every row's best token, refused
    exact_rows = {0, 1, 4, 8}  # answered by the gathered tokens whatever top_chunks and sparse_words (> 0)
    # 0: ties across chunks (the first in token order wins, whichever chunk topk ranks first)
    logits[0, [30 * 128 + 5, 5 * 128 + 9]] = 20.0
    allowed[0, [30 * 128 + 5, 5 * 128 + 9]] = True
    # 1: ties inside one chunk
    logits[1, [9 * 128 + 100, 9 * 128 + 3]] = 20.0
    allowed[1, [9 * 128 + 100, 9 * 128 + 3]] = True
    # 2: an allowed NaN; 3: a refused NaN (the masked row ignores it)
    logits[2, 12 * 128 + 1] = float("nan")
    allowed[2, 12 * 128 + 1] = True
    logits[3, 12 * 128 + 1] = float("nan")
    allowed[3, 12 * 128 + 1] = False
    # 4: one allowed token, far down; 5: none
    allowed[4] = False
    allowed[4, 39 * 128 + 77] = True
    allowed[5] = False
    # 6: the best chunks hold no allowed token (dense elsewhere)
    logits[6, : 8 * 128] += 10.0
    allowed[6, : 8 * 128] = False
    # 7: the best allowed ties with the best maximum of a chunk left out (refused there)
    logits[7, 2 * 128] = 30.0
    logits[7, [3 * 128, 4 * 128, 5 * 128]] = 30.0
    allowed[7, 2 * 128] = True
    allowed[7, [3 * 128, 4 * 128, 5 * 128]] = False
    # 8: one word of allowed tokens, tied
    allowed[8] = False
    allowed[8, 32 * 20: 32 * 21] = True
    logits[8, 32 * 20: 32 * 21] = -3.0
    # 9: refused +inf; 10: every allowed token at -inf
    logits[9, ~allowed[9]] = float("inf")
    logits[10, allowed[10]] = float("-inf")
    masked = logits.masked_fill(~allowed, float("-inf"))
    want = masked.argmax(dim=-1)
    order = torch.randperm(num_rows, generator=gen)  # bitmask row i: logits row order[i]
    bitmask = _bitmask(allowed[order])
    maxima = chunk_maxima(logits)
    assert maxima is not None
    exact, best = structured._gathered_argmax(logits, order, bitmask, torch.arange(num_rows), maxima,
                                              MaskFiller()._bias)
    assert torch.equal(best[exact], want[order][exact])
    assert not exact[(order[:, None] == torch.tensor([2, 5, 9, 10])).any(-1)].any()
    if sparse_words:
        assert exact[(order[:, None] == torch.tensor(sorted(exact_rows))).any(-1)].all()
    x = logits.clone()
    tokens = row_argmax(x, maxima)
    MaskFiller().argmax(x, tokens, order.tolist(), bitmask, maxima)
    assert torch.equal(tokens, want)


def test_a_replayed_matcher_continues_where_the_first_one_was(colocated: LLM) -> None:
    """A resumed request: prompt + the tokens generated so far, which its matcher replays; the rest
    of its output is the first run's (greedy), so the whole matches the schema."""
    prompt = PROMPTS[1]
    whole = colocated.generate(token_prompts([prompt]), constrained("json", temperature=0))[0].outputs[0]
    assert len(whole.token_ids) > 8
    for cut in (1, 5, len(whole.token_ids) - 1):
        params = dataclasses.replace(constrained("json", temperature=0), max_tokens=MAX_TOKENS - cut,
                                     structured_replay=cut)
        rest = colocated.generate(token_prompts([prompt + whole.token_ids[:cut]]), params)[0].outputs[0]
        assert whole.token_ids[:cut] + rest.token_ids == whole.token_ids
    # a replay the grammar refuses (text that is no start of the JSON) is refused
    with pytest.raises(ValueError, match="do not match"):
        colocated.generate(token_prompts([prompt + [88, 88]]), dataclasses.replace(
            constrained("json", temperature=0), structured_replay=2))


@pytest.mark.parametrize(("spec", "words"), [
    (StructuredOutput("json", json.dumps({"type": "object", "dependentRequired": {"a": ["b"]}})),
     "dependentRequired"),
    (StructuredOutput("json", json.dumps({"$ref": "http://example.com/schema.json"})), "http://example.com"),
    (StructuredOutput("json", "{not json"), "no JSON"),
    (StructuredOutput("regex", "a(b"), "unclosed group"),
    (StructuredOutput("regex", "(?<=a)b"), "look-around"),
    (StructuredOutput("grammar", 'root ::= "a" ('), "neither Lark nor GBNF"),
    (StructuredOutput("choice", "[]"), "non-empty list"),
])
def test_invalid_constraints_are_refused_naming_the_problem(spec: StructuredOutput, words: str) -> None:
    with pytest.raises(ValueError, match=re.escape(words)):
        check_structured(spec)


def test_the_spec_crosses_the_wire_as_plain_data() -> None:
    params = constrained("json", temperature=0)
    fields = json.loads(json.dumps({f.name: getattr(params, f.name) if f.name != "structured"
                                    else dataclasses.asdict(params.structured)  # type: ignore[arg-type]
                                    for f in dataclasses.fields(params)}))
    assert SamplingParams(**fields) == params
    assert SamplingParams(**(fields | {"structured": ["regex", REGEX]})).structured == CASES["regex"][0]
    with pytest.raises(ValueError, match="kind"):
        SamplingParams(structured={"kind": "xml", "text": ""})  # type: ignore[arg-type]


def test_one_constraint_per_request_and_each_parameter_maps() -> None:
    base = {"prompt": "hi"}
    for extra, kind in ((CASES["json"][1], "json"), ({"response_format": {"type": "json_object"}}, "json_object"),
                        ({"response_format": {"type": "text"}}, None), ({"guided_json": SCHEMA}, "json"),
                        ({"guided_regex": REGEX}, "regex"), ({"structured_outputs": {"choice": CHOICES}}, "choice"),
                        ({"guided_grammar": 'root ::= "yes" | "no"'}, "grammar"),
                        ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, "json")):
        params = CompletionRequest(**base, **extra).to_sampling_params(8, None)
        assert (params.structured.kind if params.structured else None) == kind, extra
    for extra in ({"guided_regex": REGEX, "guided_choice": CHOICES},
                  {"structured_outputs": {"regex": REGEX, "choice": CHOICES}},
                  {"response_format": {"type": "json_object"}, "guided_json": SCHEMA},
                  {"structured_outputs": {"structural_tag": "x"}},
                  {"response_format": {"type": "json_schema"}}):
        with pytest.raises(ValueError):
            CompletionRequest(**base, **extra)
    with pytest.raises(ValueError, match="only one structured-output constraint"):
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], guided_regex=REGEX, guided_choice=CHOICES)


# -- served: colocated, and through the PD router -----------------------------------------------

API = ApiConfig(tool_call_parser="hermes", enable_auto_tool_choice=True)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                     "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
        "required": ["zone"], "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def server(model_dirs: dict[str, Path]) -> Iterator[ServerHandle]:
    handle = start_server(model_dirs["tiny"], MODEL, api=API, dtype="float32", num_kv_blocks=256)
    yield handle
    handle.stop()


def completion_texts(http: httpx.Client, prompt: list[int], body: dict[str, Any]) -> tuple[str, str]:
    """The text of a completion, whole and streamed."""
    body = body | {"prompt": prompt, "max_tokens": MAX_TOKENS}
    reply = http.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["finish_reason"] == "stop"
    streamed = http.post("/v1/completions", json=body | {"stream": True})
    chunks = [e for e in parse_sse(streamed.text) if isinstance(e, dict)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    return reply.json()["choices"][0]["text"], "".join(c["choices"][0]["text"] for c in chunks)


def check_served(http: httpx.Client, colocated: LLM) -> None:
    """Every case, greedy (the text colocated's engine gives) and seeded, whole and streamed."""
    for kind, (_, extra, check) in CASES.items():
        want = [o.outputs[0].text for o in colocated.generate(token_prompts(PROMPTS), constrained(kind, temperature=0))]
        for prompt, text in zip(PROMPTS, want, strict=True):
            assert completion_texts(http, prompt, extra | {"temperature": 0}) == (text, text)
            whole, streamed = completion_texts(http, prompt, extra | {"temperature": 1.0, "seed": 5})
            check(whole)
            assert streamed == whole


def test_served_outputs_are_valid_and_greedy_matches_the_engine(server: ServerHandle, colocated: LLM) -> None:
    with server.http() as http:
        check_served(http, colocated)
        chat = {"messages": [{"role": "user", "content": "Describe a person."}], "max_tokens": MAX_TOKENS,
                "temperature": 1.0, "response_format": CASES["json"][1]["response_format"]}
        for body in (chat, chat | {"response_format": {"type": "json_object"}, "max_tokens": 400}):
            reply = http.post("/v1/chat/completions", json=body)
            assert reply.status_code == 200, reply.text
            choice = reply.json()["choices"][0]
            if choice["finish_reason"] == "stop":  # NOTE: any object may be cut short by max_tokens
                parsed = json.loads(choice["message"]["content"])
                if body is chat:
                    jsonschema.validate(parsed, SCHEMA)
            else:
                assert body is not chat, "the small schema always completes"
    server.wait_until_idle()


def test_tool_choice_required_and_named_give_calls_that_parse(server: ServerHandle) -> None:
    with server.http() as http:
        check_tool_calls(http, seeds=4)
    server.wait_until_idle()


def check_tool_calls(http: httpx.Client, seeds: int) -> None:
    """`tool_choice` required and named: calls of the tools (one of the named one; one or more for
    required, exactly one with parallel_tool_calls false) whose arguments match their schemas,
    whole and streamed."""
    chat = {"messages": [{"role": "user", "content": "Weather or time?"}], "tools": TOOLS, "max_tokens": 200,
            "temperature": 1.0}
    for seed in range(seeds):
        for choice, parallel in (("required", True), ("required", False),
                                 ({"type": "function", "function": {"name": "get_weather"}}, True)):
            body = chat | {"tool_choice": choice, "seed": seed, "parallel_tool_calls": parallel}
            reply = http.post("/v1/chat/completions", json=body)
            assert reply.status_code == 200, reply.text
            message = reply.json()["choices"][0]["message"]
            calls = [c["function"] for c in message["tool_calls"]]
            assert len(calls) == 1 if choice != "required" or not parallel else len(calls) >= 1, message
            for call in calls:
                tool = next(t["function"] for t in TOOLS if t["function"]["name"] == call["name"])
                jsonschema.validate(json.loads(call["arguments"]), tool["parameters"])
            if choice != "required":
                assert calls[0]["name"] == "get_weather"
            streamed = http.post("/v1/chat/completions", json=body | {"stream": True})
            deltas = [tc for e in parse_sse(streamed.text) if isinstance(e, dict) and e["choices"]
                      for tc in e["choices"][0]["delta"].get("tool_calls") or []]
            assert [c["function"]["name"] for c in deltas if "id" in c] == [c["name"] for c in calls]
            for index, call in enumerate(calls):
                assert "".join(c["function"]["arguments"] for c in deltas if c["index"] == index) == call["arguments"]


@pytest.mark.parametrize(("path", "extra", "words"), [
    ("/v1/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "dependentRequired": {"a": ["b"]}}}}},
     "response_format: json: Unimplemented keys"),
    ("/v1/completions", {"guided_regex": "a(b"}, "guided_regex: regex"),
    ("/v1/completions", {"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar"),
    ("/v1/completions", {"guided_regex": "a", "guided_choice": ["a"]}, "only one structured-output constraint"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "dependentRequired": {"a": ["b"]}}}}], "tool_choice": "required"},
     "tools: lark"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"},
     "goes with no other structured-output constraint"),
])
def test_unsupported_constraints_are_a_400_before_anything_is_queued(server: ServerHandle, path: str,
                                                                      extra: dict[str, Any], words: str) -> None:
    body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    steps = server.client.stats().num_steps
    with server.http() as http:
        reply = http.post(path, json=body | extra)
    assert reply.status_code == 400, reply.text
    assert words in reply.json()["error"]["message"]
    assert server.client.stats().num_steps == steps  # refused before the engine saw it
    server.wait_until_idle()


_NO_NIXL = pytest.mark.skipif(not nixl_available(), reason="nixl_cu12 is not installed")


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["tcp", pytest.param("nixl", marks=_NO_NIXL)])
def test_pd_outputs_are_valid_and_greedy_matches_colocated(model_dirs: dict[str, Path], colocated: LLM,
                                                           transport: str) -> None:
    """Prefill samples the first token under the mask, decode continues the grammar (early first
    token on: greedy and seeded requests get prefill's token first)."""
    cluster = start_cluster(model_dirs["tiny"], transport, 1, 1, early_first_token=True, api=API)
    try:
        with httpx.Client(base_url=cluster.router.url, timeout=60) as http:
            check_served(http, colocated)
            # n > 1: decode samples the first tokens itself, each under the mask
            reply = http.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "n": 3,
                                                        "temperature": 1.0} | CASES["json"][1])
            assert reply.status_code == 200, reply.text
            for choice in reply.json()["choices"]:
                check_json(choice["text"])
            check_tool_calls(http, seeds=1)
        cluster.wait_until_idle()
    finally:
        stop_cluster(cluster)


def test_the_benchmark_runs(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                            model_dirs: dict[str, Path]) -> None:
    """`python -m pdserve.bench.structured`, tiny: a row per stream count (wall and engine-thread CPU
    rates), and the compile times."""
    from pdserve.bench import structured

    monkeypatch.setattr("sys.argv", ["structured", "--model", str(model_dirs["tiny"]), "--streams", "1,3",
                                     "--tokens", "6", "--reps", "1"])
    structured.main()
    out = capsys.readouterr().out
    assert re.search(r"^\| 3 +\| \d+ +\| \d+ +\| \d\.\d\d +\| \d+ +\| \d+ +\| \d\.\d\d +\|$", out, re.M), out
    assert "grammar compile: cold" in out


def test_a_resume_replays_every_token_sent_so_far(colocated: LLM) -> None:
    """The router's continuation after a decode loss: the sent tokens end the new prompt, and the
    matcher replays them all (after a second loss, those of both workers)."""
    from pdserve.disagg.router.outputs import continuation

    params = constrained("json", temperature=0)
    first = continuation(colocated.engine.tokenizer, params, [90, 91, 92], "")
    assert first.structured_replay == 3 and first.structured == params.structured
    assert continuation(colocated.engine.tokenizer, first, [93, 94], "").structured_replay == 5
    free = SamplingParams(max_tokens=MAX_TOKENS)
    assert continuation(colocated.engine.tokenizer, free, [93, 94], "").structured_replay == 0


@pytest.mark.slow
def test_tensor_parallel_outputs_match_one_process(model_dirs: dict[str, Path], colocated: LLM) -> None:
    """TP=2: rank 0 samples under the masks; greedy text as one process's."""
    tp = LLM(model=str(model_dirs["tiny"]), dtype="float32", tensor_parallel_size=2, num_threads=1,
             num_kv_blocks=64)
    try:
        for kind in sorted(CASES):
            params = constrained(kind, temperature=0)
            want = [o.outputs[0].text for o in colocated.generate(token_prompts(PROMPTS), params)]
            got = [o.outputs[0].text for o in tp.generate(token_prompts(PROMPTS), params)]
            assert got == want
            for text in got:
                CASES[kind][2](text)
    finally:
        tp.engine.close()


def test_the_packed_bitmask_crosses_to_the_device_not_the_expanded_mask() -> None:
    """`MaskFiller.apply` copies the int32 bitmask (a bit a token) to the logits' device and expands it
    there: the [rows, vocab] bools would be 32 times as many bytes. Logits on `meta` stand in for a GPU."""
    from torch.utils._python_dispatch import TorchDispatchMode

    copied: list[tuple[torch.dtype, tuple[int, ...]]] = []

    class Copies(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kwargs = kwargs or {}
            if func is torch.ops.aten._to_copy.default and kwargs.get("device") == torch.device("meta"):
                copied.append((args[0].dtype, tuple(args[0].shape)))
            return func(*args, **kwargs)

    vocab, rows = 1000, 3
    allowed = torch.rand(rows, vocab, generator=torch.Generator().manual_seed(0)) < 0.5
    logits = torch.zeros(4, vocab, device="meta")
    with Copies():
        MaskFiller().apply(logits, [0, 2, 3], _bitmask(allowed))
    assert (torch.int32, (rows, (vocab + 31) // 32)) in copied
    assert all(dtype != torch.bool for dtype, _ in copied), copied
