"""Repetition, frequency and presence penalties and `min_tokens` for a whole batch in a few ops, from
state kept across steps.

Each request with penalties holds a row of two tables on the sampler's device: `seen` (bool: every
token of its prompt and output, for the repetition penalty) and `counts` (float32: its output tokens,
for frequency and presence). A step adds only the tokens appended since the row was last brought up to
date, every row's in one indexed write, then penalizes the rows (on a GPU all at once, on CPU one by
one on views, `_penalize`):

    step t    request a: row 0, tokens [p p p o1]     seen[0, p|o1] = True, counts[0, o1] += 1
    step t+1  request a: row 0, tokens [... o1 o2]    seen[0, o2] = True,   counts[0, o2] += 1  (o2 only)

A request absent from a step that calls `apply` gives its row back; one that comes back (preempted,
say) is rebuilt from its tokens, once. NOTE: before, each row built its mask from its whole history on
the host and copied it to the device, every step: O(context) host work and a copy and sync per row.
The tables grow by doubling, up to the rows penalized together (each 5 bytes a vocabulary entry).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from pdserve.engine.request import Request

_MIN_ROWS = 8


@dataclass(slots=True)
class _Row:
    # the request this row counts (identity: a request id may come back as a new object); weak: a row
    # left behind by a finished request must not keep it, its tokens, matcher and generator alive
    request: weakref.ref[Request]
    index: int
    num_seen: int  # tokens of `all_token_ids` marked in `seen`
    num_counted: int  # output tokens added to `counts`


class PenaltyTables:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seen = torch.zeros(0, 0, dtype=torch.bool, device=device)
        self.counts = torch.zeros(0, 0, dtype=torch.float32, device=device)
        self._rows: dict[str, _Row] = {}
        self.batched: bool | None = None  # every row at once; None: off CPU (tests set it)

    def __len__(self) -> int:
        return len(self._rows)

    def clear(self) -> None:
        """Give every row back and the tables' memory with them (new empty tensors: a view of the old
        ones would keep their storage)."""
        self._rows.clear()
        self.seen = torch.zeros(0, 0, dtype=torch.bool, device=self.device)
        self.counts = torch.zeros(0, 0, dtype=torch.float32, device=self.device)

    def apply(self, logits: torch.Tensor, requests: list[Request], rows: list[int]) -> None:
        """Penalize `logits` (a row per request, written in place) at `rows`: those with penalties or
        `min_tokens` not reached yet (the sampler's `_Rows.adjusted`)."""
        penalized = [row for row in rows if requests[row].params.needs_penalties]
        if penalized:
            indices = self._update(requests, penalized, logits.shape[-1])
            self._penalize(logits, requests, penalized, indices)
        elif self._rows:
            self.clear()
        banned_rows: list[int] = []
        banned_tokens: list[int] = []
        for row in rows:
            request = requests[row]
            params = request.params
            if request.num_output_tokens < params.min_tokens:
                banned = list(params.stop_token_ids) + ([] if params.ignore_eos else list(request.eos_token_ids))
                banned_rows.extend([row] * len(banned))
                banned_tokens.extend(banned)
        if banned_tokens:
            logits[self._tensor(banned_rows), self._tensor(banned_tokens)] = float("-inf")

    def _update(self, requests: list[Request], penalized: list[int], vocab: int) -> list[int]:
        """Bring the penalized requests' rows up to date; returns each one's row index."""
        if self.seen.shape[1] != vocab:
            self.clear()
            self.seen = torch.zeros(0, vocab, dtype=torch.bool, device=self.device)
            self.counts = torch.zeros(0, vocab, dtype=torch.float32, device=self.device)
        wanted = {requests[row].request_id for row in penalized}
        for request_id in [r for r in self._rows if r not in wanted]:
            del self._rows[request_id]  # NOTE: absent from this step: its row is free again
        taken = {entry.index for entry in self._rows.values()}
        free = (index for index in range(len(self._rows) + len(penalized)) if index not in taken)
        fresh: list[int] = []
        indices: list[int] = []
        seen_rows: list[int] = []
        seen_tokens: list[int] = []
        count_rows: list[int] = []
        count_tokens: list[int] = []
        for row in penalized:
            request = requests[row]
            token_ids = request.all_token_ids
            entry = self._rows.get(request.request_id)
            if (entry is None or entry.request() is not request or entry.num_seen > len(token_ids)
                    or entry.num_counted > request.num_output_tokens):  # NOTE: never so today: tokens only grow
                entry = self._rows[request.request_id] = _Row(weakref.ref(request), next(free), 0, 0)
                fresh.append(entry.index)
            params, index = request.params, entry.index
            indices.append(index)
            if params.repetition_penalty != 1.0:
                seen_tokens.extend(token_ids[entry.num_seen:])
                seen_rows.extend([index] * (len(token_ids) - entry.num_seen))
                entry.num_seen = len(token_ids)
            if params.presence_penalty or params.frequency_penalty:
                new = token_ids[len(request.prompt_token_ids) + entry.num_counted:]
                count_tokens.extend(new)
                count_rows.extend([index] * len(new))
                entry.num_counted += len(new)
        self._grow(max(indices) + 1)
        if fresh:
            fresh_rows = self._tensor(fresh)
            self.seen[fresh_rows] = False
            self.counts[fresh_rows] = 0.0
        if seen_tokens:
            self.seen[self._tensor(seen_rows), self._tensor(seen_tokens)] = True
        if count_tokens:
            at = (self._tensor(count_rows), self._tensor(count_tokens))
            self.counts.index_put_(at, torch.ones(len(count_tokens), dtype=torch.float32, device=self.device),
                                   accumulate=True)
        return indices

    def _grow(self, num_rows: int) -> None:
        capacity = self.seen.shape[0]
        if num_rows <= capacity:
            return
        capacity = max(_MIN_ROWS, 2 * capacity, num_rows)
        vocab = self.seen.shape[1]
        seen = torch.zeros(capacity, vocab, dtype=torch.bool, device=self.device)
        counts = torch.zeros(capacity, vocab, dtype=torch.float32, device=self.device)
        seen[:self.seen.shape[0]] = self.seen
        counts[:self.counts.shape[0]] = self.counts
        self.seen, self.counts = seen, counts

    def _penalize(self, logits: torch.Tensor, requests: list[Request], penalized: list[int],
                  indices: list[int]) -> None:
        """Off CPU every penalized row at once; on CPU row by row, in place on views of the logits and
        tables (a row stays in cache; gathering the rows copies them all, twice, and was slower than
        building each row's mask from its history). The same arithmetic either way (float32 factors,
        as a Python float's are cast). NOTE: bit for bit on CPU; CUDA multiplies by a Python scalar
        divisor's reciprocal, and divides by a tensor, so there the last bit may differ."""
        if not (self.batched if self.batched is not None else logits.device.type != "cpu"):
            for row, index in zip(penalized, indices, strict=True):
                wanted, values = requests[row].params, logits[row]
                if wanted.repetition_penalty != 1.0:
                    penalty = wanted.repetition_penalty
                    values.copy_(torch.where(self.seen[index], torch.where(values > 0, values / penalty,
                                                                           values * penalty), values))
                if wanted.presence_penalty or wanted.frequency_penalty:
                    counts = self.counts[index]
                    values -= wanted.frequency_penalty * counts + wanted.presence_penalty * (counts > 0)
            return
        params = [requests[row].params for row in penalized]
        repeated = [j for j, p in enumerate(params) if p.repetition_penalty != 1.0]
        if repeated:
            rows = self._tensor([penalized[j] for j in repeated])
            factor = self._floats([params[j].repetition_penalty for j in repeated])[:, None]
            values = logits[rows]
            adjusted = torch.where(values > 0, values / factor, values * factor)
            logits[rows] = torch.where(self.seen[self._tensor([indices[j] for j in repeated])], adjusted, values)
        counted = [j for j, p in enumerate(params) if p.presence_penalty or p.frequency_penalty]
        if counted:
            rows = self._tensor([penalized[j] for j in counted])
            counts = self.counts[self._tensor([indices[j] for j in counted])]
            frequency, presence = (self._floats(v)[:, None] for v in (
                [params[j].frequency_penalty for j in counted], [params[j].presence_penalty for j in counted]))
            logits[rows] = logits[rows] - (frequency * counts + presence * (counts > 0))

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)

    def _floats(self, values: list[float]) -> torch.Tensor:
        """float32, as a Python float is cast in the per-row arithmetic (then rounded once to the logits')."""
        return torch.tensor(values, dtype=torch.float32).to(self.device, non_blocking=True)
