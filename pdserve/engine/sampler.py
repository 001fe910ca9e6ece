"""Turns the logits of the sampling rows into tokens.

Per-request determinism: a request with a `seed` draws its randomness from its own generator, one
draw of vocabulary size per token, so its tokens do not depend on what else is in the batch.
Sampling uses the exponential race: argmax(p / E) with E ~ Exp(1) picks token i with probability p_i.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from pdserve.engine.logprobs import PromptLogprobs, TokenLogprobs
from pdserve.engine.penalties import PenaltyTables
from pdserve.engine.request import Request
from pdserve.engine.structured import MaskFiller, chunk_maxima, row_argmax


def prompt_logprobs(logits: torch.Tensor, targets: list[tuple[Request, int]]) -> None:
    """Append to each target's request the logprobs of its prompt token at that position; the
    logits rows are in `targets` order (like `logprobs`, the model's raw distribution).
    NOTE: every value comes to the host in one `.tolist()` per tensor, not a sync per token."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    token_list = [r.prompt_token_ids[p] for r, p in targets]
    token_ids = torch.tensor(token_list, device=logits.device)
    picked = logprobs.gather(1, token_ids[:, None])[:, 0]
    ranks = (logprobs > picked[:, None]).sum(dim=-1) + 1
    num_top = max(r.params.prompt_logprobs or 0 for r, _ in targets)
    values, ids = logprobs.topk(num_top, dim=-1) if num_top else (logprobs[:, :0], logprobs[:, :0].long())
    picked_list, rank_list, value_rows, id_rows = picked.tolist(), ranks.tolist(), values.tolist(), ids.tolist()
    for row, (request, position) in enumerate(targets):
        assert request.prompt_logprobs is not None and len(request.prompt_logprobs) == position
        k = request.params.prompt_logprobs or 0
        top = tuple(zip(id_rows[row][:k], value_rows[row][:k], strict=True))
        request.prompt_logprobs.append(PromptLogprobs(token_list[row], picked_list[row], rank_list[row], top))


@dataclass(frozen=True, slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


@dataclass(slots=True)
class _Rows:
    """Which rows of a batch need what, found in one pass over its requests (it runs per request
    per step: one loop, not one per question)."""

    logprobs: bool = False  # some row wants logprobs
    adjusted: list[int] = field(default_factory=list)  # penalties, or min_tokens not reached yet
    constrained: list[int] = field(default_factory=list)  # structured outputs: a grammar's mask
    random: list[int] = field(default_factory=list)  # not greedy

    @classmethod
    def of(cls, requests: list[Request]) -> _Rows:
        rows = cls()
        adjusted, constrained, random = rows.adjusted, rows.constrained, rows.random
        for i, request in enumerate(requests):
            if request.plain_greedy and request.matcher is None:
                continue
            params = request.params
            if params.logprobs is not None:
                rows.logprobs = True
            if params.needs_penalties or (params.min_tokens and request.num_output_tokens < params.min_tokens):
                adjusted.append(i)
            if request.matcher is not None:
                constrained.append(i)
            if not params.greedy:
                random.append(i)
        return rows


class Sampler:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.masks = MaskFiller()  # structured outputs: each constrained row's grammar mask
        self.penalties = PenaltyTables(device)  # each penalized request's seen tokens and output counts
        self._pending: tuple[list[str], Future[torch.Tensor]] | None = None  # see start_masks

    def start_masks(self, requests: list[Request], vocab: int) -> None:
        """Structured outputs: start filling the grammar masks of the constrained requests among
        the next call's `requests` (one bitmask, a row each), to run while the model computes the
        logits; that call waits for them."""
        matchers = [r.matcher for r in requests if r.matcher is not None]
        self._pending = ([r.request_id for r in requests], self.masks.start(matchers, vocab)) if matchers else None

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SampleResult:
        """logits: [len(requests), vocab] float32, one row per request, in order."""
        rows = _Rows.of(requests)
        logprobs = torch.log_softmax(logits, dim=-1) if rows.logprobs else None  # NOTE: like vLLM, the raw model's
        logits = self._apply_penalties_and_masks(logits, requests, rows.adjusted)
        pending, self._pending = self._pending, None
        constrained = rows.constrained
        if constrained and logits.device.type != "cpu":
            # NOTE: a GPU masks every constrained row in one op, and without the sync of the check below
            logits = self.masks.apply(logits, constrained, self._bitmask(pending, requests, logits.shape[-1]))
            constrained = []
        # NOTE: what `MaskFiller.argmax` gathers by (None off CPU); row_argmax finds its own where it needs them
        maxima = chunk_maxima(logits) if constrained else None
        tokens = row_argmax(logits, maxima)
        random_rows = rows.random
        if constrained:
            bitmask = self._bitmask(pending, requests, logits.shape[-1])  # a row per constrained request
            # NOTE: greedy rows are not masked: the argmax is checked against the mask (`argmax`)
            greedy = [(row, j) for j, row in enumerate(constrained) if requests[row].params.greedy]
            if greedy:
                # NOTE: not copied where every constrained row is greedy (its rows are then those of the bitmask)
                words = bitmask if len(greedy) == len(constrained) else bitmask[[j for _, j in greedy]]
                self.masks.argmax(logits, tokens, [row for row, _ in greedy], words, maxima)
        if random_rows:
            sampled = logits[random_rows]
            if constrained:  # the random constrained rows, masked in `sampled`
                where = {row: j for j, row in enumerate(constrained)}
                masked = [(k, where[row]) for k, row in enumerate(random_rows) if row in where]
                if masked:
                    sampled = self.masks.apply(sampled, [k for k, _ in masked], bitmask[[j for _, j in masked]])
            tokens[random_rows] = self._sample(sampled, [requests[i] for i in random_rows])
        token_list = tokens.tolist()
        if logprobs is None:
            return SampleResult(token_list, [None] * len(requests))
        return SampleResult(token_list, self._pick_logprobs(logprobs, token_list, requests))

    def argmax(self, logits: torch.Tensor) -> SampleResult:
        """`__call__` for rows that are all plain greedy (`Request.plain_greedy`, no grammar): each
        row's argmax, with no pass over the requests to find that out."""
        if len(self.penalties):
            self.penalties.clear()  # NOTE: as `_apply_penalties_and_masks` does: no penalized request left
        self._pending = None
        return SampleResult(row_argmax(logits, None).tolist(), [None] * logits.shape[0])

    def _bitmask(self, pending: tuple[list[str], Future[torch.Tensor]] | None, requests: list[Request],
                 vocab: int) -> torch.Tensor:
        """The masks `start_masks` started (`pending`) for these requests (started now where it did not)."""
        if pending is None or pending[0] != [r.request_id for r in requests]:  # not started for these
            self.start_masks(requests, vocab)
            pending, self._pending = self._pending, None
        assert pending is not None
        return pending[1].result()

    @staticmethod
    def _pick_logprobs(logprobs: torch.Tensor, tokens: list[int],
                       requests: list[Request]) -> list[TokenLogprobs | None]:
        """One batched topk and gather, one copy each to the host (was a topk and syncs per row)."""
        rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        num_top = max((requests[i].params.logprobs or 0 for i in rows), default=0)
        index = torch.tensor(rows, device=logprobs.device)
        chosen = logprobs[index]
        token_ids = torch.tensor([tokens[i] for i in rows], device=logprobs.device)
        picked = chosen.gather(1, token_ids[:, None])[:, 0].tolist()
        values, ids = chosen.topk(num_top, dim=-1) if num_top else (chosen[:, :0], chosen[:, :0].long())
        value_rows, id_rows = values.tolist(), ids.tolist()
        result: list[TokenLogprobs | None] = [None] * len(requests)
        for j, row in enumerate(rows):
            k = requests[row].params.logprobs or 0
            top = tuple(zip(id_rows[j][:k], value_rows[j][:k], strict=True))
            result[row] = TokenLogprobs(tokens[row], picked[j], top)
        return result

    def _apply_penalties_and_masks(self, logits: torch.Tensor, requests: list[Request],
                                   rows: list[int] | None = None) -> torch.Tensor:
        """`rows`: those with penalties or min_tokens not reached (`_Rows.adjusted`; None: found here).
        A copy of `logits` where any row changes (engine/penalties.py)."""
        if rows is None:
            rows = _Rows.of(requests).adjusted
        if not rows:
            if len(self.penalties):
                self.penalties.clear()  # NOTE: no request with penalties left in the batch
            return logits
        logits = logits.clone()
        self.penalties.apply(logits, requests, rows)
        return logits

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        temperature = torch.tensor([r.params.temperature for r in requests], device=logits.device)
        logits = logits / temperature[:, None]
        logits = _filter_top_k_top_p_min_p(logits, requests)
        probs = torch.softmax(logits, dim=-1)
        noise = torch.empty_like(probs)
        unseeded = [i for i, r in enumerate(requests) if r.generator is None]
        if unseeded:
            noise[unseeded] = torch.empty_like(probs[unseeded]).exponential_(generator=self.generator)
        for i, request in enumerate(requests):
            if request.generator is not None:
                for _ in range(request.pending_draws):  # NOTE: the very draws those tokens made, one by one
                    noise[i].exponential_(generator=request.generator)
                request.pending_draws = 0
                noise[i].exponential_(generator=request.generator)
        return row_argmax(probs / noise)


def _filter_top_k_top_p_min_p(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    top_k = [r.params.top_k for r in requests]
    top_p = [r.params.top_p for r in requests]
    min_p = [r.params.min_p for r in requests]
    vocab = logits.shape[-1]
    if any(0 < k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        k = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=logits.device)[:, None]
        drop = ranks >= k
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p; the best always stays.
        mass_before = probs.cumsum(dim=-1) - probs
        drop |= mass_before >= torch.tensor(top_p, device=logits.device)[:, None]
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    if any(p > 0.0 for p in min_p):
        probs = torch.softmax(logits, dim=-1)
        threshold = torch.tensor(min_p, device=logits.device)[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits
