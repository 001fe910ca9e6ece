"""How pdserve picked its grammar library: llguidance against xgrammar on Qwen3's real vocabulary
(151,669 tokens, the bundled tiktoken ranks), on CPU. Needs both installed (only llguidance is a
dependency): `pip install xgrammar llguidance` (xgrammar's own dependencies add triton; torch is
left as it is).

    python scripts/compare_grammar_libs.py

Per library: building its tokenizer, compiling a realistic JSON schema (nested object, patterns,
enums, bounds) and a second one, the per-token mask time stepping through a valid 77-token
instance of it, and whether schema features it does not implement are refused.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from pdserve.tokenizer import load_tokenizer

VOCAB = 151936  # the model's logits width (the tokenizer's 151,669 padded)
SCHEMA: dict[str, Any] = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "vip", "new"]}, "maxItems": 5},
    "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["street", "city", "zip"], "additionalProperties": False},
    "active": {"type": "boolean"}, "score": {"type": "number"}},
    "required": ["name", "age", "email", "tags", "address", "active", "score"], "additionalProperties": False}
INSTANCE = {"name": "Ada Lovelace", "age": 36, "email": "ada@math.com", "tags": ["vip", "a"],
            "address": {"street": "12 St James Square", "city": "London", "zip": "12345"}, "active": True,
            "score": 99.5}
UNSUPPORTED = [{"type": "object", "dependentRequired": {"a": ["b"]}}, {"$ref": "http://example.com/s.json"}]

tokenizer = load_tokenizer(None)
EOS = list(tokenizer.eos_token_ids)
SPECIAL = {i for i in range(tokenizer.vocab_size) if tokenizer.is_special(i)}
RAW = [tokenizer.token_bytes(i, skip_special_tokens=False) for i in range(tokenizer.vocab_size)]
TEXT = json.dumps(INSTANCE)
IDS = tokenizer.encode(TEXT)


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def llguidance_row() -> list[str]:
    import llguidance
    import llguidance.torch as lt

    class Wrapped:
        eos_token_id, bos_token_id = EOS[0], None
        tokens = [b"\xff" + raw if i in SPECIAL else raw for i, raw in enumerate(RAW)] + \
            [b"\xff<|pad%d|>" % i for i in range(VOCAB - len(RAW))]
        special_token_ids = sorted(SPECIAL) + list(range(len(RAW), VOCAB))

        def __call__(self, text: bytes) -> list[int]:
            return tokenizer.encode(text.decode())

    lltok, t_tok = timed(lambda: llguidance.LLTokenizer(llguidance.TokenizerWrapper(Wrapped()), eos_token=EOS))

    def compile_(schema: dict[str, Any]) -> Any:
        return llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema)))

    matcher, t_compile = timed(lambda: compile_(SCHEMA))
    _, t_second = timed(lambda: compile_(SCHEMA | {"title": "second"}))
    mask = lt.allocate_token_bitmask(1, VOCAB)
    times = []
    for token in IDS:
        times.append(timed(lambda: lt.fill_next_token_bitmask(matcher, mask, 0))[1])
        assert matcher.consume_token(token)
    refused = sum(bool(llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(s)))) for s in UNSUPPORTED)
    return row("llguidance", t_tok, t_compile, t_second, times, refused)


def xgrammar_row() -> list[str]:
    import xgrammar as xgr

    info, t_tok = timed(lambda: xgr.TokenizerInfo(RAW, xgr.VocabType.RAW, vocab_size=VOCAB, stop_token_ids=EOS))
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    compiled, t_compile = timed(lambda: compiler.compile_json_schema(json.dumps(SCHEMA)))
    _, t_second = timed(lambda: compiler.compile_json_schema(json.dumps(SCHEMA | {"title": "second"})))
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, VOCAB)
    times = []
    for token in IDS:
        times.append(timed(lambda: matcher.fill_next_token_bitmask(mask, 0))[1])
        assert matcher.accept_token(token)
    refused = 0
    for schema in UNSUPPORTED:
        try:
            compiler.compile_json_schema(json.dumps(schema))
        except Exception:  # noqa: BLE001 - any refusal counts
            refused += 1
    return row("xgrammar", t_tok, t_compile, t_second, times, refused)


def row(name: str, t_tok: float, t_compile: float, t_second: float, times: list[float], refused: int) -> list[str]:
    times = sorted(times)
    return [name, f"{t_tok * 1e3:.0f}", f"{t_compile * 1e3:.1f}", f"{t_second * 1e3:.1f}",
            f"{times[len(times) // 2] * 1e6:.0f}", f"{sum(times) / len(times) * 1e6:.0f}", f"{times[-1] * 1e6:.0f}",
            f"{refused}/{len(UNSUPPORTED)}"]


if __name__ == "__main__":
    from pdserve.bench.common import hardware_line, print_table

    print(hardware_line())
    print(f"{len(IDS)} tokens of JSON, vocabulary {len(RAW)} (masks {VOCAB} wide)\n")
    print_table(["library", "tokenizer ms", "compile ms", "2nd schema ms", "mask median us", "mask mean us",
                 "mask max us", "unsupported refused"], [llguidance_row(), xgrammar_row()])
