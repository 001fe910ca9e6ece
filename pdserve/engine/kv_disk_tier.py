"""The disk tier under the pool's prefix cache: full KV blocks kept as files, keyed by chained
prefix hash under a directory per KV layout (format: kv_disk_format.py).

Who calls what (everything but the two threads below runs on the engine thread):

    scheduler   num_on_disk(hashes)          how many leading blocks are on disk (index, else a stat:
                                             another worker on the directory may have written them)
                submit_load(id, hashes)      the loader thread reads and checks them into host memory
    engine      take_finished_loads()        whole-or-prefix results; the runner copies them into the
                                             request's blocks, then `Scheduler.complete_load`
                enqueue_writes(hashes, kv)   write-behind: `kv` is a host copy, owned by the tier from
                                             here on; the writer thread writes it later

The index (hash -> file size, least recently used first) is rebuilt from the directory at start, so
a restarted worker hits at once; files are validated lazily, when loaded. Size is bounded by evicting
the least recently used files this worker knows of. Any file that fails validation is a miss,
logged once and removed. When the directory cannot be written (full disk, read-only, gone) the tier
turns itself off with one warning; serving goes on without it.
"""

from __future__ import annotations

import bisect
import logging
import math
import os
import queue
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.config import KVDiskConfig
from pdserve.engine.kv_disk_format import (
    FILE_SUFFIX,
    TMP_PREFIX,
    BadBlockFile,
    DiskLayout,
    block_file_name,
    read_block_file,
    write_block_file,
)
from pdserve.engine.kv_load_cost import LoadCostModel

logger = logging.getLogger(__name__)

LOAD_LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# NOTE: host memory held by queued writes; beyond it new blocks are not written (counted as dropped)
# rather than growing without bound when the disk is slower than the engine computes blocks.
MAX_PENDING_WRITE_BYTES = 512 << 20
_STALE_TMP_S = 3600.0  # a temporary file this old was left by a writer that died mid-write
_PROBE_BLOCKS = 8


@dataclass(frozen=True, slots=True)
class FinishedLoad:
    """A load's result: the KV of the first `len(blocks)` requested blocks (fewer than asked when a
    file was missing or bad: the rest is computed)."""

    request_id: str
    blocks: list[torch.Tensor]  # each shaped DiskLayout.block_shape(), host memory


@dataclass(frozen=True, slots=True)
class KVTierStats:
    """Plain numbers for serving/metrics. Hits and misses count blocks."""

    enabled: bool
    capacity_bytes: int
    used_bytes: int
    num_files: int
    num_hit_blocks: int  # blocks loaded from disk
    num_miss_blocks: int  # lookups beyond the pool that found no usable block on disk
    num_bad_files: int  # torn, truncated, corrupt or foreign files removed
    num_dropped_writes: int  # blocks not written: the write-behind buffer was full
    bytes_read: int
    bytes_written: int
    load_latency_counts: tuple[int, ...]  # per LOAD_LATENCY_BUCKETS_S bucket, plus one for +Inf
    load_latency_sum_s: float


class KVDiskTier:
    def __init__(self, config: KVDiskConfig, layout: DiskLayout, dtype: torch.dtype) -> None:
        self.capacity_bytes = config.capacity_bytes
        self.layout = layout
        self.dtype = dtype
        self.directory = Path(config.directory) / layout.key
        self.block_bytes = math.prod(layout.block_shape()) * torch.empty((), dtype=dtype).element_size()
        self.enabled = True
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # hash -> file bytes, LRU first
        self._used_bytes = 0
        self._pending: set[bytes] = set()
        self._pending_bytes = 0
        self._writes: queue.Queue[tuple[list[bytes], torch.Tensor] | None] = queue.Queue()
        self._loads: queue.Queue[tuple[str, list[bytes]] | None] = queue.Queue()
        self._finished: deque[FinishedLoad] = deque()
        self._load_done = threading.Event()
        self._counts = {"hit": 0, "miss": 0, "bad": 0, "dropped": 0, "read": 0, "written": 0}
        self._latency_counts = [0] * (len(LOAD_LATENCY_BUCKETS_S) + 1)
        self._latency_sum_s = 0.0
        self.cost = LoadCostModel(load_s_per_block=0.0)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self.cost.load_s_per_block = self._probe_read_s_per_block()
            self._rebuild_index()
        except OSError as exc:
            self._disable(f"cannot use {self.directory}: {exc}")
        self._threads = [threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True),
                         threading.Thread(target=self._load_loop, name="kv-disk-loader", daemon=True)]
        for thread in self._threads:
            thread.start()

    def _disable(self, reason: str) -> None:
        if self.enabled:
            self.enabled = False
            logger.warning("KV disk tier turned off, serving goes on without it: %s", reason)

    def _probe_read_s_per_block(self) -> float:
        """Seconds to read one block cold: a probe file is written, synced, dropped from the page
        cache and read back. Also proves the directory writable."""
        probe = self.directory / f"{TMP_PREFIX}probe-{os.getpid()}-{os.urandom(6).hex()}"
        data = os.urandom(self.block_bytes) * _PROBE_BLOCKS
        try:
            with open(probe, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            start = time.perf_counter()
            with open(probe, "rb") as f:
                f.read()
            return (time.perf_counter() - start) / _PROBE_BLOCKS
        finally:
            probe.unlink(missing_ok=True)

    def _rebuild_index(self) -> None:
        found: list[tuple[float, bytes, int]] = []
        now = time.time()
        with os.scandir(self.directory) as entries:
            for entry in entries:
                try:
                    stat = entry.stat()
                except FileNotFoundError:  # removed meanwhile by another worker on this directory
                    continue
                if entry.name.startswith(TMP_PREFIX):
                    if now - stat.st_mtime > _STALE_TMP_S:
                        Path(entry.path).unlink(missing_ok=True)
                    continue
                digest = _digest_of(entry.name)
                if digest is not None:
                    found.append((stat.st_mtime, digest, stat.st_size))
        with self._lock:
            for _, digest, size in sorted(found):
                self._index[digest] = size
                self._used_bytes += size
        self._evict_over_capacity()
        logger.info("KV disk tier at %s: %d blocks (%d bytes) found", self.directory, len(self._index),
                    self._used_bytes)

    def _path(self, digest: bytes) -> Path:
        return self.directory / block_file_name(digest)

    def num_on_disk(self, digests: list[bytes], count_miss: bool = True) -> int:
        """How many of `digests`, from the first, have a file (not yet validated). `count_miss`:
        a short answer counts as a tier miss (False for a router's read-only prefix query)."""
        if not self.enabled:
            return 0
        count = 0
        for digest in digests:
            if not self._known(digest):
                break
            count += 1
        if count_miss and count < len(digests):
            with self._lock:
                self._counts["miss"] += 1
        return count

    def _known(self, digest: bytes) -> bool:
        with self._lock:
            if digest in self._index:
                return True
        try:
            size = self._path(digest).stat().st_size  # written by another worker on this directory
        except OSError:
            return False
        with self._lock:
            if digest not in self._index:
                self._index[digest] = size
                self._used_bytes += size
        return True

    def contains(self, digest: bytes) -> bool:
        with self._lock:
            return digest in self._index or digest in self._pending

    def submit_load(self, request_id: str, digests: list[bytes]) -> None:
        self._loads.put((request_id, list(digests)))

    def take_finished_loads(self) -> list[FinishedLoad]:
        finished = []
        while self._finished:
            finished.append(self._finished.popleft())
        self._load_done.clear()
        return finished

    def wait_for_loads(self, timeout_s: float) -> None:
        """Block until a load finishes or `timeout_s` passes (the engine has nothing else to do)."""
        if not self._finished:
            self._load_done.wait(timeout_s)

    def _load_loop(self) -> None:
        while (job := self._loads.get()) is not None:
            request_id, digests = job
            start = time.perf_counter()
            blocks = [] if not self.enabled else self._read_prefix(digests)
            duration_s = time.perf_counter() - start
            if blocks:
                self.cost.observe_load(len(blocks), duration_s)
                with self._lock:
                    self._latency_counts[bisect.bisect_left(LOAD_LATENCY_BUCKETS_S, duration_s)] += 1
                    self._latency_sum_s += duration_s
            self._finished.append(FinishedLoad(request_id, blocks))
            self._load_done.set()

    def _read_prefix(self, digests: list[bytes]) -> list[torch.Tensor]:
        blocks = []
        for digest in digests:
            path = self._path(digest)
            try:
                blocks.append(read_block_file(path, self.layout, digest, self.dtype))
            except BadBlockFile as exc:
                logger.warning("KV disk tier: %s is unusable (%s): a miss; removing it", path, exc)
                self._forget(digest, unlink=True, bad=True)
                break
            except OSError as exc:  # gone (evicted by another worker) or unreadable
                logger.debug("KV disk tier: cannot read %s: %s", path, exc)
                self._forget(digest, unlink=False, bad=False)
                break
            with self._lock:
                if digest in self._index:
                    self._index.move_to_end(digest)
                self._counts["hit"] += 1
                self._counts["read"] += self.block_bytes
        return blocks

    def _forget(self, digest: bytes, unlink: bool, bad: bool) -> None:
        with self._lock:
            size = self._index.pop(digest, None)
            if size is not None:
                self._used_bytes -= size
            self._counts["miss"] += 1
            self._counts["bad"] += int(bad)
        if unlink:
            self._path(digest).unlink(missing_ok=True)

    def admit_writes(self, digests: list[bytes]) -> list[int]:
        """Which of these newly computed blocks to write (positions in `digests`): those not on
        disk nor queued, while the write-behind buffer has room."""
        if not self.enabled:
            return []
        picked = []
        with self._lock:
            for position, digest in enumerate(digests):
                if digest in self._index or digest in self._pending:
                    continue
                if self._pending_bytes + self.block_bytes > MAX_PENDING_WRITE_BYTES:
                    self._counts["dropped"] += 1
                    continue
                self._pending.add(digest)
                self._pending_bytes += self.block_bytes
                picked.append(position)
        return picked

    def enqueue_writes(self, digests: list[bytes], kv: torch.Tensor) -> None:
        """`kv[i]` (host memory, shaped [n, *block_shape]) is block `digests[i]`; admitted first."""
        self._writes.put((digests, kv))

    def _write_loop(self) -> None:
        while (job := self._writes.get()) is not None:
            digests, kv = job
            for position, digest in enumerate(digests):
                if self.enabled:
                    self._write_one(digest, kv[position])
                with self._lock:
                    self._pending.discard(digest)
                    self._pending_bytes -= self.block_bytes
            self._writes.task_done()
        self._writes.task_done()

    def _write_one(self, digest: bytes, block: torch.Tensor) -> None:
        payload = block.contiguous().view(torch.uint8).reshape(-1).numpy().data
        try:
            size = write_block_file(self._path(digest), self.layout, digest, payload)
        except OSError as exc:
            self._disable(f"writing {self._path(digest)} failed: {exc}")
            return
        with self._lock:
            old = self._index.pop(digest, None)
            self._used_bytes += size - (old or 0)
            self._index[digest] = size
            self._counts["written"] += size
        self._evict_over_capacity()

    def _evict_over_capacity(self) -> None:
        while True:
            with self._lock:
                if self._used_bytes <= self.capacity_bytes or not self._index:
                    return
                digest, size = self._index.popitem(last=False)
                self._used_bytes -= size
            self._path(digest).unlink(missing_ok=True)

    def flush(self) -> None:
        """Wait until every queued write is on disk (tests, benchmarks, shutdown)."""
        self._writes.join()

    def close(self) -> None:
        self._writes.put(None)
        self._loads.put(None)
        for thread in self._threads:
            thread.join(timeout=10)

    def stats(self) -> KVTierStats:
        with self._lock:
            c = self._counts
            return KVTierStats(self.enabled, self.capacity_bytes, self._used_bytes, len(self._index), c["hit"],
                               c["miss"], c["bad"], c["dropped"], c["read"], c["written"],
                               tuple(self._latency_counts), self._latency_sum_s)


def _digest_of(name: str) -> bytes | None:
    if not name.endswith(FILE_SUFFIX):
        return None
    try:
        return bytes.fromhex(name.removesuffix(FILE_SUFFIX))
    except ValueError:
        return None

