"""Decode steps replayed from CUDA graphs (the Triton backend's steps; `--enforce-eager` turns it off).

At start-up one graph is captured per batch-size bucket (1, 2, 4, 8, ... up to max_num_seqs, and
max_num_seqs itself), largest first, all in one memory pool; each reads its inputs from the
runner's persistent step buffers (step_buffers.py) and writes its hidden states to a tensor of
its own. A step replays when it is decode only, with at most the largest bucket's sequences and
no per-layer callback (KV streaming); it is then padded to its bucket:

    3 decodes, bucket 4:   rows    d0  d1  d2 | pad
                           slot    s0  s1  s2 | -1   (writes no KV)
                           context n0  n1  n2 | 1    (reads block 0's first slot: finite, unused)

and the bucket's graph replays; the hidden states of the real rows are returned. Prefill, mixed
and KV-streaming steps go to the piecewise graphs (piecewise_graphs.py: attention eager between
graphs of the rest) up to its largest token bucket, and eagerly above. Everything but the capture and the
replay (buckets, padding, which steps replay) runs eagerly on CPU too (`DecodeGraphs` without
graphs), so the tests check it there; the engine takes this path only on CUDA.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch

from pdserve.engine.step_buffers import PAD_SLOT, StepBuffers
from pdserve.engine.step_plan import StepPlan, shared_rows
from pdserve.model.qwen3 import Qwen3ForCausalLM

logger = logging.getLogger(__name__)


def decode_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, ... below max_num_seqs, then max_num_seqs: 256 -> (1, 2, 4, ..., 256), 48 -> (..., 32, 48)."""
    buckets, size = [], 1
    while size < max_num_seqs:
        buckets.append(size)
        size *= 2
    return (*buckets, max_num_seqs)


def bucket_for(num_decodes: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket that holds the batch; None above the largest."""
    return next((b for b in buckets if b >= num_decodes), None)


def replay_bucket(plan: StepPlan, buckets: tuple[int, ...], layer_done: Callable[[int], None] | None) -> int | None:
    """The bucket a step replays at, or None when it runs eagerly: prefills in it (prefill and mixed
    steps), no sequence, more decodes than the largest bucket, or a per-layer callback."""
    if plan.prefills or not plan.decode_rows or layer_done is not None:
        return None
    return bucket_for(len(plan.decode_rows), buckets)


# a padded row's table, one list for all of them and never changed: the step buffers skip a row that
# gets the very table object it got last step, so a steady step rewrites no padded row
_PAD_TABLE = [0]


def pad_decode_plan(plan: StepPlan, bucket: int) -> StepPlan:
    """A decode-only plan padded to `bucket` rows: padded rows write no KV (slot -1) and attend to
    one token of block 0; sampling and prompt-logprob rows are the real ones, unchanged."""
    pad = bucket - len(plan.token_ids)
    assert not plan.prefills and pad >= 0 and len(plan.decode_rows) == len(plan.token_ids)
    if not pad:
        return plan
    arrays = plan.decode_arrays
    if arrays is not None:  # NOTE: padded as the lists are
        arrays = tuple(np.concatenate((a, np.full(pad, value, dtype=a.dtype)))
                       for a, value in zip(arrays, (0, PAD_SLOT, 1), strict=True))  # type: ignore[assignment]
    return replace(plan, token_ids=plan.token_ids + [0] * pad, positions=plan.positions + [0] * pad,
                   slots=plan.slots + [PAD_SLOT] * pad, decode_rows=shared_rows(bucket), decode_arrays=arrays,
                   decode_tables=plan.decode_tables + [_PAD_TABLE] * pad, decode_lens=plan.decode_lens + [1] * pad)


class DecodeGraphs:
    """Decode steps by bucket. `capture()` (CUDA) records one graph per bucket; without it (or
    for a bucket not captured) the padded step runs eagerly, the same computation."""

    def __init__(self, model: Qwen3ForCausalLM, layer_caches: list[torch.Tensor], buffers: StepBuffers,
                 buckets: tuple[int, ...]) -> None:
        self.model, self.layer_caches, self.buffers, self.buckets = model, layer_caches, buffers, buckets
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def run(self, plan: StepPlan, layer_done: Callable[[int], None] | None = None) -> torch.Tensor | None:
        """The hidden states of the plan's rows, or None when the step is not one to replay."""
        bucket = replay_bucket(plan, self.buckets, layer_done)
        if bucket is None:
            return None
        input_ids, positions, meta = self.buffers.prepare(pad_decode_plan(plan, bucket))
        graph = self.graphs.get(bucket)
        if graph is None:
            hidden = self.model(input_ids, positions, self.layer_caches, meta)
        else:
            graph.replay()
            hidden = self.outputs[bucket]
        return hidden[:len(plan.token_ids)]

    def capture(self, pool: torch.cuda._POOL_HANDLE | None = None) -> None:
        """One graph per bucket, largest first, in one memory pool (`pool`: one shared with other
        graphs, replayed one at a time); logs the time and memory it took."""
        device = self.buffers.device
        free_before = torch.cuda.mem_get_info(device)[0]
        start = time.perf_counter()
        pool = pool or torch.cuda.graph_pool_handle()
        for bucket in sorted(self.buckets, reverse=True):
            input_ids, positions, meta = self.buffers.prepare(pad_decode_plan(StepPlan(), bucket))
            self.model(input_ids, positions, self.layer_caches, meta)  # warm-up: compiles the kernels
            torch.cuda.synchronize(device)
            if not self.model.capture_safe():  # NOTE: after the warm-up, where a grouped GEMM may refuse
                logger.warning("the model's forward syncs with the host here (MoE experts without a grouped "
                               "GEMM on %s): decode steps run eagerly", device)
                self.graphs.clear()
                self.outputs.clear()
                return
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bucket] = self.model(input_ids, positions, self.layer_caches, meta)
            self.graphs[bucket] = graph
        torch.cuda.synchronize(device)
        used = free_before - torch.cuda.mem_get_info(device)[0]
        logger.info("captured %d decode CUDA graphs (batch sizes %s) in %.2f s, %.1f MiB of GPU memory",
                    len(self.graphs), ",".join(map(str, self.buckets)), time.perf_counter() - start, used / 2**20)
