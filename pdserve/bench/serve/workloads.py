"""What `pdserve bench` sends, and when: request specs (prompt, lengths) and arrival times.

Every builder is a pure function of its arguments and `seed`: the same command sends the same
prompts in the same order at the same offsets, whichever server it points at, which is what makes
two runs comparable.

Prompts are token-id lists by default, so input lengths are exact on servers that accept them in
`/v1/completions` (pdserve, vLLM, SGLang). `--prompt-format text` (and the chat endpoint) sends
text instead: one common English word per intended token, which most BPE tokenizers encode as
about one token each; the usage block then reports the real count.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# NOTE: the seed's mix: 500/2000/5000-token prompts at 6:3:1; 500 output tokens
# (the seed's headline run is 2.3K in / 500 out).
SEED_MIX_INPUT_LENS = (500, 2000, 5000)
SEED_MIX_WEIGHTS = (6, 3, 1)
SEED_MIX_OUTPUT_LEN = 500
# Token ids are drawn from [_MIN_TOKEN_ID, vocab_size): low ids are often bytes/specials in BPE vocabularies.
_MIN_TOKEN_ID = 100
# Words that BPE tokenizers (GPT-2, Llama, Qwen) encode as one token each, with the leading space.
_WORDS = ("the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with", "was", "on", "be", "at",
          "by", "this", "from", "or", "an", "are", "not", "but", "have", "one", "all", "new", "more", "time",
          "can", "will", "about", "there", "so", "what", "out", "up", "when", "some", "if", "no", "two")


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request to send: the prompt (token ids or text), its intended length, and exactly how
    many tokens to ask for (sent with `ignore_eos`, so the server generates all of them)."""

    prompt: list[int] | str
    prompt_len: int  # exact for token ids; the intended length for text (the usage block corrects it)
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Workload:
    name: str  # e.g. "seed-mix x0.02", printed in the report
    requests: tuple[RequestSpec, ...]


@dataclass(frozen=True, slots=True)
class PromptKind:
    """What prompts are made of: token ids in [_MIN_TOKEN_ID, vocab_size), or (`as_text`) words
    (the module docstring)."""

    vocab_size: int = 32000
    as_text: bool = False


TOKEN_IDS = PromptKind()


def scaled(length: int, scale: float, minimum: int = 1) -> int:
    return max(minimum, round(length * scale))


def _prompt(rng: np.random.Generator, length: int, kind: PromptKind) -> list[int] | str:
    if kind.as_text:
        return " ".join(_WORDS[i] for i in rng.integers(0, len(_WORDS), length))
    return rng.integers(_MIN_TOKEN_ID, kind.vocab_size, length).tolist()


def mix_counts(num_requests: int, weights: tuple[int, ...]) -> list[int]:
    """Requests per class, proportional to `weights` (largest remainder): 10 at 6:3:1 -> 6, 3, 1 exactly."""
    total = sum(weights)
    exact = [num_requests * w / total for w in weights]
    counts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (counts[i] - exact[i], i))
    for i in by_remainder[:num_requests - sum(counts)]:
        counts[i] += 1
    return counts


def seed_mix(num_requests: int, scale: float = 1.0, output_len: int | None = None, seed: int = 0,
             kind: PromptKind = TOKEN_IDS) -> Workload:
    """The seed's prompt mix, every length multiplied by `scale` (a 2-core CPU cannot prefill
    5000-token prompts at concurrency 150; --scale 0.05 keeps the shape at 25/100/250 tokens).
    `output_len` (not scaled when given) defaults to the seed's 500 scaled."""
    rng = np.random.default_rng(seed)
    out_len = output_len if output_len is not None else scaled(SEED_MIX_OUTPUT_LEN, scale, minimum=2)
    lens = [scaled(n, scale) for n, count in zip(SEED_MIX_INPUT_LENS, mix_counts(num_requests, SEED_MIX_WEIGHTS),
                                                 strict=True) for _ in range(count)]
    rng.shuffle(lens)
    specs = tuple(RequestSpec(_prompt(rng, n, kind), n, out_len) for n in lens)
    return Workload(f"seed-mix x{scale:g}", specs)


def random_lengths(num_requests: int, input_len: int, output_len: int, range_ratio: float = 0.0, seed: int = 0,
                   kind: PromptKind = TOKEN_IDS) -> Workload:
    """vLLM's `random` dataset: lengths uniform in [len * (1 - r), len * (1 + r)]."""
    rng = np.random.default_rng(seed)

    def draw(length: int) -> int:
        low, high = max(1, math.floor(length * (1 - range_ratio))), max(1, math.ceil(length * (1 + range_ratio)))
        return int(rng.integers(low, high + 1))

    specs = []
    for _ in range(num_requests):
        n = draw(input_len)
        specs.append(RequestSpec(_prompt(rng, n, kind), n, max(1, draw(output_len))))
    return Workload(f"random in={input_len} out={output_len} ratio={range_ratio:g}", tuple(specs))


@dataclass(frozen=True, slots=True)
class SharedPrefixes:
    """`count` prefixes of `length` tokens that the prompts of a shared-prefix workload share."""

    length: int
    count: int = 1


def shared_prefix(num_requests: int, prefixes_: SharedPrefixes, suffix_len: int, output_len: int, seed: int = 0,
                  kind: PromptKind = TOKEN_IDS) -> Workload:
    """Every prompt is one of the shared prefixes + its own suffix (prefix caching's workload)."""
    prefix_len, num_prefixes = prefixes_.length, prefixes_.count
    rng = np.random.default_rng(seed)
    prefixes = [_prompt(rng, prefix_len, kind) for _ in range(num_prefixes)]
    specs = []
    for i in range(num_requests):
        prefix, suffix = prefixes[i % num_prefixes], _prompt(rng, suffix_len, kind)
        prompt = f"{prefix} {suffix}" if kind.as_text else [*prefix, *suffix]
        specs.append(RequestSpec(prompt, prefix_len + suffix_len, output_len))
    return Workload(f"shared-prefix {num_prefixes}x{prefix_len} + {suffix_len}", tuple(specs))


def _estimate_tokens(text: str) -> int:
    return max(1, len(text) // 4)  # ~4 characters per token in English BPE vocabularies


def sharegpt(path: Path, num_requests: int, seed: int = 0, output_len: int | None = None,
             count_tokens: Callable[[str], int] | None = None) -> Workload:
    """ShareGPT-format JSON (`[{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}]`):
    the first turn is the prompt, the second turn's length the output length. Filtered like vLLM's:
    prompt and reply of at least 4 tokens, prompt at most 1024, together at most 2048. Without a
    tokenizer, lengths are estimated at 4 characters a token."""
    count = count_tokens or _estimate_tokens
    entries = json.loads(Path(path).read_text())
    order = np.random.default_rng(seed).permutation(len(entries))
    specs: list[RequestSpec] = []
    for i in order:
        turns = entries[int(i)].get("conversations") or entries[int(i)].get("conversation") or []
        if len(turns) < 2:
            continue
        prompt, reply = str(turns[0].get("value", "")), str(turns[1].get("value", ""))
        prompt_len, reply_len = count(prompt), output_len or count(reply)
        if prompt_len < 4 or reply_len < 4 or prompt_len > 1024 or prompt_len + reply_len > 2048:
            continue
        specs.append(RequestSpec(prompt, prompt_len, reply_len))
        if len(specs) == num_requests:
            break
    if not specs:
        raise ValueError(f"{path}: no usable ShareGPT conversation")
    return Workload(f"sharegpt {Path(path).name}", tuple(specs))


def arrival_offsets_s(num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """When each request is sent, in seconds after the start. Gaps are gamma-distributed with mean
    1 / rate and shape `burstiness` (vLLM's --burstiness): 1 is a Poisson process, below 1 burstier,
    above 1 more regular. An infinite rate sends everything at once (the concurrency cap then paces)."""
    if math.isinf(request_rate):
        return [0.0] * num_requests
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be > 0")
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (request_rate * burstiness), num_requests)
    gaps[0] = 0.0  # the first request leaves at once
    return np.cumsum(gaps).tolist()
