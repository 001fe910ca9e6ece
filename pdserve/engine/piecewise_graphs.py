"""Mixed and prefill steps from piecewise CUDA graphs (vLLM's FULL_AND_PIECEWISE: decode-only steps
replay whole-forward graphs, engine/cuda_graphs.py; every other step of at most the largest token
bucket replays these). Attention is the one part of a layer that reads the step's metadata (which
rows decode, the prompt chunks' spans and contexts, split counts): it runs
eagerly between graphs of everything else, the pieces of `Qwen3ForCausalLM` (model/qwen3.py):

    piece 0        embed, RoPE rows, layer 0 up to its attention       graph  (per token bucket)
    attention 0    store K/V, decode and prefix kernels (and SDPA)     eager  -> layer_done(0)
    piece 1        layer 0 after its attention, layer 1 up to its own   graph
    ...
    piece L        layer L-1 after its attention, the final norm        graph  -> hidden states

so a step is L + 1 replays and L eager attentions. A step is padded to its token bucket (8, 16,
32, ... up to `MAX_PIECEWISE_TOKENS` or the step budget, whichever is less):

    5 decodes + a 6-token chunk, bucket 16:   rows   d0..d4  c0..c5 | 5 padded rows
                                              slot   real slots     | -1 (writes no KV)
                                              attn   the kernels'   | 0 (no sequence covers them)

Padded rows take part in no attention; their rows of the attention-output buffer are zeroed once a
step, so every row a piece computes is finite (an MoE router sees finite values; real rows never
read padded ones). Each bucket's pieces read their inputs at fixed addresses: the step buffers' ids
and positions (step_buffers.py), the previous piece's outputs, and that one attention-output buffer,
shared by all pieces and buckets, into which each attention's real rows are copied (one copy a
layer: the backends allocate their output). `layer_done(l)` (KV streaming) runs right after attention l is launched: its
K/V writes are on the stream before whatever the callback records there (transport/ready.py).
Without `capture()` (CPU, the tests) the same pieces run eagerly at the padded shape.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from pdserve.engine.cuda_graphs import bucket_for
from pdserve.engine.step_buffers import PAD_SLOT, StepBuffers
from pdserve.engine.step_plan import StepPlan
from pdserve.model.attention_backend import StepMetadata
from pdserve.model.layer_ops import LayerOps, layer_ops
from pdserve.model.qwen3 import LayerInputs, Qwen3ForCausalLM

logger = logging.getLogger(__name__)

MAX_PIECEWISE_TOKENS = 512  # vLLM's default largest capture size; larger steps amortise their launches
_MIN_BUCKET = 8

Piece = LayerInputs | torch.Tensor  # a piece's output: the next attention's inputs, or the hidden states


def token_buckets(max_tokens: int) -> tuple[int, ...]:
    """8, 16, 32, ... below the largest, then the largest: min(MAX_PIECEWISE_TOKENS, max_tokens).
    2048 -> (8, 16, ..., 512); 100 -> (8, 16, 32, 64, 100); 5 -> (5,)."""
    largest = min(MAX_PIECEWISE_TOKENS, max_tokens)
    buckets, size = [], _MIN_BUCKET
    while size < largest:
        buckets.append(size)
        size *= 2
    return (*buckets, largest)


def piecewise_bucket(plan: StepPlan, buckets: tuple[int, ...]) -> int | None:
    """The token bucket a step runs at, or None (eager): no token, or more than the largest bucket."""
    return bucket_for(len(plan.token_ids), buckets) if plan.token_ids else None


def pad_step_plan(plan: StepPlan, bucket: int) -> StepPlan:
    """`plan` with rows appended up to `bucket`: token 0 at position 0, slot -1 (no KV written), in
    no decode and no prompt span; sampling and prompt-logprob rows are the real ones, unchanged."""
    pad = bucket - len(plan.token_ids)
    assert pad >= 0
    return replace(plan, token_ids=plan.token_ids + [0] * pad, positions=plan.positions + [0] * pad,
                   slots=plan.slots + [PAD_SLOT] * pad, decode_arrays=None)


class PiecewiseGraphs:
    """Steps by token bucket. `capture()` (CUDA) records each bucket's L + 1 pieces; without it (or
    for a bucket not captured) the padded step's pieces run eagerly, the same computation."""

    def __init__(self, model: Qwen3ForCausalLM, layer_caches: list[torch.Tensor], buffers: StepBuffers,
                 buckets: tuple[int, ...]) -> None:
        self.model, self.layer_caches, self.buffers, self.buckets = model, layer_caches, buffers, buckets
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.outputs: dict[int, list[Piece]] = {}
        cfg = model.cfg
        self.attn_out = torch.zeros(buckets[-1], cfg.num_attention_heads, cfg.head_dim,
                                    dtype=model.embed_tokens.weight.dtype, device=buffers.device)

    def run(self, plan: StepPlan, layer_done: Callable[[int], None] | None = None) -> torch.Tensor | None:
        """The hidden states of the plan's rows, or None when the step runs eagerly instead."""
        bucket = piecewise_bucket(plan, self.buckets)
        if bucket is None:
            return None
        input_ids, positions, meta = self.buffers.prepare(pad_step_plan(plan, bucket))
        return self._forward(bucket, len(plan.token_ids), input_ids, positions, meta, layer_done)

    def _forward(self, bucket: int, num_tokens: int, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: StepMetadata, layer_done: Callable[[int], None] | None) -> torch.Tensor:
        attn_out = self.attn_out[:bucket]
        attn_out[num_tokens:].zero_()  # NOTE: the padded rows, which no attention kernel writes
        graphs, ops = self.graphs.get(bucket), layer_ops(meta)
        result: Piece | None = None
        for piece in range(len(self.layer_caches) + 1):
            if piece:
                layer = piece - 1
                assert isinstance(result, LayerInputs)
                out = self.model.attention(layer, result, self.layer_caches[layer], meta)
                attn_out[:num_tokens].copy_(out[:num_tokens])  # NOTE: the pieces read it here
                if layer_done is not None:
                    layer_done(layer)
            if graphs is None:
                result = self._piece(piece, result, input_ids, positions, attn_out, ops)
            else:
                graphs[piece].replay()
                result = self.outputs[bucket][piece]
        assert isinstance(result, torch.Tensor)
        return result[:num_tokens]

    def _piece(self, piece: int, inputs: Piece | None, input_ids: torch.Tensor, positions: torch.Tensor,
               attn_out: torch.Tensor, ops: LayerOps) -> Piece:
        """Piece `piece` of the forward (what its graph holds)."""
        model = self.model
        if piece == 0:
            return model.first_piece(input_ids, positions, ops)
        assert isinstance(inputs, LayerInputs)
        if piece < len(self.layer_caches):
            return model.middle_piece(piece - 1, attn_out, inputs, ops)
        return model.last_piece(attn_out, inputs, ops)

    def capture(self, pool: torch.cuda._POOL_HANDLE | None = None) -> None:
        """Each bucket's pieces, largest bucket first, all in one memory pool (`pool`: the decode
        graphs', engine/cuda_graphs.py); logs the time and memory it took."""
        device = self.buffers.device
        free_before = torch.cuda.mem_get_info(device)[0]
        start = time.perf_counter()
        pool = pool or torch.cuda.graph_pool_handle()
        for bucket in sorted(self.buckets, reverse=True):
            input_ids, positions, meta = self.buffers.prepare(pad_step_plan(StepPlan(), bucket))
            self._forward(bucket, 0, input_ids, positions, meta, None)  # warm-up: compiles the kernels
            torch.cuda.synchronize(device)
            if not self.model.capture_safe():  # NOTE: after the warm-up, where a grouped GEMM may refuse
                logger.warning("the model's forward syncs with the host here (MoE experts without a grouped "
                               "GEMM on %s): mixed steps run eagerly", device)
                self.graphs.clear()
                self.outputs.clear()
                return
            graphs: list[torch.cuda.CUDAGraph] = []
            outputs: list[Piece] = []
            for piece in range(len(self.layer_caches) + 1):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    outputs.append(self._piece(piece, outputs[-1] if outputs else None, input_ids, positions,
                                               self.attn_out[:bucket], layer_ops(meta)))
                graphs.append(graph)
            self.graphs[bucket], self.outputs[bucket] = graphs, outputs
        torch.cuda.synchronize(device)
        used = free_before - torch.cuda.mem_get_info(device)[0]
        logger.info("captured piecewise CUDA graphs for %d token buckets (%s), %d pieces each, in %.2f s, "
                    "%.1f MiB of GPU memory", len(self.graphs), ",".join(map(str, self.buckets)),
                    len(self.layer_caches) + 1, time.perf_counter() - start, used / 2**20)
