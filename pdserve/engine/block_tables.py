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
(`retain` drops the others); anything else rebuilds the row from the list (once, O(context)).
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


class BlockTables:
    def __init__(self) -> None:
        self._rows: dict[str, _Row] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def table(self, request: Request) -> np.ndarray:
        """The request's block ids (int32, a view valid until the next call for this request)."""
        blocks = request.block_ids
        num_blocks = len(blocks)
        row = self._rows.get(request.request_id)
        if (row is None or row.source is not blocks or row.count > num_blocks
                or (row.count and row.array[row.count - 1] != blocks[row.count - 1])):  # NOTE: rewritten in place
            array = np.empty(max(_MIN_CAPACITY, 2 * num_blocks), dtype=np.int32)
            array[:num_blocks] = blocks
            row = self._rows[request.request_id] = _Row(blocks, array, num_blocks)
        elif num_blocks > row.count:
            if num_blocks > len(row.array):
                grown = np.empty(2 * num_blocks, dtype=np.int32)
                grown[:row.count] = row.array[:row.count]
                row.array = grown
            row.array[row.count:num_blocks] = blocks[row.count:]
            row.count = num_blocks
        return row.array[:num_blocks]

    def retain(self, request_ids: set[str]) -> None:
        """Keep the rows of these requests only (this step's), dropping finished and paused ones."""
        for request_id in [r for r in self._rows if r not in request_ids]:
            del self._rows[request_id]
