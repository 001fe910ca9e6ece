"""Piecewise graphs for mixed and prefill steps on CPU (engine/piecewise_graphs.py): the Triton
backend (its kernels in Triton's interpreter, conftest.py) with steps padded to their token bucket
and the model's pieces run eagerly between the eager attentions, the same computation a GPU
replays (only capture and replay need one). Against the unpadded eager forward on the same path:
the same logits and pool (padded rows write no KV), the same greedy tokens and logprobs through
whole requests (chunked prefill beside decodes, prefix-cache hits, fresh prompts; dense and MoE);
`layer_done(l)` fires in order with layer l's K/V in the pool and layer l + 1's not yet; a step
above the largest bucket runs eagerly. And every piece a graph would hold traces with
torch.compile(fullgraph=True) (no graph break, no host sync) for a dense and a MoE model.

NOTE: logits are compared to float32 rounding, not bit for bit: the CPU's GEMM rounds a row
differently with the number of rows (test_batch_invariance.py), and a padded step has more rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_cuda_graphs import BLOCK_SIZE, DECODES, _decode_plan, _mixed_plan, _slots, on_cpu
from test_moe_capture_safe import FORBIDDEN, _OpNames

pytest.importorskip("triton")

from pdserve import LLM, SamplingParams  # noqa: E402
from pdserve.engine import piecewise_graphs  # noqa: E402
from pdserve.engine.model_runner import ModelRunner  # noqa: E402
from pdserve.engine.piecewise_graphs import pad_step_plan, piecewise_bucket, token_buckets  # noqa: E402
from pdserve.engine.step_plan import StepPlan  # noqa: E402
from pdserve.model.demo_checkpoint import PRESETS, write_checkpoint  # noqa: E402
from pdserve.model.layer_ops import layer_ops  # noqa: E402

LOGPROB_ATOL = 1e-4  # as test_batch_invariance.py: float32 rounding; a wrong row moves them by ~0.1


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("piecewise") / "tiny-moe", PRESETS["tiny-moe"], seed=5)


def _model_dir(model: str, model_dirs: dict[str, Path], moe_dir: Path) -> Path:
    return moe_dir if model == "moe" else model_dirs["tiny"]


def _runner(model_dir: Path, **extra: Any) -> ModelRunner:
    """A runner on the Triton path with graphs (decode buckets, token buckets), pool random."""
    llm = LLM(model=str(model_dir), device="cpu", dtype="float32", num_kv_blocks=64, block_size=BLOCK_SIZE,
              max_num_seqs=8, max_model_len=128, **extra)
    runner = llm.engine.runner
    runner.use_paged_step(graphs=True)
    torch.manual_seed(0)
    runner.kv_cache.normal_()
    return runner


def _eager(runner: ModelRunner, plan: StepPlan) -> torch.Tensor | None:
    """The step through the unpadded eager forward (same backend, same step buffers)."""
    graphs, runner.piecewise_graphs = runner.piecewise_graphs, None
    try:
        return runner.run(plan)
    finally:
        runner.piecewise_graphs = graphs


def test_token_buckets_and_padding() -> None:
    assert token_buckets(2048) == (8, 16, 32, 64, 128, 256, 512)
    assert token_buckets(512) == (8, 16, 32, 64, 128, 256, 512)
    assert token_buckets(100) == (8, 16, 32, 64, 100)
    assert token_buckets(5) == (5,)
    buckets = token_buckets(100)
    plan = _mixed_plan()  # 5 decodes, a 5-token chunk over a cached prefix, a fresh 5-token prompt
    assert piecewise_bucket(plan, buckets) == 16
    assert piecewise_bucket(_decode_plan(DECODES[:3]), buckets) == 8  # decode steps too (KV streaming)
    assert piecewise_bucket(StepPlan(), buckets) is None
    assert piecewise_bucket(plan, (8,)) is None  # above the largest bucket: eager
    padded = pad_step_plan(plan, 16)
    assert padded.token_ids[:15] == plan.token_ids and len(padded.token_ids) == len(padded.positions) == 16
    assert padded.slots == plan.slots + [-1] and padded.positions[15] == 0
    assert (padded.decode_rows, padded.prefills, padded.sample_rows) == (plan.decode_rows, plan.prefills,
                                                                       plan.sample_rows)
    assert len(plan.token_ids) == 15  # the step's own plan is left alone


@on_cpu
@pytest.mark.parametrize("model", ["dense", "moe"])
def test_a_mixed_step_through_the_pieces_equals_the_eager_step(model: str, model_dirs: dict[str, Path],
                                                               moe_dir: Path) -> None:
    """Decodes, a chunk over a cached prefix (prefix kernel) and a fresh prompt, padded 15 -> 16
    rows: the eager step's logits and pool; the pool changes at the real rows' slots only."""
    runner = _runner(_model_dir(model, model_dirs, moe_dir))
    plan = _mixed_plan()
    before = runner.kv_cache.clone()
    expected = _eager(runner, plan)
    expected_pool = runner.kv_cache.clone()
    runner.kv_cache.copy_(before)
    assert runner.piecewise_graphs is not None
    runner.piecewise_graphs.attn_out.fill_(float("nan"))  # whatever an earlier step left in padded rows
    hidden = runner.piecewise_graphs.run(plan)
    assert hidden is not None and hidden.shape[0] == 15
    runner.kv_cache.copy_(before)
    got = runner.run(plan)
    assert expected is not None and got is not None
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(runner.piecewise_graphs.attn_out[:16]).all()  # padded rows: zeros, not stale
    torch.testing.assert_close(runner.kv_cache, expected_pool, rtol=1e-5, atol=1e-5)
    flat = runner.kv_cache.view(*runner.kv_cache.shape[:2], -1, *runner.kv_cache.shape[4:])
    others = torch.ones(flat.shape[2], dtype=torch.bool)
    others[torch.tensor(_slots(plan))] = False
    assert torch.equal(flat[:, :, others], before.view(flat.shape)[:, :, others])  # padding wrote nothing


@on_cpu
def test_a_step_above_the_largest_bucket_runs_eagerly(model_dirs: dict[str, Path],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(piecewise_graphs, "MAX_PIECEWISE_TOKENS", 8)
    runner = _runner(model_dirs["tiny"])
    assert runner.piecewise_graphs is not None and runner.piecewise_graphs.buckets == (8,)
    plan = _mixed_plan()
    assert runner.piecewise_graphs.run(plan) is None
    before = runner.kv_cache.clone()
    got = runner.run(plan)
    runner.kv_cache.copy_(before)
    expected = _eager(runner, plan)
    assert got is not None and expected is not None and torch.equal(got, expected)


@on_cpu
def test_layer_done_fires_in_order_once_the_layers_kv_is_in_the_pool(model_dirs: dict[str, Path]) -> None:
    """At layer_done(l): layer l's real slots hold this step's K/V (the eager step's), layer l + 1's
    still the old values. On a GPU the callback's event is recorded after attention l's store."""
    runner = _runner(model_dirs["untied"])  # 3 layers
    plan = _mixed_plan()
    slots = torch.tensor(_slots(plan))
    before = runner.kv_cache.clone()
    _eager(runner, plan)
    want = runner.kv_cache.view(*runner.kv_cache.shape[:2], -1, *runner.kv_cache.shape[4:])[:, :, slots].clone()
    runner.kv_cache.copy_(before)
    flat = runner.kv_cache.view(*runner.kv_cache.shape[:2], -1, *runner.kv_cache.shape[4:])
    old = before.view(flat.shape)[:, :, slots]
    seen: list[int] = []

    def layer_done(layer: int) -> None:
        seen.append(layer)
        torch.testing.assert_close(flat[layer, :, slots], want[layer], rtol=1e-5, atol=1e-5)
        if layer + 1 < flat.shape[0]:
            assert torch.equal(flat[layer + 1, :, slots], old[layer + 1])

    assert runner.piecewise_graphs is not None
    assert runner.piecewise_graphs.run(plan, layer_done) is not None
    assert seen == [0, 1, 2]


@on_cpu
@pytest.mark.parametrize("model", ["dense", "moe"])
def test_greedy_tokens_and_logprobs_equal_with_piecewise_steps(model: str, model_dirs: dict[str, Path],
                                                               moe_dir: Path) -> None:
    """Whole requests (a prompt chunked beside decodes, a prefix-cache hit, a short fresh prompt):
    the same tokens and logprobs with mixed steps through the pieces as fully eager."""
    prompts = [{"prompt_token_ids": ids} for ids in (list(range(10, 40)), list(range(10, 40)) + [7, 8, 9],
                                                     list(range(50, 53)))]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2)
    outputs = {}
    for name in ("eager", "piecewise"):
        llm = LLM(model=str(_model_dir(model, model_dirs, moe_dir)), device="cpu", dtype="float32", num_kv_blocks=64,
                  block_size=BLOCK_SIZE, max_num_seqs=8, max_model_len=128, max_num_batched_tokens=16)
        runner = llm.engine.runner
        runner.use_paged_step(graphs=name == "piecewise")
        calls: list[int] = []
        if runner.piecewise_graphs is not None:
            original = runner.piecewise_graphs.run
            runner.piecewise_graphs.run = lambda plan, layer_done=None, original=original, calls=calls: (  # type: ignore[method-assign]
                calls.append(len(plan.token_ids)) or original(plan, layer_done))
        outputs[name] = [o.outputs[0] for o in llm.generate(prompts, params)]
        assert (name == "eager") == (not calls)
    assert [o.token_ids for o in outputs["piecewise"]] == [o.token_ids for o in outputs["eager"]]
    for got, want in zip(outputs["piecewise"], outputs["eager"], strict=True):
        assert got.logprobs is not None and want.logprobs is not None
        for g, w in zip(got.logprobs, want.logprobs, strict=True):
            assert [t for t, _ in g.top] == [t for t, _ in w.top]
            assert [g.logprob, *(lp for _, lp in g.top)] == pytest.approx([w.logprob, *(lp for _, lp in w.top)],
                                                                          abs=LOGPROB_ATOL, rel=0)


ATTENTION_LAUNCHES = {"triton._store_kv_kernel", "triton._decode_split_kernel", "triton._merge_splits_kernel",
                      "triton._prefix_kernel", "aten.scaled_dot_product_attention", "aten.copy_"}


@on_cpu
def test_between_the_replays_only_attention_launches(model_dirs: dict[str, Path]) -> None:
    """What a piecewise mixed step launches from Python, each piece counted as one replay: L + 1
    replays, one zeroing of the padded rows, and per layer the attention's kernels and one copy
    (the real rows into the pieces' buffer): 5 a layer here against 13 fully eager
    (tests/test_kernel_count.py's counter, bfloat16). Both prompt chunks, the fresh one too, are
    one prefix-kernel launch: no SDPA call, no slice copy a fresh prompt (before: 7 against 15)."""
    from test_kernel_count import KernelCounter, counting_triton

    llm = LLM(model=str(model_dirs["tiny"]), device="cpu", dtype="bfloat16", num_kv_blocks=64,
              block_size=BLOCK_SIZE, max_num_seqs=8, max_model_len=128)
    runner = llm.engine.runner
    runner.use_paged_step(graphs=True)
    pieces, plan = runner.piecewise_graphs, _mixed_plan()
    assert pieces is not None and runner.step_buffers is not None
    counts = {}
    for name in ("eager", "piecewise"):
        counter = KernelCounter()
        piece = pieces._piece

        def replay(*args: Any, counter: KernelCounter = counter, piece: Any = piece) -> Any:
            counter.active = False
            try:
                return piece(*args)
            finally:
                counter.active = True
                counter.ops["graph replay"] += 1

        pieces._piece = replay  # type: ignore[method-assign]
        try:
            with torch.inference_mode(), counting_triton(counter), counter:
                counter.active = True
                if name == "piecewise":
                    pieces.run(plan)
                else:
                    ids, positions, meta = runner.step_buffers.prepare(plan)
                    runner.model(ids, positions, runner.layer_caches, meta)
        finally:
            del pieces._piece
        counts[name] = counter
    layers = runner.model.cfg.num_hidden_layers
    piecewise = counts["piecewise"].ops
    assert piecewise.pop("graph replay") == layers + 1 and piecewise.pop("aten.zero_") == 1
    assert set(piecewise) <= ATTENTION_LAUNCHES, piecewise
    assert piecewise == {"triton._store_kv_kernel": layers, "triton._decode_split_kernel": layers,
                         "triton._prefix_kernel": layers, "aten.copy_": layers}, piecewise
    assert counts["eager"].total == 13 * layers + 2, dict(counts["eager"].ops)


# NOTE: MoE in bfloat16: the grouped GEMM's meta kernel, which tracing runs, takes bfloat16 only (as on CUDA)
@on_cpu
@pytest.mark.parametrize(("preset", "dtype"), [("tiny", "float32"), ("tiny-moe", "bfloat16")])
def test_every_piece_has_no_graph_break_nor_host_sync(preset: str, dtype: str, tmp_path: Path) -> None:
    """What `PiecewiseGraphs.capture` records for a bucket: each piece on its padded inputs."""
    from pdserve.model import triton_fused  # noqa: F401 - registers the fused ops traced below

    llm = LLM(model=str(write_checkpoint(tmp_path / preset, PRESETS[preset], seed=3)), device="cpu", dtype=dtype,
              num_kv_blocks=64, block_size=4, max_num_seqs=8, max_model_len=128)
    runner = llm.engine.runner
    runner.use_paged_step(graphs=True)
    assert runner.step_buffers is not None and runner.piecewise_graphs is not None
    input_ids, positions, meta = runner.step_buffers.prepare(pad_step_plan(_mixed_plan(), 16))
    model, ops = runner.model, layer_ops(meta)
    attn_out = torch.randn(16, model.cfg.num_attention_heads, model.cfg.head_dim).to(model.embed_tokens.weight.dtype)
    torch._dynamo.reset()
    try:
        with torch.inference_mode():
            pieces = [(model.first_piece, (input_ids, positions, ops))]
            inputs = model.first_piece(input_ids, positions, ops)
            pieces += [(model.middle_piece, (index, attn_out, inputs, ops))
                       for index in range(len(model.layers) - 1)]
            pieces.append((model.last_piece, (attn_out, inputs, ops)))
            for piece, args in pieces:
                with _OpNames() as seen:
                    want = piece(*args)
                assert not seen.names & FORBIDDEN, f"host syncs in {piece.__name__}: {seen.names & FORBIDDEN}"
                got = torch.compile(piece, fullgraph=True, backend="eager", dynamic=False)(*args)
                assert all(torch.equal(g, w) for g, w in zip(_tensors(got), _tensors(want), strict=True))
    finally:
        torch._dynamo.reset()


def _tensors(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    return [output.q, output.k, output.v, output.residual]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("model", ["dense", "moe"])
def test_piecewise_graphs_on_cuda_give_the_eager_tokens(model: str, model_dirs: dict[str, Path],
                                                        moe_dir: Path) -> None:
    """On CUDA: each token bucket's pieces captured at start-up (a capture-safe model); greedy tokens with graphs (mixed
    steps replayed piecewise: prompts chunked at 16 tokens beside decodes) equal --enforce-eager's."""
    prompts = [{"prompt_token_ids": list(range(10, 10 + n))} for n in (3, 30, 70, 5, 9)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tokens = {}
    for name, eager in (("graphs", False), ("eager", True)):
        llm = LLM(model=str(_model_dir(model, model_dirs, moe_dir)), device="cuda", dtype="float32",
                  num_kv_blocks=128, block_size=BLOCK_SIZE, max_num_seqs=8, max_model_len=256,
                  max_num_batched_tokens=16, enforce_eager=eager)
        pieces = llm.engine.runner.piecewise_graphs
        if not eager:
            # NOTE: MoE in float32 takes the per-expert loop, which syncs: not captured, eager (capture_safe)
            safe = llm.engine.runner.model.capture_safe()
            assert pieces is not None and sorted(pieces.graphs) == ([8, 16] if safe else [])
            assert all(len(graphs) == len(llm.engine.runner.layer_caches) + 1 for graphs in pieces.graphs.values())
        tokens[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        llm.engine.close()
    assert tokens["graphs"] == tokens["eager"]
