"""Structured outputs' cost: decode throughput with a JSON schema against without, at 1 and 32
concurrent streams, and grammar compile time, measured in one run (the ratios are what count).

    python -m pdserve.bench.structured [--model DIR] [--streams 1,32] [--tokens 64] [--reps 3]

Each stream is one request of `--tokens` output tokens (ignore_eos); the free and constrained runs
alternate, best of `--reps` each, in tokens per second of wall time and per second of the engine
thread's CPU time (what a loaded machine's other processes change least; the grammar thread's
time is not in it: it is hidden where a core is free). The constrained run uses a
realistic schema (an array of person records: strings with patterns and lengths, integers,
enums, booleans, a nested object) whose `minItems` no stream can reach in `--tokens`, so every
request decodes exactly `--tokens` tokens, as the free run does: the same work, plus the masks.
The first constrained request of an engine builds llguidance's tokenizer (~0.4 s) and warms its
token trie: done before timing. Compile time: a schema never seen before (cold: llguidance
compiles it) and one in the cache (a copy of its compiled matcher), against one decode step of
one stream.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from pdserve import LLM, SamplingParams
from pdserve.bench.common import hardware_line, print_table
from pdserve.engine.llm import TokensPrompt
from pdserve.engine.structured import StructuredOutput, grammar_of
from pdserve.model.demo_checkpoint import default_model_dir

_PAD_ID = 151643


def person_schema(tag: str = "", min_items: int = 1000) -> dict[str, Any]:
    """An array of person records; `tag` renames a field (a schema the caches have not seen)."""
    person = {"type": "object", "properties": {
        f"name{tag}": {"type": "string", "minLength": 1, "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.(com|org|net)$"},
        "tags": {"type": "array", "items": {"enum": ["vip", "new", "churned", "trial"]}, "maxItems": 4},
        "address": {"type": "object", "properties": {"street": {"type": "string", "maxLength": 60},
                                                     "city": {"type": "string", "maxLength": 30},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["street", "city", "zip"], "additionalProperties": False},
        "active": {"type": "boolean"}, "score": {"type": "number"}},
        "required": [f"name{tag}", "age", "email", "tags", "address", "active", "score"],
        "additionalProperties": False}
    return {"type": "object", "properties": {"people": {"type": "array", "items": person,
                                                        "minItems": min_items}},
            "required": ["people"], "additionalProperties": False}


def decode_rate(llm: LLM, streams: int, tokens: int, structured: StructuredOutput | None, reps: int
                ) -> tuple[float, float]:
    """Output tokens per second of `streams` concurrent requests of `tokens` tokens (best of `reps`):
    per second of wall time, and per second of the engine thread's CPU time (the steps run in this
    thread; the mask thread's time is not in it: hidden where a core is free)."""
    prompts = [TokensPrompt(prompt_token_ids=[(97 * i + 13 * j) % _PAD_ID for j in range(16)])
               for i in range(streams)]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, structured=structured)
    best = best_cpu = 0.0
    for _ in range(reps):
        start, start_cpu = time.perf_counter(), time.thread_time()
        outputs = llm.generate(prompts, params)
        elapsed, cpu = time.perf_counter() - start, time.thread_time() - start_cpu
        assert all(len(o.outputs[0].token_ids) == tokens for o in outputs), "a stream ended early"
        best = max(best, streams * tokens / elapsed)
        best_cpu = max(best_cpu, streams * tokens / cpu)
    return best, best_cpu


def compile_times_s(llm: LLM, reps: int) -> tuple[float, float]:
    """(cold: a schema never seen, cached: one the engine compiled before), median seconds."""
    grammars = llm.engine.grammars
    cold, cached = [], []
    for rep in range(reps):
        spec = StructuredOutput("json", json.dumps(person_schema(tag=f"_{time.time_ns()}_{rep}")))
        start = time.perf_counter()
        grammar_of(spec)
        grammars.matcher(spec)
        cold.append(time.perf_counter() - start)
        start = time.perf_counter()
        grammars.matcher(spec)
        cached.append(time.perf_counter() - start)
    return sorted(cold)[len(cold) // 2], sorted(cached)[len(cached) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the tiny demo checkpoint)")
    parser.add_argument("--streams", default="1,32", help="concurrent streams, comma-separated")
    parser.add_argument("--tokens", type=int, default=64, help="output tokens per stream")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    model = args.model or str(default_model_dir())
    engine_args: dict[str, Any] = {"dtype": "float32", "num_kv_blocks": 1024}
    if args.threads:
        engine_args["num_threads"] = args.threads
    llm = LLM(model=model, **engine_args)
    spec = StructuredOutput("json", json.dumps(person_schema()))
    decode_rate(llm, 1, 8, spec, 1)  # warm-up: llguidance's tokenizer, the schema's compile, the trie
    decode_rate(llm, 1, 8, None, 1)
    rows = []
    one_step_s = 0.0
    for streams in (int(s) for s in args.streams.split(",")):
        free = schema = free_cpu = schema_cpu = 0.0
        for _ in range(args.reps):  # NOTE: interleaved, so a change in the machine's load hits both
            wall, cpu = decode_rate(llm, streams, args.tokens, None, 1)
            free, free_cpu = max(free, wall), max(free_cpu, cpu)
            wall, cpu = decode_rate(llm, streams, args.tokens, spec, 1)
            schema, schema_cpu = max(schema, wall), max(schema_cpu, cpu)
        if streams == 1:
            one_step_s = 1 / free
        rows.append([str(streams), f"{free:.0f}", f"{schema:.0f}", f"{schema / free:.2f}", f"{free_cpu:.0f}",
                     f"{schema_cpu:.0f}", f"{schema_cpu / free_cpu:.2f}"])
    cold_s, cached_s = compile_times_s(llm, args.reps)
    print(hardware_line())
    print(f"model {model}, {args.tokens} tokens per stream, best of {args.reps}\n")
    print_table(["streams", "free tok/s", "JSON schema tok/s", "schema / free", "free tok/CPU-s",
                 "schema tok/CPU-s", "schema / free (CPU)"], rows)
    step = f" ({cold_s / one_step_s:.2f} / {cached_s / one_step_s:.3f} decode steps of one stream)" \
        if one_step_s else ""
    print(f"\ngrammar compile: cold {cold_s * 1e3:.2f} ms, cached {cached_s * 1e3:.3f} ms{step}")


if __name__ == "__main__":
    main()
