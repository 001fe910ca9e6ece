"""The KV disk tier (--kv-disk-dir): prefix hits served from disk give the same greedy tokens as an
engine without it; a restarted engine hits at once; damaged or foreign files are misses, removed;
an unusable disk turns the tier off and serving goes on; concurrent writers never expose a torn
file; the size bound holds; the cost model can say no."""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_no_leak, generate_token_ids, greedy, random_prompt

from pdserve import LLM
from pdserve.config import KVDiskConfig
from pdserve.engine import kv_disk_tier
from pdserve.engine.kv_cache_manager import hash_block
from pdserve.engine.kv_disk_format import BadBlockFile, DiskLayout, block_file_name, read_block_file, write_block_file
from pdserve.engine.kv_disk_tier import KVDiskTier
from pdserve.engine.kv_load_cost import LoadCostModel
from pdserve.serving.kv_tier_metrics import kv_tier_series

BLOCK_SIZE = 4
PROMPT_LEN = 61  # 15 full blocks, the last token always computed
# 4 prompts of 16 blocks each do not fit a 40-block pool: the first ones' prefixes are evicted
PROMPTS = [random_prompt(PROMPT_LEN, seed) for seed in range(4)]
MAX_TOKENS = 4


def tier_llm(model_dir: Path, disk_dir: Path, **args: Any) -> LLM:
    llm = LLM(model=str(model_dir), dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=40,
              kv_disk_dir=str(disk_dir), kv_disk_size="64MiB", **args)
    # NOTE: the tiny model computes a block faster than Python reads a file; pin the cost model so
    # that every hit here comes from disk (test_cost_model_* covers the decision itself).
    tier(llm).cost.compute_s_per_token = float("inf")
    return llm


def tier(llm: LLM) -> KVDiskTier:
    assert llm.engine.offload is not None
    return llm.engine.offload.tier


def run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    tokens = generate_token_ids(llm, prompts, greedy(MAX_TOKENS))
    tier(llm).flush()
    return tokens


@pytest.fixture(scope="module")
def expected(llm_factory: Callable[..., LLM]) -> list[list[int]]:
    return generate_token_ids(llm_factory("tiny", block_size=BLOCK_SIZE), PROMPTS, greedy(MAX_TOKENS))


def first_block_file(llm: LLM, prompt: list[int]) -> Path:
    return tier(llm).directory / block_file_name(hash_block(b"", prompt[:BLOCK_SIZE]))


def test_disk_hits_are_token_identical_and_a_restart_hits_at_once(model_dirs: dict[str, Path], tmp_path: Path,
                                                                   expected: list[list[int]]) -> None:
    llm = tier_llm(model_dirs["tiny"], tmp_path)
    assert run(llm, PROMPTS) == expected
    written = tier(llm).stats()
    assert written.num_files >= 4 * 15 and written.num_hit_blocks == 0
    assert run(llm, PROMPTS) == expected  # the pool evicted most of these prefixes: disk serves them
    stats = llm.engine.stats().kv_tier
    assert stats is not None and stats.disk.num_hit_blocks > 0 and stats.disk.bytes_read > 0
    assert_no_leak(llm)

    restarted = tier_llm(model_dirs["tiny"], tmp_path)
    assert tier(restarted).stats().num_files == written.num_files  # the index, rebuilt from the directory
    prefill_before = restarted.engine.stats().num_prefill_tokens
    assert run(restarted, PROMPTS) == expected
    after = restarted.engine.stats()
    assert after.kv_tier is not None and after.kv_tier.disk.num_hit_blocks == 4 * 15
    assert after.num_prefill_tokens - prefill_before == 4 * (PROMPT_LEN - 15 * BLOCK_SIZE)  # only the last tokens
    assert_no_leak(restarted)


def test_damaged_and_foreign_files_are_misses_and_removed(model_dirs: dict[str, Path], tmp_path: Path,
                                                          expected: list[list[int]],
                                                          caplog: pytest.LogCaptureFixture) -> None:
    llm = tier_llm(model_dirs["tiny"], tmp_path)
    assert run(llm, PROMPTS) == expected
    corrupt, truncated, foreign = (first_block_file(llm, p) for p in PROMPTS[:3])
    data = bytearray(corrupt.read_bytes())
    data[-1] ^= 0xFF
    corrupt.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:-7])
    other = DiskLayout("another-model", "float32", BLOCK_SIZE, 2, 2, 32)
    digest = hash_block(b"", PROMPTS[2][:BLOCK_SIZE])
    write_block_file(foreign, other, digest, memoryview(bytes(foreign.stat().st_size)))
    llm.engine.scheduler.kv.pool.reset_prefix_cache()  # the pool forgets: every prefix is asked of the disk

    with caplog.at_level(logging.WARNING, logger="pdserve.engine.kv_disk_tier"):
        assert run(llm, PROMPTS) == expected
    stats = tier(llm).stats()
    assert stats.num_bad_files == 3
    reasons = [r.getMessage() for r in caplog.records]
    assert any("checksum mismatch" in m for m in reasons) and any("truncated" in m for m in reasons)
    assert any("another model or KV layout" in m for m in reasons)
    assert stats.num_hit_blocks == 15  # the fourth prompt only: each damaged first block ends its load
    assert_no_leak(llm)
    assert all(first_block_file(llm, p).exists() for p in PROMPTS[:3])  # recomputed, then written again


def test_unwritable_directory_turns_the_tier_off(model_dirs: dict[str, Path], tmp_path: Path,
                                                  expected: list[list[int]]) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    llm = tier_llm(model_dirs["tiny"], not_a_dir / "kv")
    assert not tier(llm).enabled
    assert run(llm, PROMPTS) == expected
    assert tier(llm).stats().num_files == 0
    assert_no_leak(llm)


def test_full_disk_turns_the_tier_off_and_serving_goes_on(model_dirs: dict[str, Path], tmp_path: Path,
                                                           expected: list[list[int]],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    def disk_full(*_: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(kv_disk_tier, "write_block_file", disk_full)
    llm = tier_llm(model_dirs["tiny"], tmp_path)
    assert run(llm, PROMPTS) == expected
    assert not tier(llm).enabled
    assert run(llm, PROMPTS) == expected
    assert tier(llm).stats().bytes_written == 0
    assert_no_leak(llm)


def test_abort_while_loading_leaks_nothing(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    llm = tier_llm(model_dirs["tiny"], tmp_path)
    run(llm, PROMPTS[:1])
    llm.engine.scheduler.kv.pool.reset_prefix_cache()
    llm.engine.add_request("r", PROMPTS[0], greedy(MAX_TOKENS))
    llm.engine.step()
    assert "r" in llm.engine.scheduler.loading
    llm.engine.abort_request("r")
    tier(llm).wait_for_loads(5.0)
    llm.engine.step()  # the finished load of an aborted request is dropped, not copied anywhere
    assert_no_leak(llm)


def test_cost_model_recomputes_when_computing_is_cheaper(model_dirs: dict[str, Path], tmp_path: Path,
                                                         expected: list[list[int]]) -> None:
    cost = LoadCostModel(load_s_per_block=0.01)
    assert cost.prefers_load(BLOCK_SIZE)  # nothing measured yet
    cost.observe_compute(num_tokens=1000, duration_s=0.1)  # 0.4 ms a block: cheaper than 10 ms
    assert not cost.prefers_load(BLOCK_SIZE)
    cost.observe_load(num_blocks=100, duration_s=0.001)
    assert cost.prefers_load(BLOCK_SIZE) is (cost.load_s_per_block < BLOCK_SIZE * 1e-4)

    llm = tier_llm(model_dirs["tiny"], tmp_path)
    run(llm, PROMPTS)
    tier(llm).cost.load_s_per_block = float("inf")  # reading is endlessly slow: never load
    llm.engine.scheduler.kv.pool.reset_prefix_cache()
    assert run(llm, PROMPTS) == expected
    assert tier(llm).stats().num_hit_blocks == 0
    assert_no_leak(llm)


LAYOUT = DiskLayout("m", "float32", 4, 2, 2, 8)


def make_tier(directory: Path, capacity_bytes: int = 1 << 30) -> KVDiskTier:
    return KVDiskTier(KVDiskConfig(str(directory), capacity_bytes), LAYOUT, torch.float32)


def test_two_writers_on_one_directory_never_expose_a_torn_file(tmp_path: Path) -> None:
    a, b = make_tier(tmp_path), make_tier(tmp_path)
    digests = [bytes([i]) * 16 for i in range(8)]
    blocks = torch.randn(len(digests), *LAYOUT.block_shape())
    stop, errors = threading.Event(), []

    def write_forever(writer: KVDiskTier) -> None:
        while not stop.is_set():
            for digest, block in zip(digests, blocks, strict=True):
                writer._write_one(digest, block)

    def read_forever() -> None:
        while not stop.is_set():
            for digest, block in zip(digests, blocks, strict=True):
                try:
                    if not torch.equal(read_block_file(a._path(digest), LAYOUT, digest, torch.float32), block):
                        errors.append("wrong content")
                except FileNotFoundError:
                    pass
                except BadBlockFile as exc:
                    errors.append(str(exc))

    threads = [threading.Thread(target=write_forever, args=(w,)) for w in (a, b)]
    threads += [threading.Thread(target=read_forever) for _ in range(2)]
    for thread in threads:
        thread.start()
    stop.wait(1.0)
    stop.set()
    for thread in threads:
        thread.join()
    assert not errors, errors[:3]
    assert b.num_on_disk(digests) == len(digests)
    assert not list(tmp_path.glob(f"{LAYOUT.key}/.tmp-*"))


def test_size_bound_evicts_least_recently_used(tmp_path: Path) -> None:
    probe = make_tier(tmp_path / "probe")
    block = torch.randn(1, *LAYOUT.block_shape())
    probe._write_one(b"\0" * 16, block[0])
    file_bytes = probe.stats().used_bytes
    small = make_tier(tmp_path / "small", capacity_bytes=3 * file_bytes)
    digests = [bytes([i]) * 16 for i in range(5)]
    for digest in digests:
        assert small.admit_writes([digest]) == [0]
        small.enqueue_writes([digest], block)
    small.flush()
    stats = small.stats()
    assert stats.used_bytes <= 3 * file_bytes and stats.num_files == 3
    assert small.num_on_disk(digests[2:]) == 3 and small.num_on_disk(digests[:1]) == 0
    restarted = make_tier(tmp_path / "small", capacity_bytes=3 * file_bytes)
    assert restarted.num_on_disk(digests[2:]) == 3


def test_tier_metrics(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    llm = tier_llm(model_dirs["tiny"], tmp_path)
    run(llm, PROMPTS[:1])
    llm.engine.scheduler.kv.pool.reset_prefix_cache()
    run(llm, PROMPTS[:1])
    stats = llm.engine.stats().kv_tier
    assert stats is not None
    samples = {(s.name, s.labels.get("tier"), s.labels.get("le")): s.value
               for family in kv_tier_series(stats, {"model_name": "m", "role": "colocated"})
               for s in family.samples}
    assert samples[("pdserve:kv_tier_hits_total", "disk", None)] == 15
    assert samples[("pdserve:kv_tier_usage_bytes", "disk", None)] == tier(llm).stats().used_bytes > 0
    assert samples[("pdserve:kv_tier_load_duration_seconds_count", "disk", None)] == 1
    assert samples[("pdserve:kv_tier_load_duration_seconds_bucket", "disk", "+Inf")] == 1
    assert samples[("pdserve:kv_tier_written_bytes_total", "disk", None)] > 0


def test_the_cached_prefix_a_router_asks_about_counts_the_disk_tier(model_dirs: dict[str, Path],
                                                                      tmp_path: Path) -> None:
    """POST /pd/prefix (prefix-affinity placement of prefill jobs) sees blocks only on disk; asking is
    read-only: no tier miss counted."""
    llm = tier_llm(model_dirs["tiny"], tmp_path)
    run(llm, PROMPTS[:1])
    llm.engine.scheduler.kv.pool.reset_prefix_cache()
    misses = tier(llm).stats().num_miss_blocks
    assert llm.engine.num_cached_prefix_tokens(PROMPTS[0][:60] + PROMPTS[1][:8]) == 15 * BLOCK_SIZE
    assert llm.engine.num_cached_prefix_tokens(PROMPTS[1]) == 0
    assert tier(llm).stats().num_miss_blocks == misses
    assert_no_leak(llm)


def test_close_writes_what_is_queued(tmp_path: Path) -> None:
    writer = make_tier(tmp_path)
    digests = [bytes([i]) * 16 for i in range(4)]
    assert writer.admit_writes(digests) == [0, 1, 2, 3]
    writer.enqueue_writes(digests, torch.randn(len(digests), *LAYOUT.block_shape()))
    writer.close()
    assert make_tier(tmp_path).num_on_disk(digests) == 4


def test_the_batch_does_not_wait_for_a_load(model_dirs: dict[str, Path], tmp_path: Path,
                                            expected: list[list[int]]) -> None:
    llm = tier_llm(model_dirs["tiny"], tmp_path)
    run(llm, PROMPTS[:1])
    llm.engine.scheduler.kv.pool.reset_prefix_cache()
    engine = llm.engine
    engine.add_request("on-disk", PROMPTS[0], greedy(MAX_TOKENS))
    engine.add_request("new", PROMPTS[1], greedy(MAX_TOKENS))
    outputs = {output.request_id: output for output in engine.step()}
    assert "on-disk" in engine.scheduler.loading
    assert engine.scheduler.requests["new"].num_computed_tokens > 0  # computed in the same step
    while engine.has_unfinished_requests():
        outputs |= {output.request_id: output for output in engine.step()}
    assert [outputs[rid].outputs[0].token_ids for rid in ("on-disk", "new")] == expected[:2]
    assert tier(llm).stats().num_hit_blocks == 15
    tier(llm).flush()
    assert_no_leak(llm)


def test_flags_are_validated(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="kv_disk_dir needs prefix caching"):
        LLM(model=str(model_dirs["tiny"]), kv_disk_dir=str(tmp_path), enable_prefix_caching=False)
    with pytest.raises(ValueError, match="cannot parse size"):
        LLM(model=str(model_dirs["tiny"]), kv_disk_dir=str(tmp_path), kv_disk_size="lots")
