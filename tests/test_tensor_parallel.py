"""Tensor parallelism (`tensor_parallel_size=2`, shared memory and gloo on CPU): the same tokens as one process, the
same seeded samples, no block left behind, and a rank that dies ends the engine (no hang).

Models: `tiny` (GQA 4/2: each rank one KV head) and `untied` (GQA 4/1: the KV head replicated on
both ranks, untied vocabulary-parallel head, sharded checkpoint); head_dim != hidden / heads."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from helpers import assert_no_leak, generate_texts, generate_token_ids, greedy, random_prompt, token_prompts
from pd_fixtures import start_cluster, stop_cluster
from server_fixtures import parse_sse

from pdserve import LLM, SamplingParams, envs
from pdserve.config import EngineArgs, create_engine_config
from pdserve.disagg.config import RouterConfig, WorkerConfig
from pdserve.disagg.kv_layout import KVLayout, KVLayoutMismatch
from pdserve.disagg.transport import nixl_available
from pdserve.engine import shared_memory_group
from pdserve.engine.async_llm import AsyncLLM, EngineDeadError
from pdserve.engine.tensor_parallel import RankDiedError, TPModelRunner
from pdserve.model.parallel import TPShard, check_tp_size
from pdserve.model.qwen3_config import Qwen3ModelConfig
from pdserve.ops.up import CommandLines, Replicas, UpOptions

# a short prompt, one crossing blocks, one cut into chunks by the 32-token budget (a chunk that
# reads earlier context back from the pool, next to running decodes); 12 blocks of 8 tokens do not
# hold all three at once: requests are preempted and swapped out and in (each rank its own heads)
PROMPTS = [random_prompt(n, seed) for n, seed in ((5, 1), (23, 2), (70, 3))]
ENGINE_ARGS: dict[str, Any] = {"block_size": 8, "max_num_batched_tokens": 32, "num_kv_blocks": 12,
                               "swap_space": 0.002}


def test_kv_layouts_of_different_tp_sizes_map_and_another_head_range_is_refused_by_name() -> None:
    one = KVLayout("m", "float32", "float32", 16, 2, 2, 32)
    assert one.tp_size == 1
    one.check_compatible(KVLayout("m", "float32", "float32", 16, 2, 2, 32, tp_size=2))  # both pools hold every head
    with pytest.raises(KVLayoutMismatch, match="kv_head_start") as refused:
        one.check_compatible(KVLayout("m", "float32", "float32", 16, 2, 2, 32, kv_head_start=2))
    assert refused.value.field == "kv_head_start"
    assert KVLayout.from_json(KVLayout("m", "float32", "float32", 16, 2, 2, 32, tp_size=4).to_json()).tp_size == 4


@pytest.mark.parametrize(("size", "error"), [(0, "must be >= 1"), (3, "must divide num_attention_heads"),
                                             (8, "must divide num_attention_heads")])
def test_a_tp_size_the_model_cannot_be_split_over_is_refused(model_dirs: dict[str, Path], size: int,
                                                             error: str) -> None:
    with pytest.raises(ValueError, match=error):
        create_engine_config(EngineArgs(model=str(model_dirs["tiny"]), tensor_parallel_size=size))


def test_kv_heads_are_sharded_or_replicated_and_each_rank_holds_the_head_its_queries_read(
        model_dirs: dict[str, Path]) -> None:
    cfg = Qwen3ModelConfig.from_dir(model_dirs["tiny"])  # 4 query heads, 2 KV heads
    assert [TPShard(r, 2).kv_head_range(cfg) for r in range(2)] == [(0, 1), (1, 2)]
    assert [TPShard(r, 4).kv_head_range(cfg) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    for size in (2, 4):  # rank r's first query head r*4/size belongs to KV head (r*4/size) // 2
        assert all(TPShard(r, size).kv_head_range(cfg)[0] == (r * 4 // size) // 2 for r in range(size))
    wide = dataclasses.replace(cfg, num_attention_heads=12, num_key_value_heads=4)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        check_tp_size(wide, 3)


def test_up_splits_a_workers_cores_over_its_ranks() -> None:
    options = UpOptions(port=8000, prefill=Replicas(1, 1), decode=Replicas(1, 1), supervisor_port=8001)
    for flags, want in ((("--tensor-parallel-size", "2"), 4), (("--tensor-parallel-size=4",), 2), ((), 8)):
        argv = CommandLines(options, RouterConfig(), WorkerConfig(), flags, cpus=16)("decode", 9002, 2)
        assert int(argv[argv.index("--num-threads") + 1]) == want, flags


@pytest.fixture(scope="module", params=["tiny", "untied"])
def tp_pair(request: pytest.FixtureRequest, model_dirs: dict[str, Path],
            llm_factory: Callable[..., LLM]) -> Iterator[tuple[LLM, LLM]]:
    """(one process, two ranks) on the same model and settings; the untied model's ranks share a
    pool committed at start-up (`kv_cache_prefault`)."""
    name = request.param
    tp = LLM(model=str(model_dirs[name]), dtype="float32", tensor_parallel_size=2, num_threads=1,
             kv_cache_prefault=name == "untied", **ENGINE_ARGS)
    yield llm_factory(name, **ENGINE_ARGS), tp
    tp.engine.close()


@pytest.mark.slow
def test_tp2_greedy_tokens_and_logprobs_match_one_process(tp_pair: tuple[LLM, LLM]) -> None:
    single, tp = tp_pair
    params = greedy(10, logprobs=5)
    expected = single.generate(token_prompts(PROMPTS), params)
    got = tp.generate(token_prompts(PROMPTS), params)
    for want, have in zip(expected, got, strict=True):
        assert have.outputs[0].token_ids == want.outputs[0].token_ids
        for want_lp, have_lp in zip(want.outputs[0].logprobs or [], have.outputs[0].logprobs or [], strict=True):
            assert want_lp is not None and have_lp is not None
            assert [t for t, _ in have_lp.top] == [t for t, _ in want_lp.top]
            assert max(abs(a - b) for (_, a), (_, b) in zip(have_lp.top, want_lp.top, strict=True)) < 1e-4
    assert_no_leak(tp)
    assert tp.engine.stats().num_preemptions > 0 and tp.engine.scheduler.config.preemption_mode == "swap"
    runner = tp.engine.runner
    assert isinstance(runner, TPModelRunner) and all(p.poll() is None for p in runner.processes)
    if shared_memory_group.available():  # the all-reduces went through shared memory, the logits' gather
        assert runner.group.shared is not None and runner.group.shared.calls > 0  # (too big a slot) gloo
        assert not runner.group.shared.fits(torch.empty(1, tp.engine.config.model.vocab_size // 2))


@pytest.mark.slow
def test_tp2_prompt_logprobs_match_one_process(tp_pair: tuple[LLM, LLM]) -> None:
    """The prompt rows' logits come from the LM head every rank runs (an all-gather), handed to rank
    0's prompt-logprobs callback (ModelRunner._logits; these steps' prompt rows fit one chunk): the
    same entries as one process."""
    single, tp = tp_pair
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    expected = single.generate(token_prompts(PROMPTS[1:]), params)
    got = tp.generate(token_prompts(PROMPTS[1:]), params)
    for want, have in zip(expected, got, strict=True):
        assert want.prompt_logprobs is not None and have.prompt_logprobs is not None
        assert len(have.prompt_logprobs) == len(want.prompt_logprobs)
        for want_lp, have_lp in zip(want.prompt_logprobs[1:], have.prompt_logprobs[1:], strict=True):
            assert want_lp is not None and have_lp is not None
            assert (have_lp.token_id, [t for t, _ in have_lp.top]) == (want_lp.token_id, [t for t, _ in want_lp.top])
            assert abs(have_lp.logprob - want_lp.logprob) < 1e-4
            # NOTE: a random model's prompt token sits among ~10^5 logits within float noise of its own,
            # and the all-reduce's order of sums is not one process's: its rank may move by one
            assert abs(have_lp.rank - want_lp.rank) <= 2
    assert_no_leak(tp)


@pytest.mark.slow
def test_tp2_seeded_sampling_matches_one_process(tp_pair: tuple[LLM, LLM]) -> None:
    single, tp = tp_pair
    params = [SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=seed, max_tokens=8, ignore_eos=True)
              for seed in (7, 8, 9)]
    assert generate_token_ids(tp, PROMPTS, params) == generate_token_ids(single, PROMPTS, params)
    assert_no_leak(tp)


@pytest.mark.slow
def test_rank_0_reports_a_layer_of_the_shared_pool_once_every_rank_wrote_it(tp_pair: tuple[LLM, LLM],
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """KV streaming sends a layer's every head out of the shared pool as soon as rank 0 reports it, so
    rank 0 reports layer l only past a collective each rank enters after writing l (its o_proj
    all-reduce), never straight after its own attention l, when rank 1 may not have written yet."""
    _, tp = tp_pair
    runner = tp.engine.runner
    assert isinstance(runner, TPModelRunner) and runner.rank_pools is None
    model, events = runner.model, []
    attention, all_reduce = model.attention, model.group.all_reduce

    def record_attention(index: int, *args: Any) -> torch.Tensor:
        out = attention(index, *args)
        events.append(("attention", index))
        return out

    def record_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
        out = all_reduce(tensor)
        events.append(("all_reduce", None))
        return out

    monkeypatch.setattr(model, "attention", record_attention)
    monkeypatch.setattr(model.group, "all_reduce", record_all_reduce)
    monkeypatch.setattr(tp.engine, "layer_observer", lambda layer, chunks: events.append(("reported", layer)))
    generate_token_ids(tp, PROMPTS[1:2], greedy(2))
    num_layers = model.cfg.num_hidden_layers
    reported = [layer for kind, layer in events if kind == "reported"]
    assert reported and reported == list(range(num_layers)) * (len(reported) // num_layers)
    for at, (kind, layer) in enumerate(events):
        if kind == "attention":
            until = events.index(("reported", layer), at)
            assert ("all_reduce", None) in events[at:until], f"layer {layer} reported before an all-reduce"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_rank_killed_mid_step_ends_the_engine_without_hanging(model_dirs: dict[str, Path]) -> None:
    llm = LLM(model=str(model_dirs["tiny"]), dtype="float32", tensor_parallel_size=2, num_threads=1, **ENGINE_ARGS)
    engine = llm.engine
    runner = engine.runner
    assert isinstance(runner, TPModelRunner)
    rank1 = runner.processes[0]

    def kill_rank1_at_layer0(layer: int, _chunks: object) -> None:
        if layer == 0 and rank1.poll() is None:
            os.kill(rank1.pid, signal.SIGKILL)
            rank1.wait()  # it is gone before rank 0 reaches the next all-reduce

    engine.layer_observer = kill_rank1_at_layer0
    try:
        with pytest.raises(RuntimeError):  # the collective fails: its peer is gone
            llm.generate(token_prompts(PROMPTS[:2]), greedy(4))
        assert_no_leak(llm)
        engine.layer_observer = None
        with pytest.raises(RankDiedError, match="rank 1 exited"):  # caught before any collective
            llm.generate(token_prompts(PROMPTS[:1]), greedy(4))
        client = AsyncLLM(engine)
        fatal: list[BaseException] = []
        client.on_fatal = fatal.append

        async def run_one() -> BaseException | None:
            try:
                async for _ in client.generate("r", PROMPTS[0], greedy(4)):
                    pass
            except EngineDeadError as exc:
                return exc
            return None

        assert isinstance(asyncio.run(asyncio.wait_for(run_one(), timeout=30)), EngineDeadError)
        client._thread.join(10)
        assert not client.alive and len(fatal) == 1 and isinstance(fatal[0], RankDiedError)
        assert not engine.has_unfinished_requests()
    finally:
        engine.close()


NIXL = pytest.mark.skipif(not nixl_available(), reason="nixl_cu12 is not installed")


@pytest.mark.slow
@pytest.mark.parametrize(("transport", "prefill_tp", "decode_tp", "decode_kv", "rank_pools"),
                         [("tcp", 2, 1, "auto", False), ("tcp", 1, 2, "auto", False),
                          pytest.param("nixl", 2, 1, "bfloat16", False, marks=NIXL),
                          pytest.param("nixl", 1, 2, "auto", False, marks=NIXL),
                          ("tcp", 2, 1, "auto", True), ("tcp", 1, 2, "auto", True), ("tcp", 2, 2, "auto", True),
                          pytest.param("nixl", 2, 1, "bfloat16", True, marks=NIXL),
                          pytest.param("nixl", 2, 2, "auto", True, marks=NIXL),
                          pytest.param("nixl", 1, 2, "auto", True, marks=NIXL)],
                         ids=["tcp-P-TP2-to-D-TP1", "tcp-P-TP1-to-D-TP2", "nixl-P-TP2-to-D-TP1-KV-bf16",
                              "nixl-P-TP1-to-D-TP2",
                              "tcp-rank-pools-P-TP2-to-D-TP1", "tcp-rank-pools-P-TP1-to-D-TP2",
                              "tcp-rank-pools-P-TP2-to-D-TP2", "nixl-rank-pools-P-TP2-to-D-TP1-KV-bf16",
                              "nixl-rank-pools-P-TP2-to-D-TP2", "nixl-rank-pools-P-TP1-to-D-TP2"])
def test_pd_hand_off_between_tp_sizes_matches_colocated(model_dirs: dict[str, Path], llm_factory: Callable[..., LLM],
                                                        monkeypatch: pytest.MonkeyPatch, transport: str,
                                                        prefill_tp: int, decode_tp: int, decode_kv: str,
                                                        rank_pools: bool) -> None:
    """`decode_kv` bfloat16: the hand-off also converts (prefill's pool is float32, its ranks'
    shared one); the reference is then a colocated engine with a bfloat16 pool, which rounds the
    prompt's KV as decode does on arrival (prefill reads its own earlier chunks back unrounded, as
    the reference, which computes the prompt in one chunk, never reads them). `rank_pools`: each
    prefill rank has its own pool, as on CUDA, and sends its own head over its own connection."""
    if rank_pools:
        monkeypatch.setenv(envs.TP_RANK_POOLS, "1")
    colocated = llm_factory("tiny", kv_cache_dtype=decode_kv)
    engine_options = {"prefill": {"tensor_parallel_size": prefill_tp, "num_threads": 1},
                      "decode": {"tensor_parallel_size": decode_tp, "num_threads": 1, "kv_cache_dtype": decode_kv}}
    cluster = start_cluster(model_dirs["tiny"], transport, 1, 1, engine_options=engine_options)
    try:
        with httpx.Client(base_url=cluster.router.url, timeout=60) as http:
            for seed, params in ((None, greedy(8)), (77, SamplingParams(temperature=0.9, top_k=40, seed=77,
                                                                          max_tokens=8, ignore_eos=True))):
                body = {"max_tokens": 8, "ignore_eos": True, "temperature": params.temperature,
                        "top_k": params.top_k, "seed": seed}
                for prompt, text in zip(PROMPTS[1:], generate_texts(colocated, PROMPTS[1:], params), strict=True):
                    reply = http.post("/v1/completions", json=body | {"prompt": prompt})
                    assert reply.status_code == 200, reply.text
                    assert reply.json()["choices"][0]["text"] == text
                    streamed = http.post("/v1/completions", json=body | {"prompt": prompt, "stream": True})
                    chunks = [e for e in parse_sse(streamed.text) if isinstance(e, dict)]
                    assert "".join(c["choices"][0]["text"] for c in chunks) == text
        cluster.wait_until_idle()
        prefill_stats = cluster.workers[1][1].engine.stats()
        assert prefill_stats.num_prefill_tokens > 0  # the prompts were computed there and handed off
        decode = cluster.services[0].stats()  # the decode worker is built first
        assert decode.completed > 0 and decode.kv_dtype_conversions == (0 if decode_kv == "auto" else decode.completed)
        for (_, client), tp in zip(cluster.workers, (decode_tp, prefill_tp), strict=True):
            runner = client.engine.runner
            assert isinstance(runner, TPModelRunner) == (tp > 1)
            assert not isinstance(runner, TPModelRunner) or (runner.rank_pools is not None) == rank_pools
        receiver = cluster.services[0].receiver  # type: ignore[union-attr]
        assert len(receiver.kv_address.split(",")) == (decode_tp if rank_pools else 1)
        if receiver.ranks is not None:  # each rank let go of every reservation
            assert receiver.ranks.reserved_request_ids() == frozenset()
    finally:
        stop_cluster(cluster)
