"""How the engine drives its disk tier around each step (the scheduler decides, the runner moves
tensors, the tier does the I/O on its threads):

    before schedule()   finished loads: the runner copies their KV into the loading requests'
                        blocks, then `Scheduler.complete_load` (a request aborted meanwhile is
                        skipped: its blocks may belong to someone else already)
    after update()      blocks indexed by this step: the runner copies the new ones out (one
                        gather), the tier writes them later (write-behind)
    every step          prefill tokens per second feed the load-or-recompute cost model
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.config import EngineConfig
from pdserve.engine.kv_disk_format import DiskLayout
from pdserve.engine.kv_disk_tier import KVDiskTier, KVTierStats
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.scheduler import Scheduler

_IDLE_WAIT_S = 0.01  # an engine with only loading requests waits this long for one to finish


@dataclass(frozen=True, slots=True)
class TierStats:
    """The disk tier's numbers plus the pool's prefix hits, in blocks, for the per-tier metrics."""

    disk: KVTierStats
    num_pool_hit_blocks: int


class DiskOffload:
    def __init__(self, config: EngineConfig, scheduler: Scheduler, runner: ModelRunner) -> None:
        assert config.kv_disk is not None
        if runner.kv_cache.shape[4] != config.model.num_key_value_heads:
            raise ValueError("--kv-disk-dir with --tensor-parallel-size > 1 needs the CPU device (its ranks share one "
                             "KV pool); on CUDA each rank's pool holds only its heads: not supported yet")
        self.tier = KVDiskTier(config.kv_disk, DiskLayout.of_engine(config), config.kv_dtype)
        self.scheduler = scheduler
        self.runner = runner
        scheduler.attach_disk_tier(self.tier)

    def apply_finished_loads(self) -> None:
        for load in self.tier.take_finished_loads():
            request = self.scheduler.loading.get(load.request_id)
            if request is None:
                continue
            if load.blocks:
                first = request.num_computed_tokens // self.scheduler.kv.block_size
                self.runner.write_blocks(request.block_ids[first:first + len(load.blocks)], load.blocks)
            self.scheduler.complete_load(load.request_id, len(load.blocks))

    def save_new_blocks(self) -> None:
        new = self.scheduler.kv.take_newly_cached()
        if not new:
            return
        picked = self.tier.admit_writes([digest for _, digest in new])
        if picked:
            kv = self.runner.read_blocks([new[i][0] for i in picked])
            self.tier.enqueue_writes([new[i][1] for i in picked], kv)

    def observe_step(self, num_prefill_tokens: int, duration_s: float) -> None:
        self.tier.cost.observe_compute(num_prefill_tokens, duration_s)

    def wait_for_loads(self) -> None:
        if self.scheduler.loading:
            self.tier.wait_for_loads(_IDLE_WAIT_S)

    def stats(self) -> TierStats:
        kv = self.scheduler.kv
        pool_hit_tokens = kv.num_prefix_hits - self.scheduler.num_disk_hit_tokens
        return TierStats(self.tier.stats(), pool_hit_tokens // kv.block_size)
