"""The soak's comparison with colocated: a greedy answer that parts from the reference only where
the reference's two best candidates tie is a tie broken the other way, not a wrong answer."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from pdserve.bench.soak_cluster import _TIE_LOGPROB, _parted_at_a_tie
from pdserve.engine.logprobs import TokenLogprobs


class _Tokenizer:
    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(ord("a") + t) for t in token_ids)


class _Reference:
    """Greedy tokens 0, 1, 2, 3; at position 2 token 2 leads token 7 by `margin`."""

    def __init__(self, margin: float, listed_first: int = 2) -> None:
        self.margin, self.listed_first = margin, listed_first

    def get_tokenizer(self) -> _Tokenizer:
        return _Tokenizer()

    def generate(self, prompts: list[Any], params: Any) -> list[Any]:
        assert params.logprobs == 2
        top = [((t, -1.0), (t + 10, -5.0)) for t in range(4)]
        other = 7 if self.listed_first == 2 else 2
        top[2] = ((self.listed_first, -1.0), (other, -1.0 - self.margin))
        logprobs = [TokenLogprobs(t, -1.0, pair) for t, pair in enumerate(top)]
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[0, 1, 2, 3], logprobs=logprobs)])]


def _outcome(text: str, temperature: float = 0.0) -> Any:
    spec = SimpleNamespace(prompt=[5, 6], sampling=lambda: {"temperature": temperature, "max_tokens": 4})
    return SimpleNamespace(spec=spec, text=text)


@pytest.mark.parametrize("listed_first", [2, 7])
def test_parting_at_an_exact_tie_by_taking_the_other_candidate_is_a_tie(listed_first: int) -> None:
    assert _parted_at_a_tie(_Reference(0.0, listed_first), _outcome("abhx"))


def test_parting_where_the_reference_clearly_prefers_its_token_is_wrong() -> None:
    assert not _parted_at_a_tie(_Reference(10 * _TIE_LOGPROB), _outcome("abhx"))


def test_parting_at_a_tie_to_a_third_token_or_elsewhere_is_wrong() -> None:
    assert not _parted_at_a_tie(_Reference(0.0), _outcome("abzz"))  # not the tied candidate
    assert not _parted_at_a_tie(_Reference(0.0), _outcome("azcd"))  # parted before the tie


def test_sampled_answers_are_never_excused() -> None:
    assert not _parted_at_a_tie(_Reference(0.0), _outcome("abhx", temperature=0.7))
