"""`echo` and `prompt_logprobs` on /v1/completions, shaped as vLLM answers them.

- `prompt_logprobs: k` adds to each choice `prompt_logprobs`: None for the first prompt token, then
  per token {token id: {"logprob", "rank", "decoded_token"}} for the prompt token and the model's
  k best alternatives (rank 1: the model's first choice).
- `echo: true` puts the prompt's text before the completion's; with `logprobs` the prompt's tokens
  lead the `logprobs` lists too (the first one's logprob and alternatives are null).
"""

from __future__ import annotations

from typing import Any

from pdserve.engine.logprobs import PromptLogprobs, TokenLogprobs
from pdserve.tokenizer import Tokenizer

# (token id, its logprob, the alternatives): one entry of a completion's `logprobs`; the first
# echoed prompt token has neither logprob nor alternatives
Entry = tuple[int, float | None, tuple[tuple[int, float], ...] | None]


def _decoded(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def prompt_logprobs_json(tokenizer: Tokenizer, entries: list[PromptLogprobs | None]) -> list[dict[str, Any] | None]:
    out: list[dict[str, Any] | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        ranked = {entry.token_id: (entry.logprob, entry.rank)}
        for rank, (token_id, logprob) in enumerate(entry.top, start=1):
            ranked.setdefault(token_id, (logprob, rank))
        out.append({str(t): {"logprob": lp, "rank": rank, "decoded_token": _decoded(tokenizer, t)}
                    for t, (lp, rank) in ranked.items()})
    return out


def echoed_entries(prompt_token_ids: list[int], entries: list[PromptLogprobs | None]) -> list[Entry]:
    """The prompt's tokens as `logprobs` entries; each one's alternatives include itself, as vLLM's."""
    out: list[Entry] = []
    for token_id, entry in zip(prompt_token_ids, entries, strict=True):
        if entry is None:
            out.append((token_id, None, None))
        else:
            out.append((token_id, entry.logprob, ((token_id, entry.logprob),) + entry.top))
    return out


def sampled_entries(entries: list[TokenLogprobs]) -> list[Entry]:
    return [(e.token_id, e.logprob, e.top) for e in entries]


def logprobs_json(tokenizer: Tokenizer, entries: list[Entry], offset: int) -> dict[str, Any]:
    tokens = [_decoded(tokenizer, token_id) for token_id, _, _ in entries]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [logprob for _, logprob, _ in entries],
        "top_logprobs": [None if top is None else {_decoded(tokenizer, t): lp for t, lp in top}
                         for _, _, top in entries],
        "text_offset": offsets,
    }
