"""Host memory for the KV pool: zeroed, 2 MiB-aligned, on transparent huge pages where allowed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.engine.host_memory import HUGE_PAGE_BYTES, zeroed_pages

_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping of this process that contains `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
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
    before = _anon_huge_kib(pages.data_ptr())
    pages.fill_(1)
    assert _anon_huge_kib(pages.data_ptr()) - before >= 4 * HUGE_PAGE_BYTES // 1024
