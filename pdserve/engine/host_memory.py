"""Host allocator tuning for CPU inference.

glibc serves allocations above its mmap threshold (dynamic, at most 32 MiB by default) with fresh
`mmap`s and returns them on free, so every step's large temporaries (logits, attention
workspaces, prefill activations) fault in their pages again. On the VMs we measure on that costs
~20-30% of a decode step. Keeping large blocks on the heap and not trimming it removes the faults;
the price is that freed memory is kept for reuse instead of returned to the OS (what tcmalloc,
which vLLM recommends for CPU serving, does too).

Long-lived large buffers (the KV pool) come from `zeroed_pages`: an anonymous mapping on
transparent huge pages. The KV transports move a pool's blocks with the kernel (socket copies;
NIXL/UCX's process_vm_writev on one host), which walks and pins the pool page by page: with 2 MiB
pages instead of 4 KiB ones a 256 MiB NIXL hand-off here took 63 ms instead of 96 ms (memcpy 46 vs
52 ms); the engine's own speed did not change. The price: where the kernel's THP
`defrag` setting is `madvise` (a common default), the first write to each 2 MiB of the pool may
stall on memory compaction when free memory is fragmented; this happens once per 2 MiB, as blocks
are first used.

Where first touch is slow (a fresh VM whose hypervisor backs guest memory only when it is first
written: ~7 ms per MiB on the 2-vCPU Firecracker VM we measure on, 0.16 GB/s), a lazily committed
pool makes the first use of every block a stall inside a step: 15 % of an offline run's time went to
`index_copy_` into fresh pages there. `commit=True` (`--kv-cache-prefault`) commits the pages at
start-up instead, as a pool zero-filled with `torch.zeros` (vLLM's CPU backend) would.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap

import torch

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_SETTINGS = ((_M_MMAP_THRESHOLD, 1 << 30), (_M_TRIM_THRESHOLD, 2**31 - 1), (_M_TOP_PAD, 64 << 20))
HUGE_PAGE_BYTES = 2 << 20  # x86-64 and arm64 (4 KiB base pages) transparent huge page size
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # NOTE: Linux >= 5.14; Python 3.11 lacks the name


def keep_large_allocations_on_heap() -> bool:
    """Returns whether glibc accepted the settings (False elsewhere, e.g. musl or macOS)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    accepted = all(mallopt(param, value) == 1 for param, value in _SETTINGS)
    if not accepted:
        logger.info("glibc mallopt refused; large CPU temporaries will be re-faulted each step")
    return accepted


def zeroed_pages(num_bytes: int, commit: bool = False) -> torch.Tensor:
    """`num_bytes` of zeroed host memory (uint8) from an anonymous mapping, 2 MiB-aligned and
    advised for transparent huge pages (used where the kernel's THP mode is `always` or `madvise`;
    elsewhere they stay 4 KiB pages). Pages read as zero and are committed only when first written,
    or all now with `commit`. The tensor keeps the mapping alive."""
    mapping = mmap.mmap(-1, num_bytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # NOTE: Linux only; a refusal (THP compiled out) is harmless
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError as e:
            logger.debug("madvise(MADV_HUGEPAGE) refused: %s", e)
    start = -whole.data_ptr() % HUGE_PAGE_BYTES
    pages = whole[start:start + num_bytes]
    if commit:
        _commit(mapping, pages)
    return pages


def _commit(mapping: mmap.mmap, pages: torch.Tensor) -> None:
    """Fault every page in now: MADV_POPULATE_WRITE, else a write of zeros (already their value)."""
    try:
        mapping.madvise(_MADV_POPULATE_WRITE)
    except (OSError, ValueError) as e:
        logger.debug("madvise(MADV_POPULATE_WRITE) refused (%s); writing the pages instead", e)
        pages.fill_(0)
