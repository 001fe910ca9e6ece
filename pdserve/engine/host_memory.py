"""Host allocator tuning for CPU inference.

glibc serves allocations above its mmap threshold (dynamic, at most 32 MiB by default) with fresh
`mmap`s and returns them on free, so every step's large temporaries (logits, attention
workspaces, prefill activations) fault in their pages again. On the VMs we measure on that costs
~20-30% of a decode step. Keeping large blocks on the heap and not trimming it removes the faults;
the price is that freed memory is kept for reuse instead of returned to the OS (what tcmalloc,
which vLLM recommends for CPU serving, does too).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_SETTINGS = ((_M_MMAP_THRESHOLD, 1 << 30), (_M_TRIM_THRESHOLD, 2**31 - 1), (_M_TOP_PAD, 64 << 20))


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
