"""KV-cache events under LoRA adapters, and the router's choices from events: an engine's
BlockStored names the adapter its blocks were computed under (lora_name, and a stable lora_id), the
router hashes a prompt under an adapter from that adapter's root (name + digest, as the workers
chain it), so the kv-events decode policy and --prefill-policy kv-events send it to the worker
holding its prefix under that adapter, not to one holding the same tokens under the base model."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from helpers import make_request, mark_ready, random_prompt, until
from lora_helpers import DENSE_ADAPTERS, write_adapter
from test_kv_events import Recording
from test_kv_index import decode_worker, publisher, run
from test_prefill_affinity import COLD, DECODE, WARM, StubWorkers, _job, _pool

from pdserve import LLM, LoRARequest
from pdserve.disagg.config import RouterConfig
from pdserve.disagg.router.core import PDRouter, ServedModel
from pdserve.disagg.router.kv_index import KVBlockIndex, KVEventsView, lora_root, prompt_block_hashes
from pdserve.disagg.router.memory_queue import MemoryPrefillQueue
from pdserve.disagg.router.policy import KVEventsPolicy
from pdserve.disagg.router.pool import Worker
from pdserve.disagg.router.stats import IndexResets
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.kv_events import BlockStored, KVEventBatch, KVEventLog, lora_int_id
from pdserve.engine.llm import TokensPrompt
from pdserve.engine.lora_manager import LoRAInfo, hash_root
from pdserve.engine.sampling_params import SamplingParams
from pdserve.model.demo_checkpoint import PRESETS, write_checkpoint
from pdserve.model.qwen3_config import Qwen3ModelConfig
from pdserve.tokenizer import load_tokenizer

SQL = LoRAInfo("sql", "/adapters/sql", "d1g3st", 8)


def _stored_events(lora: LoRAInfo | None, prompt: list[int]) -> BlockStored:
    """The BlockStored an engine's KV cache manager records for `prompt` computed under `lora`."""
    kv = KVCacheManager(num_blocks=32, block_size=4, enable_caching=True)
    log = kv.pool.events = KVEventLog(4)
    request = make_request("r", prompt, max_tokens=1, lora_name=None if lora is None else lora.name)
    request.hash_root = hash_root(lora)  # NOTE: what engine_lora.py sets for a request under an adapter
    assert kv.allocate(request, len(prompt))
    request.num_computed_tokens = len(prompt)
    kv.cache_computed_blocks(request)
    (event,) = log.take()
    kv.free(request)
    assert isinstance(event, BlockStored)
    return event


def test_an_adapters_blocks_carry_its_name_and_id_and_hash_from_its_root() -> None:
    prompt = list(range(17))
    base, sql = _stored_events(None, prompt), _stored_events(SQL, prompt)
    assert base.lora_name is None and base.lora_id is None
    assert sql.lora_name == "sql" and sql.lora_id == lora_int_id(hash_root(SQL))
    assert sql.lora_id is not None and 0 < sql.lora_id < 2**31
    # stable: the same adapter (name + digest) gets the same id; other weights another
    assert lora_int_id(hash_root(LoRAInfo("sql", "/elsewhere", "d1g3st", 16))) == sql.lora_id
    assert lora_int_id(hash_root(LoRAInfo("sql", "/adapters/sql", "0ther", 8))) != sql.lora_id
    # the router hashes the prompt as the engine chained it: from the adapter's root, not the base's
    assert prompt_block_hashes(prompt, 4, lora_root("sql", SQL)) == list(sql.block_hashes)
    assert prompt_block_hashes(prompt, 4) == list(base.block_hashes)
    assert set(sql.block_hashes).isdisjoint(base.block_hashes)
    # an adapter whose digest the router does not know yet matches nobody's blocks (nor the base's)
    unknown = prompt_block_hashes(prompt, 4, lora_root("sql", None))
    assert set(unknown).isdisjoint(sql.block_hashes) and set(unknown).isdisjoint(base.block_hashes)
    assert lora_root(None, SQL) == b""


def test_decode_policy_sends_an_adapters_prompt_to_the_worker_holding_it_under_that_adapter() -> None:
    async def scenario() -> None:
        pubs = [publisher(), publisher()]
        policy = KVEventsPolicy()
        try:
            base_holder = decode_worker("http://127.0.0.1:1", pubs[0], free_blocks=60)
            sql_holder = decode_worker("http://127.0.0.1:2", pubs[1], free_blocks=10)
            policy.observe([base_holder, sql_holder])
            prompt = random_prompt(33, seed=7)
            await asyncio.sleep(0.3)  # NOTE: the subscriptions reach the PUB sockets
            # the same tokens: computed under the base model on one, under "sql" on the other
            pubs[0].publish([_stored_events(None, prompt)])
            pubs[1].publish([_stored_events(SQL, prompt)])
            await until(lambda: all(policy.index(w.url) is not None and policy.index(w.url).hashes  # type: ignore[union-attr]
                                    for w in (base_holder, sql_holder)), "both workers' blocks")
            workers = [base_holder, sql_holder]
            assert await policy.order(workers, prompt, root=lora_root("sql", SQL)) == [sql_holder, base_holder]
            assert await policy.order(workers, prompt) == [base_holder, sql_holder]
            # another adapter (or one not known yet): nobody holds it; by load, as for a new prefix
            other = LoRAInfo("chat", "/adapters/chat", "c4at", 8)
            assert await policy.order(workers, prompt, root=lora_root("chat", other)) == [base_holder, sql_holder]
            sql_holder.in_flight = 5
            assert await policy.order(workers, prompt, root=lora_root("sql", SQL)) == [sql_holder, base_holder]
        finally:
            await policy.close()
            for pub in pubs:
                pub.close()

    run(scenario)


def test_prefill_policy_kv_events_places_a_first_attempt_where_events_say_its_prompt_is(
        model_dirs: dict[str, Path]) -> None:
    async def scenario() -> None:
        pubs = [publisher(), publisher()]
        workers = StubWorkers()
        pool = _pool(workers, [COLD, WARM])
        for worker, pub in zip(pool.members("prefill"), pubs, strict=True):
            assert pub.endpoints is not None and worker.info is not None
            worker.info = worker.info.model_copy(update={
                "kv_layout": {"block_size": 4}, "instance_id": "i1", "kv_events_endpoint": pub.endpoints.publish,
                "kv_events_replay_endpoint": pub.endpoints.replay, "kv_events_topic": pub.endpoints.topic})
        model_dir = model_dirs["tiny"]
        router = PDRouter(RouterConfig(prefill=(COLD, WARM), decode=(DECODE,), prefill_policy="kv-events"),
                          ServedModel(load_tokenizer(str(model_dir)), Qwen3ModelConfig.from_dir(model_dir),
                                      str(model_dir), 1024),
                          pool=pool, queue=MemoryPrefillQueue(pool, workers), client=workers)
        router.lora_infos = {"sql": SQL}.get
        view = router.prefill_view
        assert view is not None
        try:
            view.observe(pool.members("prefill"))
            await asyncio.sleep(0.3)
            prompt = _job("x").prompt_token_ids
            # WARM (second, more loaded-looking by order) holds the prompt under "sql"; COLD under the base
            pubs[0].publish([_stored_events(None, prompt)])
            pubs[1].publish([_stored_events(SQL, prompt)])
            await until(lambda: all(view.num_cached(w) for w in pool.members("prefill")), "both workers' blocks")
            await router.run("under-sql", prompt, SamplingParams(max_tokens=2, lora_name="sql")).dispatch(
                _job("under-sql"))
            await until(lambda: len(workers.prefilled) == 1, "the first job")
            await router.run("base", prompt, SamplingParams(max_tokens=2)).dispatch(_job("base"))
            await until(lambda: len(workers.prefilled) == 2, "the second job")
            assert workers.prefilled == [WARM, COLD]
            assert workers.asked == []  # NOTE: from events: no worker asked per job
            assert router.stats().index_resets == {"prefill": IndexResets()}  # the decode policy follows none
        finally:
            await router.close()
            for pub in pubs:
                pub.close()

    run(scenario)


def test_a_worker_without_events_counts_nothing_cached() -> None:
    """mark_ready's workers carry no event endpoint: the view follows nobody and counts 0 cached."""
    async def scenario() -> None:
        view = KVEventsView()
        worker = Worker("http://x", "prefill")
        mark_ready(worker)
        view.observe([worker])
        assert view.index(worker.url) is None
        assert view.num_cached_tokens([worker], list(range(40))) == {worker.url: 0}
        await view.close()

    run(scenario)


@pytest.mark.slow
def test_an_engines_real_events_under_an_adapter_route_its_prompt(tmp_path: Path) -> None:
    """The offline engine under a real adapter: its BlockStored names the adapter, and the router,
    hashing from the adapter's record as the engine lists it (GET /v1/lora_adapters' digest), finds
    the prompt's blocks in an index fed those events; hashed as the base model's, it finds none."""
    model_dir = write_checkpoint(tmp_path / "model", PRESETS["tiny"], seed=21)
    targets, rank, _ = DENSE_ADAPTERS["sql"]
    adapter = write_adapter(model_dir, tmp_path / "sql", targets, rank, seed=0)
    llm = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=32, block_size=16, enable_lora=True,
              max_lora_rank=16, lora_modules=(f"sql={adapter}",),
              kv_events_config='{"enable_kv_cache_events": true, "publisher": "null"}')
    try:
        recording = Recording()
        llm.engine.kv_event_publisher = recording
        prompt = random_prompt(70, seed=11)  # 4 full blocks
        llm.generate([TokensPrompt(prompt_token_ids=prompt)], SamplingParams(max_tokens=2, temperature=0.0),
                     lora_request=LoRARequest("sql"))
        llm.engine.publish_kv_events()
        events = [e for e in recording.events() if isinstance(e, BlockStored)]
        (info,) = llm.engine.loras.list()
        assert events and all(e.lora_name == "sql" and e.lora_id == lora_int_id(hash_root(info)) for e in events)
        index = KVBlockIndex()
        index.apply(KVEventBatch(0.0, tuple(events)))
        assert index.num_prefix_blocks(prompt_block_hashes(prompt, 16, lora_root("sql", info))) == 4
        assert index.num_prefix_blocks(prompt_block_hashes(prompt, 16)) == 0
    finally:
        llm.engine.close()
