"""Append-only host copies of the running requests' block tables, so a step's host work grows with
the blocks added since the last step, not with every request's context.

One int32 numpy row per request, grown by doubling; each step copies in only the ids appended to
`request.block_ids` since the last step it was seen, and hands the step a view (no copy):

    request.block_ids   [b0 b1 b2 b3 b4]          (a Python list, the KV cache manager's)
    row.array           [b0 b1 b2 b3 __ __ __ __]  count = 4 -> b4 copied in, count = 5
    table(request)      view of array[:5]

NOTE: a request's block list only grows while it keeps running; everything that rewrites it
(preemption, swap in, a disk load's truncation) either replaces the list object or happens while
the request is out of the step. So a row is reused only for the very same list object, at most as
long as it is, whose last copied id is still there, and only for requests in consecutive steps
(`end_step` drops the others); anything else rebuilds the row from the list (once, O(context)).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pdserve.engine.request import Request

_MIN_CAPACITY = 64


@dataclass(slots=True)
class _Row:
    source: list[int]  # the request's block list this row copies (identity, not value)
    array: np.ndarray  # int32 [capacity]
    count: int  # ids copied so far
    last: int  # the last id copied (-1: none), compared without reading the array back
    step: int  # the last step (`end_step` count) that asked for this row


class BlockTables:
    def __init__(self) -> None:
        self._rows: dict[str, _Row] = {}
        self._step = 0
        self._num_used = 0  # rows asked for in this step

    def __len__(self) -> int:
        return len(self._rows)

    def table(self, request: Request, num_blocks: int | None = None) -> np.ndarray:
        """The request's block ids, or the first `num_blocks` of them (int32, a view valid until the
        next call for this request)."""
        blocks = request.block_ids
        held = len(blocks)
        row = self._rows.get(request.request_id)
        if (row is None or row.source is not blocks or row.count > held
                or (row.count and row.last != blocks[row.count - 1])):  # NOTE: rewritten in place
            array = np.empty(max(_MIN_CAPACITY, 2 * held), dtype=np.int32)
            array[:held] = blocks
            step = -1 if row is None else row.step  # NOTE: a row rebuilt within a step is counted once
            row = self._rows[request.request_id] = _Row(blocks, array, held, blocks[-1] if held else -1, step)
        elif held > row.count:
            if held > len(row.array):
                grown = np.empty(2 * held, dtype=np.int32)
                grown[:row.count] = row.array[:row.count]
                row.array = grown
            if held == row.count + 1:  # NOTE: the usual case, a decode's new block: no list slice
                row.array[row.count] = blocks[row.count]
            else:
                row.array[row.count:held] = blocks[row.count:]
            row.count, row.last = held, blocks[-1]
        if row.step != self._step:
            row.step = self._step
            self._num_used += 1
        return row.array[:held if num_blocks is None else num_blocks]

    def end_step(self, keep_all: bool = False) -> None:
        """Drop the rows no `table` call of this step asked for (finished and paused requests);
        O(1) when every row was asked for, as in a steady decode. `keep_all`: the step's requests are
        the last step's, whose rows were all kept then (`SteadyDecodes` asks only for those that
        grew): drop none."""
        if not keep_all and self._num_used != len(self._rows):
            step = self._step
            for request_id in [r for r, row in self._rows.items() if row.step != step]:
                del self._rows[request_id]
        self._step += 1
        self._num_used = 0

    def retain(self, request_ids: set[str]) -> None:
        """Keep the rows of these requests only, dropping the others."""
        for request_id in [r for r in self._rows if r not in request_ids]:
            row = self._rows.pop(request_id)
            if row.step == self._step:
                self._num_used -= 1
