"""The KV disk tier: TTFT of a long prompt whose prefix is on disk vs recomputed, and the tier's
write throughput against `dd` on the same disk.

    python -m pdserve.bench.kv_disk [--preset qwen3-0.6b] [--prompt-len 2000] [--dir DIR]

One engine (random weights of --preset, float32), tier in --dir (default: a temporary directory in
the current one, so on the disk under test). Per repetition, a fresh random prompt:
- recompute: its first request computes the whole prompt (TTFT = time to the first token);
- disk (page cache): the pool forgets its prefix (`reset_prefix_cache`); the same prompt again
  loads every full block from the tier's files, which the kernel still caches;
- disk (cold): the same after the files were dropped from the page cache (fsync +
  POSIX_FADV_DONTNEED on each, nothing else on the machine is touched).
Ratios are against recompute in the same run; medians of --reps after one warm-up request.
Write throughput: 128 blocks read out of the pool and written through the tier (write-behind
thread), into the page cache and then fsynced file by file, against `dd bs=4M` of as many bytes
into the same directory, without and with `conv=fsync`.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from pdserve.bench.common import hardware_line, print_table
from pdserve.engine.kv_disk_tier import KVDiskTier
from pdserve.engine.llm import LLM, TokensPrompt
from pdserve.engine.sampling_params import SamplingParams
from pdserve.model.demo_checkpoint import default_model_dir

_FIRST_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
# NOTE: the warm-up decodes too: a disk hit's only computed step is one token wide, a shape the
# CPU kernels otherwise first meet (and set up for) inside the timed run.
_WARM_UP = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


def _ttft_s(llm: LLM, prompt: list[int]) -> float:
    start = time.perf_counter()
    llm.generate(TokensPrompt(prompt_token_ids=prompt), _FIRST_TOKEN)
    return time.perf_counter() - start


def _drop_from_page_cache(directory: Path) -> None:
    for path in directory.iterdir():
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _one_rep(llm: LLM, tier: KVDiskTier, prompt: list[int]) -> tuple[float, float, float]:
    recompute = _ttft_s(llm, prompt)
    tier.flush()
    pool = llm.engine.scheduler.kv.pool
    pool.reset_prefix_cache()
    hits_before = tier.stats().num_hit_blocks
    warm = _ttft_s(llm, prompt)
    pool.reset_prefix_cache()
    _drop_from_page_cache(tier.directory)
    cold = _ttft_s(llm, prompt)
    pool.reset_prefix_cache()
    num_blocks = (len(prompt) - 1) // llm.engine.config.cache.block_size
    assert tier.stats().num_hit_blocks - hits_before == 2 * num_blocks, "the disk runs did not load every block"
    return recompute, warm, cold


def _write_throughput(llm: LLM, tier: KVDiskTier, num_blocks: int) -> tuple[float, float]:
    """Bytes per second through the tier (enqueue, write-behind into the page cache), and with
    every written file fsynced too."""
    block_ids = list(range(num_blocks))
    kv = llm.engine.runner.read_blocks(block_ids)
    digests = [random.randbytes(16) for _ in block_ids]
    start = time.perf_counter()
    picked = tier.admit_writes(digests)
    assert len(picked) == num_blocks, "the write-behind buffer is smaller than the benchmark's batch"
    tier.enqueue_writes(digests, kv)
    tier.flush()
    buffered = time.perf_counter()
    for digest in digests:
        with open(tier._path(digest), "rb+") as f:
            os.fsync(f.fileno())
    synced = time.perf_counter()
    num_bytes = num_blocks * tier.block_bytes
    return num_bytes / (buffered - start), num_bytes / (synced - start)


def _dd_throughput(directory: Path, num_bytes: int, *flags: str) -> float:
    target = directory / "dd.bench"
    count = max(1, num_bytes // (4 << 20))
    start = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=4M", f"count={count}", *flags], check=True,
                   capture_output=True)
    elapsed = time.perf_counter() - start
    target.unlink()
    return count * (4 << 20) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--prompt-len", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default=None, help="tier directory (default: a temporary one under .)")
    ns = parser.parse_args()
    random.seed(0)
    with tempfile.TemporaryDirectory(dir=ns.dir or ".", prefix="kv-disk-bench-") as directory:
        llm = LLM(model=str(default_model_dir(ns.preset)), dtype="float32", kv_cache_memory="2GiB",
                  kv_disk_dir=directory, kv_disk_size="16GiB")
        assert llm.engine.offload is not None
        tier = llm.engine.offload.tier
        llm.generate(TokensPrompt(prompt_token_ids=[random.randrange(1000, 100_000) for _ in range(64)]), _WARM_UP)
        reps = [_one_rep(llm, tier, [random.randrange(1000, 100_000) for _ in range(ns.prompt_len)])
                for _ in range(ns.reps)]
        recompute, warm, cold = (statistics.median(column) for column in zip(*reps, strict=True))
        num_bytes = tier.stats().bytes_written
        num_blocks = min(llm.engine.config.cache.num_kv_blocks, 128)
        tier_bps, tier_synced_bps = _write_throughput(llm, tier, num_blocks)
        dd_bps = _dd_throughput(tier.directory, num_blocks * tier.block_bytes)
        dd_synced_bps = _dd_throughput(tier.directory, num_blocks * tier.block_bytes, "conv=fsync")
    print(f"# {hardware_line()}")
    print(f"# preset {ns.preset} (random weights, float32), prompt {ns.prompt_len} tokens, block "
          f"{llm.engine.config.cache.block_size} tokens = {tier.block_bytes / 2**20:.2f} MiB, "
          f"{num_bytes / 2**20 / ns.reps:.0f} MiB of KV per prompt, median of {ns.reps}")
    print_table(["TTFT", "seconds", "vs recompute"], [
        ["recomputed", f"{recompute:.3f}", "1.00x"],
        ["prefix on disk (page cache)", f"{warm:.3f}", f"{warm / recompute:.3f}x"],
        ["prefix on disk (cold)", f"{cold:.3f}", f"{cold / recompute:.3f}x"],
    ])
    print()
    print_table(["write path", "page cache MB/s", "synced MB/s", "vs dd (page cache, synced)"], [
        ["dd bs=4M (conv=fsync)", f"{dd_bps / 1e6:.0f}", f"{dd_synced_bps / 1e6:.0f}", "1.00x, 1.00x"],
        ["disk tier (write-behind thread, fsync per file)", f"{tier_bps / 1e6:.0f}", f"{tier_synced_bps / 1e6:.0f}",
         f"{tier_bps / dd_bps:.2f}x, {tier_synced_bps / dd_synced_bps:.2f}x"],
    ])


if __name__ == "__main__":
    main()
