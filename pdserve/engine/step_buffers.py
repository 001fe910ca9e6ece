"""Persistent step inputs for the Triton backend (model/attention_backend.py): one host buffer,
one device buffer, one copy a step.

Both buffers are int32, laid out in fixed regions sized for the engine's limits, so a region's
views keep their addresses from step to step (what a CUDA graph replays reads them there):

    ids[T] | positions[T] | slots[T] | decode rows[S] | prefix starts[S] | prefix ends[S] |
    lens[S] | tables[S, W]                       T = max tokens, S = max sequences, W = max blocks a sequence

Sequences 0..d-1 of `lens`/`tables` are the step's decodes, then, from the next multiple of 4,
its prompt chunks (every region and table row 16-byte aligned: see __init__): those over a cached
context, and fresh prompts (no cached context) shorter than `FRESH_SDPA_MIN_TOKENS`, so one
prefix-kernel launch a layer attends them all, as one varlen flash call does in vLLM (review
finding 6: a step of 32 short prompts took 32 SDPA calls and 32 copies a layer). A longer fresh
prompt, whose attention outweighs two launches, keeps torch's fused attention (flash on CUDA) over
its own new K/V, one call each (`PagedMetadata.fresh_prefills`); so does every fresh prompt when
the pool holds another dtype than the model (FP8, or a narrower float), as on the torch backend,
where a fresh prompt never reads K/V rounded to the pool.
A step fills the host buffer from its `StepPlan` (numpy, no torch op per request) and
copies the regions' used part to the device at once: up to the last table row used, so a step
that uses fewer sequences copies fewer rows. The attention metadata is then views, built once a
step, not per request per layer. NOTE: the copy is asynchronous from pinned memory; before the
host buffer is refilled, the previous copy is waited for (an event: a step that samples nothing
never synchronises, and its copy may still be queued behind earlier kernels).
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import compress
from operator import is_not

import numpy as np
import torch

from pdserve.engine.step_plan import StepPlan
from pdserve.model.attention import KVQuant
from pdserve.model.attention_backend import PagedMetadata

PAD_SLOT = -1  # a row whose K/V is written nowhere (a CUDA graph's padding)
# NOTE: from this many tokens a fresh prompt's attention (~22 µs of flash at 1,024 tokens on Qwen3-8B's
# heads, H200) outweighs the SDPA call and copy that the prefix kernel saves even at 0.6x flash's speed;
# an estimate until `scripts/device_check.sh`'s gpu_kernels stage times the kernel on a fresh 2,048-token prompt
FRESH_SDPA_MIN_TOKENS = 1024
_ALIGN = 4  # int32s in 16 bytes


def _aligned(count: int) -> int:
    return -(-count // _ALIGN) * _ALIGN


class StepBuffers:
    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, device: torch.device,
                 splits: Callable[[int], int], kv_quant: KVQuant | None = None) -> None:
        """`splits(num_decodes)`: the split-KV parts of a decode batch (attention_backend.decode_splits);
        `kv_quant`: an FP8 pool's scales, passed on to every step's metadata."""
        self.max_tokens, self.max_seqs, self.max_blocks_per_seq = max_tokens, max_seqs, max_blocks_per_seq
        self.device = device
        self.splits = splits
        self.kv_quant = kv_quant
        # fresh prompts of fewer tokens than this go through the prefix kernel (0: none; the runner sets
        # 0 for a float pool of another dtype than the model's)
        self.fresh_in_kernel_below = FRESH_SDPA_MIN_TOKENS if kv_quant is None else 0
        # NOTE: every region, every table row and the first prefix sequence start 16 bytes apart (4
        # int32s): Triton specializes pointer arguments on 16-byte alignment, so an alignment that
        # changed with the number of decodes compiled a new kernel variant in the middle of serving
        self.width = _aligned(max_blocks_per_seq)
        t, s = _aligned(max_tokens), _aligned(max_seqs) + _ALIGN
        self._offsets = {name: at for name, at in zip(
            ("ids", "positions", "slots", "rows", "starts", "ends", "lens", "tables"),
            np.cumsum([0, t, t, t, s, s, s, s]).tolist(), strict=True)}
        size = self._offsets["tables"] + s * self.width
        on_gpu = device.type == "cuda"
        self.host = torch.zeros(size, dtype=torch.int32, pin_memory=on_gpu)
        self.device_buf = torch.zeros(size, dtype=torch.int32, device=device) if on_gpu else self.host
        self._np = self.host.numpy()
        self._copied = torch.cuda.Event() if on_gpu else None  # the last copy out of `host`
        # decode i's table last step, the persistent row it viewed and how many ids row i holds of it
        self._tables: list[object] = []
        self._table_sources: list[object] = []
        self._table_counts: list[int] = []
        self._rows: list[int] = []  # the decode rows last written (held: an object held cannot be another)
        # the last step's shape and views (`prepare`): the same shape, the very same views
        self._shape: tuple[object, ...] = ()
        self._views: tuple[torch.Tensor, torch.Tensor, PagedMetadata] | None = None

    def _check_width(self, num_blocks: int) -> None:
        if num_blocks > self.max_blocks_per_seq:
            raise ValueError(f"a block table of {num_blocks} blocks exceeds the step buffers' "
                             f"{self.max_blocks_per_seq}")

    def _fill_decode_tables(self, tables: np.ndarray, decode_tables: list[list[int] | np.ndarray]) -> None:
        """Decode i's table into row i, writing only what the row lacks: a table that is a view of
        the same persistent row (`BlockTables`) as row i's last step holds the ids written then,
        unchanged (its rows are append-only), so only ids past them are copied; the very same table
        object as last step's (a steady decode's, `SteadyDecodes`; a padding row's) is not looked
        at past that one identity test, made for every row in C. A steady decode step writes the
        new blocks' ids alone: host work that does not grow with context."""
        last_tables, last_sources, last_counts = self._tables, self._table_sources, self._table_counts
        self._tables, self._table_sources, self._table_counts = [], [], []  # NOTE: a step that raises leaves nothing
        num, num_last = len(decode_tables), len(last_tables)
        sources, counts = last_sources[:num], last_counts[:num]
        changed = list(compress(range(num), map(is_not, decode_tables, last_tables)))
        for row in changed if num <= num_last else changed + list(range(num_last, num)):
            table = decode_tables[row]
            count = len(table)
            source = table.base if isinstance(table, np.ndarray) else None
            if source is not None and row < num_last and source is last_sources[row]:
                have = last_counts[row]
                if count > have:
                    self._check_width(count)
                    tables[row, have:count] = table[have:]
                else:
                    count = have  # NOTE: a shorter view of the same row: the ids past it stay written
            else:
                self._check_width(count)
                tables[row, :count] = table
            if row < num_last:
                sources[row], counts[row] = source, count
            else:
                sources.append(source)
                counts.append(count)
        # NOTE: the tables and rows held (strong references): an id() could be reused, an object held cannot
        self._tables, self._table_sources, self._table_counts = list(decode_tables), sources, counts

    def _region(self, buf: torch.Tensor, name: str, length: int, at: int = 0) -> torch.Tensor:
        start = self._offsets[name] + at
        return buf[start:start + length]

    def prepare(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, PagedMetadata]:
        """The step's input ids, positions and metadata: views of the device buffer."""
        num_tokens, num_decodes = len(plan.token_ids), len(plan.decode_rows)
        below = self.fresh_in_kernel_below
        prefix = [p for p in plan.prefills if p.context_len > p.end - p.start or p.context_len < below]
        first_prefix = _aligned(num_decodes) if prefix else num_decodes  # rows between: unused
        num_seqs = first_prefix + len(prefix)
        if num_tokens > self.max_tokens or num_decodes + len(prefix) > self.max_seqs:
            raise ValueError(f"a step of {num_tokens} tokens, {num_decodes + len(prefix)} sequences exceeds the step "
                             f"buffers ({self.max_tokens}, {self.max_seqs})")
        if self._copied is not None:
            self._copied.synchronize()  # NOTE: the previous step's copy has read the host buffer
        fill = self._np
        # NOTE: a steady decode's arrays copy in well under a µs each, a list of 256 ints in about 12;
        # decode rows that are the very list the last step wrote (range(n), kept) are there already
        positions, slots, lens = plan.decode_arrays or (plan.positions, plan.slots, plan.decode_lens)
        rows = () if plan.decode_rows is self._rows else plan.decode_rows
        for name, at, values in (("ids", 0, plan.token_ids), ("positions", 0, positions), ("slots", 0, slots),
                                 ("rows", 0, rows), ("lens", 0, lens),
                                 ("lens", first_prefix, [p.context_len for p in prefix]),
                                 ("starts", 0, [p.start for p in prefix]), ("ends", 0, [p.end for p in prefix])):
            start = self._offsets[name] + at
            fill[start:start + len(values)] = values
        self._rows = plan.decode_rows
        tables = fill[self._offsets["tables"]:self._offsets["tables"] + num_seqs * self.width].reshape(-1, self.width)
        self._fill_decode_tables(tables, plan.decode_tables)
        for row, table in zip(range(first_prefix, num_seqs), [p.block_ids for p in prefix], strict=True):
            self._check_width(len(table))
            tables[row, :len(table)] = table
        used = self._offsets["tables"] + num_seqs * self.width
        if self._copied is not None:
            self.device_buf[:used].copy_(self.host[:used], non_blocking=True)
            self._copied.record(torch.cuda.current_stream(self.device))  # NOTE: not the thread's current device's
        fresh = tuple((p.start, p.end) for p in plan.prefills if p.context_len == p.end - p.start
                      and p.context_len >= below)
        shape = (num_tokens, num_decodes, first_prefix, len(prefix),
                 max((p.end - p.start for p in prefix), default=0), fresh)
        views = self._views
        if views is None or shape != self._shape:  # NOTE: a steady step's views are last step's (~30 µs of views)
            views = self._views = self._make_views(*shape)
            self._shape = shape
        return views

    def _make_views(self, num_tokens: int, num_decodes: int, first_prefix: int, num_prefix: int,
                    max_prefix_query_len: int, fresh: tuple[tuple[int, int], ...]
                    ) -> tuple[torch.Tensor, torch.Tensor, PagedMetadata]:
        """`prepare`'s answer for a step of this shape: views of the device buffer."""
        buf, num_seqs = self.device_buf, first_prefix + num_prefix
        all_tables = self._region(buf, "tables", num_seqs * self.width).view(num_seqs, self.width)
        meta = PagedMetadata(
            slot_mapping=self._region(buf, "slots", num_tokens),
            decode_rows=self._region(buf, "rows", num_decodes),
            decode_tables=all_tables[:num_decodes],
            decode_lens=self._region(buf, "lens", num_decodes),
            num_splits=self.splits(num_decodes),
            prefix_starts=self._region(buf, "starts", num_prefix),
            prefix_ends=self._region(buf, "ends", num_prefix),
            prefix_tables=all_tables[first_prefix:],
            prefix_lens=self._region(buf, "lens", num_prefix, at=first_prefix),
            max_prefix_query_len=max_prefix_query_len,
            fresh_prefills=fresh,
            kv_quant=self.kv_quant,
        )
        return self._region(buf, "ids", num_tokens), self._region(buf, "positions", num_tokens), meta

