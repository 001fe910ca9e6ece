"""The shared-memory collectives of CPU tensor parallelism (engine/shared_memory_group.py): every
rank gets the same sum (in rank order, bitwise), over many calls of varying shapes (the two halves
of the file take turns), and a rank that stops makes the others fail, not hang. Ranks here are
threads of one process, each with its own view of the file, as processes would have."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pdserve.engine import shared_memory_group
from pdserve.engine.shared_memory_group import PeerGoneError, SharedMemoryGroup, file_bytes

pytestmark = pytest.mark.skipif(not shared_memory_group.available(), reason="x86-64 only (store ordering)")

SLOT_BYTES = 64 * 1024


def run_ranks(path: Path, size: int, body: Callable[[SharedMemoryGroup], object],
              alive: Callable[[int], bool] = lambda _rank: True, timeout_s: float = 30.0) -> list[object]:
    """`body(group)` on `size` threads, one per rank; each thread's return value or exception."""
    path.touch()
    results: list[object] = [None] * size

    def rank_main(rank: int) -> None:
        group = SharedMemoryGroup(str(path), rank, size, SLOT_BYTES, lambda: alive(rank), timeout_s)
        try:
            results[rank] = body(group)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            results[rank] = exc

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads), "a rank hung"
    return results


def inputs(rank: int, call: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * call + rank)
    return torch.randn(shape, generator=generator).to(dtype)


SHAPES = [(1, 8), (5, 96), (64, 128), (3, 7), (128, 128), (2, 1, 16)]


@pytest.mark.parametrize("size", [2, 3])
def test_every_rank_gets_the_rank_order_sum_and_the_gather_over_many_calls(tmp_path: Path, size: int) -> None:
    def body(group: SharedMemoryGroup) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for call in range(40):
            shape, dtype = SHAPES[call % len(SHAPES)], (torch.float32, torch.bfloat16)[call % 2]
            reduced = group.all_reduce(inputs(group.rank, call, shape, dtype))
            gathered = group.all_gather(inputs(group.rank, call, shape, dtype))
            out.append((reduced.clone(), gathered))
        return out

    results = run_ranks(tmp_path / "collectives", size, body)
    for call in range(40):
        shape, dtype = SHAPES[call % len(SHAPES)], (torch.float32, torch.bfloat16)[call % 2]
        parts = [inputs(rank, call, shape, dtype) for rank in range(size)]
        want = parts[0] + parts[1]
        for part in parts[2:]:
            want += part
        for rank in range(size):
            reduced, gathered = results[rank][call]  # type: ignore[index]
            assert torch.equal(reduced, want), (call, rank)  # bitwise: every rank the same bytes
            assert torch.equal(gathered, torch.cat(parts, dim=-1)), (call, rank)


def test_a_strided_tensor_is_reduced_in_place(tmp_path: Path) -> None:
    def body(group: SharedMemoryGroup) -> torch.Tensor:
        base = torch.full((4, 6), float(group.rank + 1))
        view = base[:, ::2]  # not contiguous
        assert group.all_reduce(view) is view
        return base

    for base in run_ranks(tmp_path / "collectives", 2, body):
        assert isinstance(base, torch.Tensor)
        assert torch.equal(base[:, ::2], torch.full((4, 3), 3.0))  # 1 + 2
        assert torch.equal(base[:, 1::2], torch.full((4, 3), float(base[0, 1])))  # untouched


def test_fits_is_the_slot_size_and_the_file_size_is_what_the_ranks_map(tmp_path: Path) -> None:
    (tmp_path / "c").touch()
    group = SharedMemoryGroup(str(tmp_path / "c"), 0, 2, SLOT_BYTES, lambda: True, 1.0)
    assert group.fits(torch.empty(SLOT_BYTES // 4)) and not group.fits(torch.empty(SLOT_BYTES // 4 + 1))
    assert (tmp_path / "c").stat().st_size == file_bytes(2, SLOT_BYTES)
    with pytest.raises(ValueError, match="multiple of 64"):
        SharedMemoryGroup(str(tmp_path / "c"), 0, 2, 100, lambda: True, 1.0)


def test_a_rank_that_stops_fails_the_others_collective_instead_of_hanging(tmp_path: Path) -> None:
    stopped = threading.Event()

    def body(group: SharedMemoryGroup) -> None:
        group.all_reduce(torch.ones(8))
        if group.rank == 1:
            stopped.set()  # rank 1 leaves: its process "exits"
            return
        group.all_reduce(torch.ones(8))

    start = time.monotonic()
    results = run_ranks(tmp_path / "collectives", 2, body, alive=lambda rank: not (rank == 0 and stopped.is_set()))
    assert isinstance(results[0], PeerGoneError) and "gone" in str(results[0])
    assert results[1] is None and time.monotonic() - start < 10


def test_a_peer_that_never_arrives_times_out(tmp_path: Path) -> None:
    (tmp_path / "c").touch()
    group = SharedMemoryGroup(str(tmp_path / "c"), 0, 2, SLOT_BYTES, lambda: True, 0.2)
    start = time.monotonic()
    with pytest.raises(PeerGoneError, match="did not reach the collective within"):
        group.all_reduce(torch.ones(8))
    assert time.monotonic() - start < 5
