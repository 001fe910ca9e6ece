"""Structured outputs: decoding constrained to a JSON schema, a regex, a choice or a grammar, with
llguidance (docs/BENCHMARKS.md has why: it names the schema features it does not support, where
xgrammar ignores them; compiles in ~1 ms; needs no other package).

A request's constraint is a `StructuredOutput` in its SamplingParams: a kind and a text, plain
strings, so it crosses processes and the network as the rest of the params do. Each engine turns
it into a matcher (`GrammarCache.matcher`; compiled grammars are cached, a new request's matcher is
a copy of the cached one) that lives on the `Request` and advances with every token appended to it
(`Request.append_token`). A resumed request (another decode worker, after a loss) rebuilds the
matcher exactly by replaying the output tokens already generated, which are the last
`SamplingParams.structured_replay` tokens of its prompt. The sampler fills one bitmask for all the
constrained rows of a batch with llguidance's batch call, beside the model's forward, and applies it
in the batch (`MaskFiller`: on CPU a greedy row's argmax is checked against its mask, and a row
whose best token is refused is answered from a few gathered tokens where that is exact, else
masked; on a GPU every constrained row, in one op). The
request ends when the grammar does (EOS is allowed only where it may end).
"""

from __future__ import annotations

import functools
import json
import math
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    import llguidance

    from pdserve.tokenizer import Tokenizer

# kind -> what `text` holds
KINDS = {
    "json": "a JSON schema (as JSON text)",
    "json_object": "nothing: any JSON object",
    "regex": "a regular expression (Rust regex syntax: no look-around, no backreferences)",
    "choice": "a JSON list of strings: the output is one of them",
    "grammar": "a grammar, in Lark or GBNF (EBNF) syntax",
    "lark": "a Lark grammar (llguidance's dialect: %json {schema} embeds a schema)",
}
_CACHE_SIZE = 256
# Compact JSON ("," and ":", no whitespace between tokens), not any whitespace anywhere: a model may
# otherwise spend its tokens on whitespace (random weights do, to max_tokens). A schema's own
# "x-guidance" options win.
_JSON_OPTIONS: Any = {"whitespace_flexible": False}


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """What a request's output must match: plain strings (serializable as they are)."""

    kind: str
    text: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind {self.kind!r} is none of {sorted(KINDS)}")
        if not isinstance(self.text, str):
            raise ValueError("structured output text must be a string")

    @classmethod
    def of(cls, value: StructuredOutput | dict[str, Any] | Sequence[str] | None) -> StructuredOutput | None:
        """From what the wire carries (a dict from JSON, a [kind, text] list from msgpack)."""
        if value is None or isinstance(value, StructuredOutput):
            return value
        if isinstance(value, dict):
            return cls(**value)
        kind, text = value
        return cls(kind, text)


def _llguidance_grammar(spec: StructuredOutput) -> str:
    """The spec as an llguidance grammar (ValueError for one that cannot be one)."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    if spec.kind == "json":
        return _json_schema_grammar(spec.text)
    if spec.kind == "json_object":
        return LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTIONS)
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.text)
    if spec.kind == "choice":
        return _choice_grammar(spec.text)
    if spec.kind == "grammar":
        try:
            return LLMatcher.grammar_from_lark(any_to_lark(spec.text))
        except Exception as exc:  # noqa: BLE001 - the converter raises its own error types
            raise ValueError(f"the grammar is neither Lark nor GBNF: {exc}") from exc
    return LLMatcher.grammar_from_lark(spec.text)


def _json_schema_grammar(text: str) -> str:
    from llguidance import LLMatcher

    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"the JSON schema is no JSON: {exc}") from exc
    if not isinstance(schema, dict | bool):
        raise ValueError("a JSON schema is an object (or a boolean)")
    return LLMatcher.grammar_from_json_schema(text, defaults=_JSON_OPTIONS)


def _choice_grammar(text: str) -> str:
    from llguidance import LLMatcher

    try:
        choices = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"choice: not a JSON list: {exc}") from exc
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("choice: a non-empty list of non-empty strings")
    return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))


@functools.lru_cache(maxsize=_CACHE_SIZE)
def grammar_of(spec: StructuredOutput) -> str:
    """The spec's llguidance grammar, checked: ValueError naming what is wrong with it (a schema
    feature llguidance does not support, an invalid regex or grammar). No tokenizer needed: the
    server checks a request with it before anything is queued (engine.llm_engine.check_request)."""
    from llguidance import LLMatcher

    try:
        grammar = _llguidance_grammar(spec)
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever llguidance raises for a spec, the client's 400
        raise ValueError(f"{spec.kind}: {exc}") from exc
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"{spec.kind}: {error.strip()}")
    return grammar


def check_structured(spec: StructuredOutput | None) -> None:
    """ValueError for a constraint no engine can follow (`grammar_of`)."""
    if spec is not None:
        grammar_of(spec)


class GrammarCache:
    """One engine's compiled grammars (LRU by spec), for its tokenizer and logits width."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width (the model's vocabulary, padded)
        self._lock = threading.Lock()
        self._lltokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[StructuredOutput, llguidance.LLMatcher] = OrderedDict()

    def _llguidance_tokenizer(self) -> llguidance.LLTokenizer:
        """Built on first use (~0.4 s for Qwen3's 151k tokens): ids past the tokenizer's vocabulary
        (the model's padding) are special tokens no grammar ever allows."""
        if self._lltokenizer is None:
            import llguidance

            tokenizer = self._tokenizer
            count = tokenizer.vocab_size
            special = [i for i in range(count) if tokenizer.is_special(i)]
            special_set = set(special)
            tokens = [(b"\xff" if i in special_set else b"") + tokenizer.token_bytes(i, skip_special_tokens=False)
                      for i in range(count)]
            tokens += [b"\xff<|pdserve_pad_%d|>" % i for i in range(count, self.vocab_size)]

            class _Wrapped:
                eos_token_id = tokenizer.eos_token_ids[0]
                bos_token_id = None

                def __init__(self) -> None:
                    self.tokens = tokens
                    self.special_token_ids = special + list(range(count, len(tokens)))

                def __call__(self, text: bytes | str) -> list[int]:
                    return tokenizer.encode(text.decode("utf-8", errors="replace") if isinstance(text, bytes)
                                            else text)

            self._lltokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Wrapped()),
                                                       eos_token=list(tokenizer.eos_token_ids))
        return self._lltokenizer

    def matcher(self, spec: StructuredOutput, replay: Sequence[int] = ()) -> llguidance.LLMatcher:
        """A fresh matcher for `spec` that has consumed `replay` (a resumed request's output so far);
        ValueError when the spec is invalid or `replay` does not match it."""
        import llguidance

        with self._lock:
            compiled = self._compiled.get(spec)
            if compiled is None:
                compiled = llguidance.LLMatcher(self._llguidance_tokenizer(), grammar_of(spec), log_level=0)
                if compiled.is_error():
                    raise ValueError(f"{spec.kind}: {compiled.get_error()}")
                self._compiled[spec] = compiled
                while len(self._compiled) > _CACHE_SIZE:
                    self._compiled.popitem(last=False)
            self._compiled.move_to_end(spec)
            matcher = compiled.deep_copy()
        for token_id in replay:
            if not matcher.consume_token(token_id):
                raise ValueError(f"the tokens generated so far do not match the {spec.kind} constraint")
        return matcher


class MaskFiller:
    """Fills and applies the masks of a batch's constrained rows: one bitmask filled by
    llguidance's batch call (not a Python loop over rows or the vocabulary), on a thread of its own
    while the model computes the step's logits (`start`, before the forward). Applied: greedy rows
    on CPU by `argmax` (the unmasked argmax where the mask allows it, else the best allowed of a
    few gathered tokens where that is exact, else the row plus a 0/-inf bias); the other rows by
    `apply` (unpacked with one table lookup, a byte of the bitmask -> the 8 bools of its tokens as
    one int64, and one `masked_fill_`)."""

    def __init__(self, num_threads: int = 1) -> None:
        self._num_threads = num_threads
        self._executor: llguidance.LLExecutor | None = None
        self._thread: ThreadPoolExecutor | None = None
        # for every byte value x: 8 bytes, byte b = 1 where bit b of x is 0 (that token is refused)
        refused = ((torch.arange(256)[:, None] >> torch.arange(8)[None, :]) & 1) == 0
        self._refused = refused.to(torch.uint8).contiguous().view(torch.int64).view(256)
        # the same as 8 floats: -inf where refused, 0 where allowed (a logit plus its bias)
        self._bias = torch.where(refused, float("-inf"), 0.0).float().contiguous()
        self._buffers: dict[str, torch.Tensor] = {}  # NOTE: reused: a new 20 MB tensor a step faults its pages in

    def _buffer(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        numel = math.prod(shape)
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < numel or buffer.dtype != like.dtype or buffer.device != like.device:
            buffer = self._buffers[name] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buffer[:numel].view(shape)

    def start(self, matchers: list[llguidance.LLMatcher], vocab: int) -> Future[torch.Tensor]:
        """The bitmask of these matchers' next tokens (a row each, in order), being filled."""
        if self._thread is None:
            import llguidance

            self._executor = llguidance.LLExecutor(self._num_threads)
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="pdserve-grammar")
        return self._thread.submit(self._fill, matchers, vocab)

    def _fill(self, matchers: list[llguidance.LLMatcher], vocab: int) -> torch.Tensor:
        assert self._executor is not None
        bitmask = torch.zeros((len(matchers), (vocab + 31) // 32), dtype=torch.int32)
        # NOTE: what llguidance.torch.fill_next_token_bitmask_par does (that module compiles a
        # kernel with torch.compile when imported): one call, the rows' masks written in place
        self._executor.unsafe_compute_mask_ptr(list(zip(matchers, range(len(matchers)), strict=True)),
                                               bitmask.data_ptr(), bitmask.shape[1] * 4, len(matchers))
        return bitmask

    def refused(self, bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
        """[rows, vocab] bools, True where the bitmask row does not allow the token: one table
        lookup (a byte of the bitmask -> the 8 bools of its tokens, as one int64)."""
        # NOTE: little-endian words: byte j of word w holds the bits of tokens 32w + 8j ... + 7
        if self._refused.device != bitmask.device:  # NOTE: moved once, not copied to the device every step
            self._refused = self._refused.to(bitmask.device)
        table = self._refused
        refused = table.index_select(0, bitmask.contiguous().view(torch.uint8).view(-1).int())
        return refused.view(torch.bool).view(bitmask.shape[0], -1)[:, :vocab]

    @staticmethod
    def allows(bitmask: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Whether each bitmask row allows its token (one int64 token a row): a bool a row."""
        words = bitmask.gather(1, (tokens >> 5)[:, None])[:, 0]
        return ((words >> (tokens & 31)) & 1).bool()

    def apply(self, logits: torch.Tensor, rows: list[int], bitmask: Future[torch.Tensor] | torch.Tensor
              ) -> torch.Tensor:
        """`logits` with every token a row's bitmask does not allow at -inf, in place (the
        sampler's logits are its own: the logprobs were taken before)."""
        if isinstance(bitmask, Future):
            bitmask = bitmask.result()
        # NOTE: the packed bitmask crosses to the device (a bit a token), then is expanded there: the
        # expanded rows would be 32 times as many bytes to copy
        refused = self.refused(bitmask.to(logits.device, non_blocking=True), logits.shape[-1])
        if len(rows) == logits.shape[0]:  # every row constrained: the rows are 0..n-1, in order
            return logits.masked_fill_(refused, float("-inf"))
        index = torch.tensor(rows, device=logits.device)
        logits[index] = logits[index].masked_fill_(refused, float("-inf"))
        return logits

    def argmax(self, logits: torch.Tensor, tokens: torch.Tensor, rows: list[int], bitmask: torch.Tensor,
               maxima: torch.Tensor | None = None) -> None:
        """Greedy constrained rows: `tokens[rows[i]]`, the argmax of logits row `rows[i]`, becomes
        the argmax over the tokens bitmask row i allows, in place: the very token `row_argmax` of
        the masked row gives, without masking every row. Where a row's argmax (its first best
        token) is allowed, it is the masked row's too. The other rows, on CPU with `maxima` (the
        logits' `chunk_maxima`) and at least `_GATHER_MIN_ROWS` of them, are first looked for in a
        few gathered tokens (`_gathered_argmax`: exact where it answers); the rest get a bias
        added to their logits, in place (0 or -inf a token, by a table lookup of the bitmask's
        bytes: an add is much faster than a masked_fill on CPU), whose argmax is the masked row's
        wherever it is an allowed token (a refused token wins only where its logit is NaN or +inf:
        those rows are then masked as well)."""
        index = torch.tensor(rows, device=tokens.device)
        bitmask = bitmask.to(tokens.device, non_blocking=True)
        refused = (~self.allows(bitmask, tokens[index])).nonzero()[:, 0]
        if not len(refused):
            return
        bad = index[refused]
        vocab = logits.shape[-1]
        if maxima is not None and bitmask.shape[1] * 32 >= vocab and len(refused) >= _GATHER_MIN_ROWS:
            exact, best = _gathered_argmax(logits, bad, bitmask, refused, maxima, self._bias.to(logits))
            exact &= ~logits[bad, tokens[bad]].isnan()  # NOTE: a row holding a NaN: its argmax is the first one
            tokens[bad[exact]] = best[exact]
            rest = (~exact).nonzero()[:, 0]
            if not len(rest):
                return
            bad, refused = bad[rest], refused[rest]
        words = bitmask[refused]
        byte_values = words.contiguous().view(torch.uint8).view(-1).int()
        bias = torch.index_select(self._bias.to(logits), 0, byte_values,
                                  out=self._buffer("bias", (len(byte_values), 8), logits)).view(len(bad), -1)
        # NOTE: in place (the sampler's logits are its own: the logprobs were taken before): an
        # allowed token keeps its logit (x + 0), a refused one gets -inf (NaN from NaN or +inf)
        for k, row in enumerate(bad.tolist()):
            logits[row].add_(bias[k, :vocab])
        best = row_argmax(logits)[bad] if 2 * len(bad) >= len(logits) else row_argmax(logits[bad])
        wrong = (~self.allows(words, best)).nonzero()[:, 0]
        if len(wrong):
            masked = logits[bad[wrong]].masked_fill_(self.refused(words[wrong], vocab), float("-inf"))
            best[wrong] = row_argmax(masked)
        tokens[bad] = best


_CHUNK = 128
_NUMPY_FLOATS = (torch.float32, torch.float64)
_NUMPY_ARGMAX_MAX = 1 << 18  # `_numpy_argmax`: values past which torch's threads beat numpy's one
_TOP_CHUNKS = 32  # `_gathered_argmax`: the chunks of 128 tokens gathered for a row, best first
_GATHER_MIN_ROWS = 3  # ... where this many rows of a step are refused (1-2 rows: the bias pass is as fast)
_SPARSE_WORDS = 64  # ... and a row whose mask has at most this many non-zero words: those words' tokens
_BITS = torch.arange(32, dtype=torch.int32)


def chunk_maxima(x: torch.Tensor) -> torch.Tensor | None:
    """The max of each chunk of 128 tokens of a 2-d tensor's rows ([rows, width / 128]; NaN
    where a chunk holds one), or None where `row_argmax` does not use chunks (not on CPU, a width
    that is no multiple of 128, no rows)."""
    rows, width = x.shape
    if x.device.type != "cpu" or width % _CHUNK or not x.is_contiguous() or not rows:
        return None
    return x.view(rows, width // _CHUNK, _CHUNK).amax(dim=-1)


def row_argmax(x: torch.Tensor, maxima: torch.Tensor | None = None) -> torch.Tensor:
    """`x.argmax(dim=-1)` of a 2-d tensor, the same indices (the first best; the first NaN), in a
    fraction of its time on CPU, where torch's argmax is ~8x slower than its amax: the first chunk
    of 128 holding a row's max (amax over the chunks: `chunk_maxima`, or `maxima` where the caller
    has them), then the argmax within it."""
    if _numpy_argmax(x):
        return torch.from_numpy(np.argmax(x.detach().numpy(), axis=1))
    if maxima is None:
        maxima = chunk_maxima(x)
        if maxima is None:
            return _first_max_index(x)
    rows = x.shape[0]
    chunks = x.view(rows, -1, _CHUNK)
    best = _first_max_index(maxima)
    return best * _CHUNK + _first_max_index(chunks[torch.arange(rows), best])


def _numpy_argmax(x: torch.Tensor) -> bool:
    """Whether numpy's argmax takes `x`'s (the same indices: the first best, the first NaN). On CPU,
    float32 or float64, it runs SIMD and is 9x faster than the chunks at a few hundred tokens a row
    (256 x 256: 11 against 100 µs), ~10 % faster on one thread at the real vocabulary; on more
    threads torch's parallel amax wins past ~2^18 values (64 x 151,936: 1.4 against 2.1 ms)."""
    return (x.device.type == "cpu" and x.dtype in _NUMPY_FLOATS and x.dim() == 2 and x.shape[1] > 0
            and (x.numel() <= _NUMPY_ARGMAX_MAX or torch.get_num_threads() == 1))


def _first_max_index(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)`. NOTE: on CPU `max(dim).indices`, the same index (the first best, the
    first NaN: tests/test_structured_outputs.py) in half argmax's time there."""
    return x.max(dim=-1).indices if x.device.type == "cpu" else x.argmax(dim=-1)


def _gathered_argmax(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor, mask_rows: torch.Tensor,
                     maxima: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact, best): for each logits row `rows[i]` (its mask: bitmask row `mask_rows[i]`; its
    chunk maxima: `maxima[rows[i]]`; `bias`: the byte -> 8 biases table of `MaskFiller`), the
    argmax of the row with every token its mask refuses at -inf, wherever `exact` says it is that
    argmax (elsewhere best is to be ignored), from a few tokens gathered a row instead of a pass
    over the whole row.

    First the tokens of its `_TOP_CHUNKS` chunks of 128 with the highest maxima, plus their bias
    (0 allowed, -inf refused). Their best v is the masked row's max where it is greater than the
    best maximum of a chunk left out (the bound: no allowed token left out reaches it); then every
    allowed token equal to v is among those gathered, in token order, so their argmax (the first
    best) is the masked row's. Then, the rows not answered whose masks have at most
    `_SPARSE_WORDS` non-zero words: the tokens of those words, every token the row allows (the
    bound is -inf). Not exact: rows whose gathered tokens hold no allowed one above the bound (too
    few allowed in the best chunks, all -inf, a tie with the bound); a NaN among the gathered (an
    allowed one; a refused one stays NaN with its bias; a refused +inf gives NaN) or in the bound
    (topk ranks NaN above every number)."""
    n = len(rows)
    num_chunks = maxima.shape[1]
    vocab = logits.shape[-1]
    count = min(_TOP_CHUNKS, num_chunks)
    top = maxima.index_select(0, rows).topk(min(count + 1, num_chunks), dim=-1)
    bound = top.values[:, count] if count < num_chunks else torch.full((n,), float("-inf"), dtype=maxima.dtype)
    chunk_index = top.indices[:, :count].sort(dim=-1).values  # NOTE: in token order, for the first best
    values = logits.view(-1, _CHUNK).index_select(0, (rows[:, None] * num_chunks + chunk_index).view(-1))
    words = (bitmask if bitmask.shape[1] == 4 * num_chunks else bitmask[:, :4 * num_chunks]).contiguous()
    chunk_words = words.view(-1, 4).index_select(0, (mask_rows[:, None] * num_chunks + chunk_index).view(-1))
    position, value = _masked_best(values.view(n, -1), chunk_words, bias)
    exact = value > bound  # NOTE: False where either is NaN
    best = chunk_index.gather(1, (position // _CHUNK)[:, None])[:, 0] * _CHUNK + position % _CHUNK
    rest = (~exact).nonzero()[:, 0]
    if len(rest):
        rest_words = bitmask[mask_rows[rest]]
        nonzero = rest_words != 0
        is_sparse = nonzero.sum(dim=-1, dtype=torch.int32) <= _SPARSE_WORDS
        sparse = rest[is_sparse]
        if len(sparse):
            size = max(1, min(_SPARSE_WORDS, bitmask.shape[1]))
            # NOTE: every non-zero word is among the `size` largest of (word != 0); the others add 0 words
            word_index = nonzero[is_sparse].to(torch.uint8).topk(size, dim=-1).indices.sort(dim=-1).values
            token_index = (word_index[:, :, None] * 32 + _BITS.to(word_index)).view(len(sparse), -1)
            values = logits.view(-1).index_select(0, (rows[sparse, None] * vocab + token_index).view(-1))
            position, value = _masked_best(values.view(len(sparse), -1), rest_words[is_sparse].gather(1, word_index),
                                           bias)
            exact[sparse] = value > float("-inf")
            best[sparse] = token_index.gather(1, position[:, None])[:, 0]
    return exact, best


def _masked_best(values: torch.Tensor, words: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gathered logits `values` ([rows, 32 a word of `words`], the bitmask words of those tokens)
    plus their bias, in place: (the position of each row's first best, its value)."""
    rows = values.shape[0]
    values += bias.index_select(0, words.contiguous().view(torch.uint8).view(-1).int()).view(rows, -1)
    position = row_argmax(values)
    value = values.gather(1, position[:, None])[:, 0]
    return position, value
