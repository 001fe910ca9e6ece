"""Logprob records: a sampled token's (`TokenLogprobs`) and a prompt token's (`PromptLogprobs`).
The sampler makes them, requests and outputs carry them, the wire formats encode them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), best first


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """A prompt token's logprob under the model given the tokens before it, its rank (1: the
    model's first choice) and the top alternatives, (token id, logprob) best first."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]
