"""The KV side reads where KV moves from and into off the runner (`ModelRunner.rank_pools`), never
its kind: one pool (one process, TP ranks sharing one pool) or a pool per TP rank, whose other
ranks the KV side drives through rank hooks. (The hand-offs themselves: test_tensor_parallel.py.)"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from pdserve.config import EngineArgs, EngineConfig, create_engine_config
from pdserve.disagg.kv_layout import KVLayout
from pdserve.disagg.worker.kv_side import KVSideSpec, OnePool, PoolPerRank, kv_pools
from pdserve.disagg.worker.kv_streamer import KVStreamer
from pdserve.disagg.worker.rank_streaming import MirroredKVStreamer, RankStreamingSpec, sending_heads
from pdserve.engine.kv_transfer import RankPools
from pdserve.engine.model_runner import ModelRunner


@dataclass
class Ranks:
    """A TP runner's other ranks, as far as the KV side sees them."""

    num_other_ranks: int = 1
    hooks: list[tuple[Any, Any]] = field(default_factory=list)
    commands: list[Any] = field(default_factory=list)

    def install_rank_hook(self, spec: Any, step_message: Any = None) -> None:
        self.hooks.append((spec, step_message))

    def rank_command(self, message: Any) -> list[Any]:
        self.commands.append(message)
        return [None] * self.num_other_ranks


@dataclass
class Runner:
    kv_cache: torch.Tensor
    rank_pools: RankPools | None = None


def pool(config: EngineConfig, num_kv_heads: int) -> torch.Tensor:
    m = config.model
    return torch.zeros(m.num_hidden_layers, 2, 4, config.cache.block_size, num_kv_heads, m.head_dim)


def config_of(model_dir: Path, tp_size: int) -> EngineConfig:
    return create_engine_config(EngineArgs(model=str(model_dir), tensor_parallel_size=tp_size, num_kv_blocks=4))


def test_a_runner_without_rank_pools_is_one_pool_of_every_head(model_dirs: dict[str, Path]) -> None:
    for tp_size in (1, 2):  # one process; TP ranks sharing one pool (rank 0's kv_cache holds every head)
        config = config_of(model_dirs["tiny"], tp_size)
        kv_cache = pool(config, config.model.num_key_value_heads)
        pools = kv_pools(cast(ModelRunner, Runner(kv_cache)), config, KVSideSpec("prefill", "fake", "m"))
        assert isinstance(pools, OnePool) and pools.sending_heads is None
        assert pools.layout == KVLayout.from_pool("m", kv_cache, tp_size=tp_size)
        streamer = pools.streamer(small_blocks=3)
        assert type(streamer) is KVStreamer and streamer.small_blocks == 3


def test_a_pool_per_rank_streams_and_receives_on_every_rank_and_refuses_the_fake_transport(
        model_dirs: dict[str, Path]) -> None:
    config = config_of(model_dirs["tiny"], 2)
    ranks = Ranks()
    runner = cast(ModelRunner, Runner(pool(config, config.model.num_key_value_heads // 2), ranks))
    with pytest.raises(ValueError, match="needs tcp or nixl"):
        kv_pools(runner, config, KVSideSpec("prefill", "fake", "m"))
    pools = kv_pools(runner, config, KVSideSpec("prefill", "tcp", "m", cluster_secret_file="/s"))
    assert isinstance(pools, PoolPerRank) and pools.sending_heads == sending_heads(config)
    assert pools.layout.kv_head_start == 0 and pools.layout.num_kv_heads == config.model.num_key_value_heads // 2
    streamer = pools.streamer(small_blocks=3)
    assert isinstance(streamer, MirroredKVStreamer) and streamer.ranks is ranks
    assert ranks.hooks == [(RankStreamingSpec("tcp", "m", 3, "/s"), streamer.step_message)]
    streamer.forget("r")
    assert ranks.commands == [("forget", "r")]
