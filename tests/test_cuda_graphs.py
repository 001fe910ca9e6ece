"""The GPU step path on CPU: the Triton backend (its kernels in Triton's interpreter, conftest.py)
with persistent step buffers, and decode steps padded to their CUDA-graph bucket, run eagerly
(engine/cuda_graphs.py; only capture and replay need a GPU). Against the CPU path
(model/attention.py): the same logits; a padded row never writes the pool; a padded step gives
the unpadded step's outputs; greedy generation gives the same tokens. With a GPU (no interpreter),
the last test checks replayed graphs against `--enforce-eager` and the CPU path on CUDA."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import MODEL_NAMES
from test_decode_attention import decode_plan

pytest.importorskip("triton")

from pdserve import LLM, SamplingParams  # noqa: E402
from pdserve.engine.cuda_graphs import bucket_for, decode_buckets, pad_decode_plan, replay_bucket  # noqa: E402
from pdserve.engine.model_runner import ModelRunner  # noqa: E402
from pdserve.engine.step_plan import PlannedPrefill, StepPlan  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # conftest.py: set when there is no GPU
on_cpu = pytest.mark.skipif(not INTERPRETED, reason="Triton kernels on CPU tensors need Triton's interpreter")
BLOCK_SIZE = 4
# (block table, context length): a run; scattered, ending mid-block; one block (no decode uses block 0)
DECODES = [([3, 4, 5], 12), ([10, 11, 12, 30, 20], 18), ([40, 33, 34, 35], 14), ([60], 2), ([13, 14], 7)]


def _decode_plan(decodes: list[tuple[list[int], int]]) -> StepPlan:
    return decode_plan(decodes, BLOCK_SIZE)


def _mixed_plan() -> StepPlan:
    """The decodes, then a 5-token chunk over 6 cached tokens (blocks 50..52, context 11), then a
    fresh 5-token prompt (blocks 61..62), in one step."""
    plan = _decode_plan(DECODES)
    for table, cached, new in (([50, 51, 52], 6, 5), ([61, 62], 0, 5)):
        _add_prompt_chunk(plan, table, cached, new)
    return plan


def _add_prompt_chunk(plan: StepPlan, table: list[int], cached: int, new: int) -> None:
    """A chunk of `new` tokens after `cached` ones of a prompt whose blocks are `table`; it samples."""
    start = len(plan.token_ids)
    plan.token_ids.extend(range(200 + cached, 200 + cached + new))
    plan.positions.extend(range(cached, cached + new))
    plan.slots.extend(table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(cached, cached + new))
    plan.prefills.append(PlannedPrefill(start, start + new, cached + new, table))
    plan.sample_rows.append(start + new - 1)


def _fresh_prompts_plan() -> StepPlan:
    """Two decodes, then three fresh prompts of 1, 13 and 23 tokens (one prefix-kernel launch a
    layer on a float pool: its query tiles, masked rows and causal diagonal at several lengths)."""
    plan = _decode_plan(DECODES[:2])
    for table, new in (([50], 1), ([51, 52, 53, 54], 13), ([55, 56, 57, 58, 59, 61], 23)):
        _add_prompt_chunk(plan, table, 0, new)
    return plan


def _runner(model_dirs: dict[str, Path], model: str) -> ModelRunner:
    llm = LLM(model=str(model_dirs[model]), device="cpu", dtype="float32", num_kv_blocks=64, block_size=BLOCK_SIZE,
              max_num_seqs=8, max_model_len=128)
    runner = llm.engine.runner
    assert runner.step_buffers is None and runner.decode_graphs is None  # CPU: the torch backend
    torch.manual_seed(0)
    runner.kv_cache.normal_()  # every block holds some earlier tokens' K/V
    return runner


def _slots(plan: StepPlan) -> list[int]:
    return [s for s in plan.slots if s >= 0]


def test_buckets() -> None:
    assert decode_buckets(256) == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert decode_buckets(48) == (1, 2, 4, 8, 16, 32, 48)
    assert decode_buckets(1) == (1,)
    buckets = decode_buckets(48)
    assert [bucket_for(n, buckets) for n in (1, 2, 3, 5, 16, 17, 33, 48, 49)] == [1, 2, 4, 8, 16, 32, 48, 48, None]
    decode = _decode_plan(DECODES[:3])
    assert replay_bucket(decode, buckets, None) == 4
    assert replay_bucket(_mixed_plan(), buckets, None) is None  # a mixed step runs eagerly
    prefill_only = _mixed_plan()
    prefill_only.decode_rows, prefill_only.decode_tables, prefill_only.decode_lens = [], [], []
    assert replay_bucket(prefill_only, buckets, None) is None
    assert replay_bucket(StepPlan(), buckets, None) is None
    assert replay_bucket(decode, (1, 2), None) is None  # above the largest bucket
    assert replay_bucket(decode, buckets, lambda layer: None) is None  # KV streaming calls back per layer


def test_pad_decode_plan() -> None:
    plan = _decode_plan(DECODES[:3])
    padded = pad_decode_plan(plan, 8)
    assert padded.token_ids[:3] == plan.token_ids and len(padded.token_ids) == len(padded.positions) == 8
    assert padded.slots == plan.slots + [-1] * 5
    assert padded.decode_rows == list(range(8)) and padded.decode_lens == plan.decode_lens + [1] * 5
    assert padded.decode_tables == plan.decode_tables + [[0]] * 5
    assert padded.sample_rows == plan.sample_rows and padded.prompt_rows == plan.prompt_rows
    assert len(plan.token_ids) == 3  # the step's own plan is left alone


@on_cpu
@pytest.mark.parametrize("model", MODEL_NAMES)  # GQA 4 query heads on 2 KV heads, and on 1
@pytest.mark.parametrize(("make_plan", "max_query_len"), [(_mixed_plan, 5), (_fresh_prompts_plan, 23)],
                         ids=["mixed", "fresh-prompts"])
def test_triton_backend_matches_cpu_backend(model: str, model_dirs: dict[str, Path], make_plan: Any,
                                            max_query_len: int) -> None:
    """A mixed step (decodes, a prompt chunk over a cached prefix, a fresh prompt), and a step of
    fresh prompts beside decodes: the same logits and the same pool after it."""
    runner = _runner(model_dirs, model)
    before = runner.kv_cache.clone()
    plan = make_plan()
    expected = runner.run(plan)
    expected_pool = runner.kv_cache.clone()
    runner.kv_cache.copy_(before)
    runner.use_paged_step(graphs=False)
    input_ids, _, meta = runner._prepare(plan)
    assert input_ids.dtype == torch.int32 and meta.max_prefix_query_len == max_query_len  # type: ignore[union-attr]
    got = runner.run(plan)
    assert expected is not None and got is not None
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(runner.kv_cache, expected_pool, rtol=1e-5, atol=1e-5)


@on_cpu
@pytest.mark.parametrize("max_num_seqs", [1, 2, 3])
def test_the_prefill_warm_up_fits_any_max_num_seqs(model_dirs: dict[str, Path], max_num_seqs: int) -> None:
    """The start-up warm-up (a decode, a chunk over a cached prefix, a fresh prompt) fits the step
    buffers at any `--max-num-seqs`: below 3 its sequences run one at a time (at 2 the mixed step
    once raised, its fresh prompt being a prefix-kernel sequence too)."""
    llm = LLM(model=str(model_dirs["tiny"]), device="cpu", dtype="float32", num_kv_blocks=16, block_size=BLOCK_SIZE,
              max_num_seqs=max_num_seqs, max_model_len=64)
    runner = llm.engine.runner
    runner.use_paged_step(graphs=True)
    before = runner.kv_cache.clone()
    runner.warm_up_prefill()
    assert torch.equal(runner.kv_cache, before)  # it writes no KV


@on_cpu
def test_padded_decode_step_writes_real_slots_only(model_dirs: dict[str, Path]) -> None:
    """Decode steps padded to their bucket (3 -> 4, 4 -> 4, 1 -> 1, 5 -> 8 rows): the logits equal
    the unpadded step's; the pool changes at the real rows' slots only (padded rows: slot -1)."""
    runner = _runner(model_dirs, "tiny")
    runner.use_paged_step(graphs=True)
    assert runner.decode_graphs is not None and runner.decode_graphs.buckets == (1, 2, 4, 8)
    before = runner.kv_cache.clone()
    for decodes, bucket in ((DECODES[:3], 4), (DECODES[:4], 4), (DECODES[1:2], 1), (DECODES, 8)):
        plan = _decode_plan(decodes)
        runner.kv_cache.copy_(before)
        graphs, runner.decode_graphs = runner.decode_graphs, None
        unpadded = runner.run(plan)  # eager, as many rows as decodes
        unpadded_pool = runner.kv_cache.clone()
        runner.decode_graphs = graphs
        runner.kv_cache.copy_(before)
        assert replay_bucket(plan, graphs.buckets, None) == bucket
        padded = runner.run(plan)
        assert padded is not None and unpadded is not None and padded.shape == unpadded.shape
        torch.testing.assert_close(padded, unpadded, rtol=1e-5, atol=1e-5)
        pool = runner.kv_cache
        flat = pool.view(*pool.shape[:2], -1, *pool.shape[4:])  # [layer, k|v, slot, head, dim]
        written = torch.tensor(_slots(plan))
        others = torch.ones(flat.shape[2], dtype=torch.bool)
        others[written] = False
        assert torch.equal(flat[:, :, others], before.view(flat.shape)[:, :, others])  # padding wrote nothing
        assert not torch.equal(flat[:, :, written], before.view(flat.shape)[:, :, written])
        torch.testing.assert_close(runner.kv_cache, unpadded_pool, rtol=1e-5, atol=1e-5)


@on_cpu
def test_greedy_generation_equal_on_the_gpu_step_path(model_dirs: dict[str, Path]) -> None:
    """Whole requests through the Triton backend with padded decode steps (prefix cache hits,
    chunked prefill, decodes joining and leaving) give the CPU path's tokens."""
    prompts = [{"prompt_token_ids": ids} for ids in (list(range(10, 40)), list(range(10, 40)) + [7, 8, 9],
                                                     list(range(50, 53)))]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm = LLM(model=str(model_dirs["tiny"]), device="cpu", dtype="float32", num_kv_blocks=64,
              block_size=BLOCK_SIZE, max_num_seqs=8, max_model_len=128, max_num_batched_tokens=16)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    llm.engine.runner.use_paged_step(graphs=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_decode_graphs_on_cuda_give_the_eager_and_cpu_tokens(model_dirs: dict[str, Path]) -> None:
    """On CUDA: one graph per bucket captured at start-up; greedy tokens with graphs equal those of
    --enforce-eager and of the CPU path (float32)."""
    prompts = [{"prompt_token_ids": list(range(10, 10 + n))} for n in (3, 30, 70, 5, 9)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    common = {"dtype": "float32", "num_kv_blocks": 128, "block_size": BLOCK_SIZE, "max_num_seqs": 8,
              "max_model_len": 256}
    tokens = {}
    for name, extra in (("graphs", {"device": "cuda"}), ("eager", {"device": "cuda", "enforce_eager": True}),
                        ("cpu", {"device": "cpu"})):
        llm = LLM(model=str(model_dirs["tiny"]), **common, **extra)
        runner = llm.engine.runner
        if name == "graphs":
            assert runner.decode_graphs is not None and sorted(runner.decode_graphs.graphs) == [1, 2, 4, 8]
        if name == "eager":
            assert runner.decode_graphs is None and runner.step_buffers is not None
        tokens[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        llm.engine.close()
    assert tokens["graphs"] == tokens["eager"] == tokens["cpu"]


def test_backend_by_device_and_splits_by_batch_size() -> None:
    from pdserve.model.attention_backend import TORCH, TRITON, decode_splits, select_backend

    assert select_backend(torch.device("cpu")) is TORCH
    assert select_backend(torch.device("cuda")) is TRITON  # triton is installed here (the test extra)
    assert not TORCH.graph_safe and TRITON.graph_safe
    # 132 SMs, 8 KV heads: small batches split up to 16 ways, a batch that fills the GPU not at all
    assert [decode_splits(b, 8, 132) for b in (1, 2, 4, 16, 33, 64, 256)] == [16, 16, 8, 2, 1, 1, 1]
    assert all(s & (s - 1) == 0 for b in range(1, 300) for s in [decode_splits(b, 2, 4)])


def test_step_buffers_keep_their_addresses() -> None:
    """A bucket's inputs are views at the same addresses whatever the step (what a captured graph
    reads), filled with this step's values; a step larger than the buffers is refused."""
    from pdserve.engine.step_buffers import StepBuffers

    buffers = StepBuffers(max_tokens=16, max_seqs=8, max_blocks_per_seq=6, device=torch.device("cpu"),
                          splits=lambda n: 2)
    first = buffers.prepare(pad_decode_plan(_decode_plan(DECODES[:3]), 4))
    pointers = [t.data_ptr() for t in (first[0], first[1], first[2].slot_mapping, first[2].decode_tables,
                                       first[2].decode_lens, first[2].decode_rows)]
    second = buffers.prepare(pad_decode_plan(_decode_plan(DECODES[1:5]), 4))
    ids, positions, meta = second
    assert [t.data_ptr() for t in (ids, positions, meta.slot_mapping, meta.decode_tables, meta.decode_lens,
                                   meta.decode_rows)] == pointers
    assert meta.decode_lens.tolist() == [n for _, n in DECODES[1:5]]
    assert meta.decode_tables[0, :5].tolist() == DECODES[1][0] and meta.num_splits == 2
    assert meta.slot_mapping.tolist() == _decode_plan(DECODES[1:5]).slots and ids.dtype == torch.int32
    # a float pool: both prompt chunks, the fresh one too, are prefix-kernel sequences (one launch)
    mixed = buffers.prepare(_mixed_plan())[2]
    assert mixed.prefix_lens.tolist() == [11, 5] and mixed.prefix_tables[0, :3].tolist() == [50, 51, 52]
    assert mixed.prefix_tables[1, :2].tolist() == [61, 62] and mixed.max_prefix_query_len == 5
    assert (mixed.prefix_starts.tolist(), mixed.prefix_ends.tolist()) == ([5, 10], [10, 15])
    assert mixed.fresh_prefills == () and mixed.decode_lens.tolist() == [n for _, n in DECODES]
    def fresh_apart(kv_quant: object, below: int | None) -> bool:
        other = StepBuffers(max_tokens=16, max_seqs=8, max_blocks_per_seq=6, device=torch.device("cpu"),
                            splits=lambda n: 2, kv_quant=kv_quant)  # type: ignore[arg-type]
        if below is not None:
            other.fresh_in_kernel_below = below
        meta = other.prepare(_mixed_plan())[2]
        first = (meta.prefix_starts.tolist()[0], meta.prefix_ends.tolist()[0], meta.prefix_lens.tolist()[0])
        assert first == (5, 10, 11)  # the chunk over a cached prefix: the kernel's, always
        assert meta.fresh_prefills in {((10, 15),), ()} and len(meta.prefix_lens) == 2 - len(meta.fresh_prefills)
        return bool(meta.fresh_prefills)

    # the fresh prompt attends to its own new K/V apart (one SDPA call) on an FP8 pool, on a pool of
    # another float dtype than the model's (the runner sets 0), and from `fresh_in_kernel_below` tokens
    assert fresh_apart(object(), None) and fresh_apart(None, 0) and fresh_apart(None, 5)
    assert not fresh_apart(None, 6) and not fresh_apart(None, None)
    with pytest.raises(ValueError, match="exceeds the step buffers"):
        buffers.prepare(_decode_plan([([1, 2, 3, 4, 5, 6, 7], 27)]))
