"""Host memory for the KV pool: zeroed, 2 MiB-aligned, on transparent huge pages where allowed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.engine.host_memory import HUGE_PAGE_BYTES, zeroed_pages

_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _smaps_kib(address: int, field: str = "AnonHugePages") -> int:
    """`field` (AnonHugePages, Rss, ...) of the mapping of this process that contains `address`
    (/proc/self/smaps), in KiB."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == f"{field}:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_zeroed_pages_are_aligned_zero_and_writable() -> None:
    pages = zeroed_pages(3 * HUGE_PAGE_BYTES + 123)
    assert pages.dtype == torch.uint8 and pages.numel() == 3 * HUGE_PAGE_BYTES + 123
    assert pages.data_ptr() % HUGE_PAGE_BYTES == 0
    assert int(pages.count_nonzero()) == 0
    pages.view(-1)[-1] = 7
    pool = pages[:3 * HUGE_PAGE_BYTES].view(torch.bfloat16).view(3, -1)  # how the engine views it
    assert pool.is_contiguous() and pool.shape == (3, HUGE_PAGE_BYTES // 2)


@pytest.mark.skipif(not _THP_MODE.exists() or "[never]" in _THP_MODE.read_text(),
                    reason="transparent huge pages are off on this kernel")
def test_zeroed_pages_get_huge_pages_once_written() -> None:
    pages = zeroed_pages(8 * HUGE_PAGE_BYTES)
    # NOTE: a difference, not "0 before": the kernel may merge the new mapping with a neighbouring
    # one of the same flags (an earlier test's pages), whose huge pages then count in the same entry
    before = _smaps_kib(pages.data_ptr())
    pages.fill_(1)
    assert _smaps_kib(pages.data_ptr()) - before >= 4 * HUGE_PAGE_BYTES // 1024


def test_committed_pages_are_resident_at_once_lazy_ones_only_when_written() -> None:
    size = 16 * HUGE_PAGE_BYTES
    lazy = zeroed_pages(size)
    # NOTE: measured before the next mapping, which the kernel may merge with this one
    assert _smaps_kib(lazy.data_ptr(), "Rss") < size // 1024
    committed = zeroed_pages(size, commit=True)
    assert _smaps_kib(committed.data_ptr(), "Rss") >= size // 1024
    assert int(committed.count_nonzero()) == 0


def test_engine_commits_its_pool_with_kv_cache_prefault(model_dirs: dict[str, Path]) -> None:
    from pdserve import LLM, SamplingParams

    llm = LLM(str(model_dirs["tiny"]), dtype="float32", kv_cache_memory="64MiB", kv_cache_prefault=True)
    pool = llm.engine.runner.kv_cache
    assert _smaps_kib(pool.data_ptr(), "Rss") >= pool.numel() * pool.element_size() // 1024
    out = llm.generate(["hello"], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 4
