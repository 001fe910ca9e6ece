"""KV transport throughput between two processes: tcp and nixl against memcpy and a raw socket.

    python -m pdserve.bench.kv_transport [--reps 7] [--workloads small,large] [--transports tcp,nixl]

Workload: the KV of one `num_tokens`-token prompt, sent layer by layer from a prefill pool into
reserved blocks of a decode pool in another process. Three placements of its blocks, on both sides:
- "served": where the engine's own allocator (`BlockPool`) puts a request after a seeded churn of
  requests of mixed lengths has come and gone through a pool twice the needed size (prefix
  caching on, tail-first frees): what a serving system sees;
- "scattered": seeded uniformly random blocks of that pool, the worst case (no two adjacent);
- "contiguous": consecutive blocks (fresh pools).
Adjacent block regions merge into one socket buffer / NIXL descriptor.
- memcpy: `torch` copy of the same number of bytes, contiguous, in one process (the ceiling for
  anything that moves bytes through the CPU).
Every buffer, pools and baselines alike, is host memory as the engine allocates its pool
(`host_memory.zeroed_pages`: transparent huge pages where the kernel allows them).
- raw socket: `socket.sendall` / `recv_into` of the same bytes, contiguous, between the two
  processes over loopback, then a 1-byte ack (the ceiling for any socket transport).
- tcp / nixl: `send_layer` for every layer + `send_done`, timed until `flush` returns, i.e. decode
  acknowledged every payload as written into its pool.
Each row is the median of `--reps` runs after warm-up runs; both processes use one torch thread.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import math
import multiprocessing
import multiprocessing.connection
import random
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.bench.common import hardware_line, print_table
from pdserve.disagg.kv_layout import KVLayout
from pdserve.disagg.transport import KVReceiver, make_receiver, make_sender, nixl_available
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.host_memory import zeroed_pages

_SEED = 0
_NUM_WARMUP = 2
_FLUSH_TIMEOUT_S = 60.0
PLACEMENTS = ("served", "scattered", "contiguous")


@dataclass(frozen=True, slots=True)
class KVWorkload:
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int
    num_tokens: int

    @property
    def num_blocks(self) -> int:
        return -(-self.num_tokens // self.block_size)

    @property
    def pool_blocks(self) -> int:
        return 2 * self.num_blocks

    @property
    def payload_bytes(self) -> int:
        return self.num_blocks * self.num_layers * self.layout().block_bytes_per_layer

    def describe(self) -> str:
        return (f"{self.name}: {self.num_tokens} tokens, {self.num_layers} layers, {self.num_kv_heads} KV heads, "
                f"head_dim {self.head_dim}, {self.dtype}, block {self.block_size} -> "
                f"{self.payload_bytes / 2**20:.0f} MiB in {self.num_layers} payloads of {self.num_blocks} blocks")

    def layout(self) -> KVLayout:
        return KVLayout("bench", self.dtype, self.dtype, self.block_size, self.num_layers, self.num_kv_heads,
                        self.head_dim)

    @property
    def pool_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.pool_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def pool(self, seed: int | None) -> torch.Tensor:
        """A pool allocated as the engine allocates its own (huge pages), shaped like it; random bits
        (every page touched) or, with no seed, zeros (every page touched as well)."""
        pool = _buffer(math.prod(self.pool_shape) * self.layout().element_bytes)
        if seed is None:
            pool.fill_(0)
        else:
            pool.view(torch.int32).random_(generator=torch.Generator().manual_seed(seed))
        return pool.view(getattr(torch, self.dtype)).view(self.pool_shape)

    def placement(self, kind: str) -> tuple[list[int], list[int]]:
        """(source blocks, destination blocks) for placement `kind` (see the module docstring)."""
        if kind == "contiguous":
            return list(range(self.num_blocks)), list(range(self.num_blocks, 2 * self.num_blocks))
        rng = random.Random(_SEED)
        if kind == "scattered":
            blocks = range(self.pool_blocks)
            return rng.sample(blocks, self.num_blocks), rng.sample(blocks, self.num_blocks)
        return self._served_blocks(rng), self._served_blocks(rng)

    def _served_blocks(self, rng: random.Random, num_requests: int = 400) -> list[int]:
        """The blocks the engine's allocator gives this request after `num_requests` others of 16 to
        1024 tokens came and went (a third of the pool held by the latest of them)."""
        pool = BlockPool(self.pool_blocks, enable_caching=True)
        live: list[list[int]] = []
        for n in range(num_requests):
            need = rng.randint(1, 1024 // self.block_size)
            while live and (pool.num_free_blocks < need or pool.num_used_blocks > self.pool_blocks // 3):
                blocks = live.pop(rng.randrange(len(live)))
                pool.free(blocks[::-1])  # tail first, as the engine frees
            blocks = pool.allocate(need)
            for i, block in enumerate(blocks):
                pool.cache_block(block, f"{n}:{i}".encode())
            live.append(blocks)
        for blocks in live:
            pool.free(blocks[::-1])
        return pool.allocate(self.num_blocks)


WORKLOADS = {
    # the `small` demo preset's KV shape, for a 4K-token prompt
    "small": KVWorkload("small", num_layers=4, num_kv_heads=2, head_dim=64, dtype="float32", block_size=16,
                        num_tokens=4096),
    # 16 layers of a Qwen3-8B-like KV shape (8 KV heads x 128, bf16), 4K tokens
    "large": KVWorkload("large", num_layers=16, num_kv_heads=8, head_dim=128, dtype="bfloat16", block_size=16,
                        num_tokens=4096),
}


def _buffer(num_bytes: int) -> torch.Tensor:
    """Every buffer of this benchmark, baselines included, is host memory of the kind the engine's
    pool is (`zeroed_pages`), so the ratios compare transports, not allocators."""
    return zeroed_pages(num_bytes)


def _random_bytes(num_bytes: int) -> torch.Tensor:
    data = _buffer(num_bytes)
    data.view(torch.int32).random_(generator=torch.Generator().manual_seed(_SEED))
    return data


def _digest(pool: torch.Tensor, block_ids: list[int]) -> str:
    blocks = pool[:, :, torch.tensor(block_ids)].contiguous()
    return hashlib.blake2b(blocks.view(-1).view(torch.uint8).numpy().data).hexdigest()


# -- decode process --------------------------------------------------------------------------------
def _decode_main(conn: multiprocessing.connection.Connection, work: KVWorkload) -> None:
    """Decode side, driven by the parent over `conn`: one command at a time."""
    torch.set_num_threads(1)
    pool = work.pool(None)
    receiver: KVReceiver | None = None
    loop = asyncio.new_event_loop()
    while True:
        command, *args = conn.recv()
        if command == "stop":
            if receiver is not None:
                receiver.close()
            conn.send(None)
            return
        if command == "raw":
            _raw_server(conn, *args)
        elif command == "receiver":
            if receiver is not None:
                receiver.close()
            receiver = make_receiver(args[0], work.layout(), pool)
            conn.send(receiver.address)
        elif command == "expect":
            assert receiver is not None
            receiver.expect(*args)
            conn.send(None)
        elif command == "drain":
            assert receiver is not None
            conn.send(loop.run_until_complete(_drain(receiver, args[0])))
        elif command == "digest":
            conn.send(_digest(pool, args[0]))


async def _drain(receiver: KVReceiver, request_id: str) -> str:
    while True:
        event = await receiver.wait(request_id, _FLUSH_TIMEOUT_S)
        if not hasattr(event, "layer"):
            return type(event).__name__


def _raw_server(conn: multiprocessing.connection.Connection, num_bytes: int, num_runs: int) -> None:
    buffer = _buffer(num_bytes)
    buffer.fill_(0)
    view = buffer.numpy().data
    with socket.create_server(("127.0.0.1", 0)) as server:
        conn.send(server.getsockname()[1])
        peer, _ = server.accept()
        with peer:
            for _ in range(num_runs):
                received = 0
                while received < num_bytes:
                    received += peer.recv_into(view[received:], num_bytes - received)
                peer.sendall(b"k")
    conn.send(None)


# -- measurements (prefill process) ----------------------------------------------------------------
def _median_s(run_once: Callable[[int], None], reps: int) -> float:
    for i in range(_NUM_WARMUP):
        run_once(-1 - i)
    times = []
    for i in range(reps):
        start = time.perf_counter()
        run_once(i)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_memcpy(work: KVWorkload, reps: int) -> float:
    src = _random_bytes(work.payload_bytes)
    dst = _buffer(work.payload_bytes)
    dst.fill_(0)

    def once(_: int) -> None:
        dst.copy_(src)

    return _median_s(once, reps)


def measure_raw_socket(conn: multiprocessing.connection.Connection, work: KVWorkload, reps: int) -> float:
    view = _random_bytes(work.payload_bytes).numpy().data
    conn.send(("raw", work.payload_bytes, reps + _NUM_WARMUP))
    port = conn.recv()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def once(_: int) -> None:
            sock.sendall(view)
            if sock.recv(1) != b"k":
                raise RuntimeError("raw socket peer went away")

        median = _median_s(once, reps)
    conn.recv()
    return median


def measure_transport(conn: multiprocessing.connection.Connection, work: KVWorkload, pool: torch.Tensor,
                      name: str, reps: int, placement: str) -> float:
    """Time from the first send_layer to flush returning; reservation and event draining untimed."""
    conn.send(("receiver", name))
    address = conn.recv()
    sender = make_sender(name, work.layout(), pool)
    sender.connect(address)
    src, dst = work.placement(placement)
    loop = asyncio.new_event_loop()
    timed: list[float] = []

    def once(i: int) -> None:
        rid = f"{name}-{i}"
        conn.send(("expect", rid, dst))
        conn.recv()
        start = time.perf_counter()
        for layer in range(work.num_layers):
            sender.send_layer(rid, layer, src, dst)
        sender.send_done(rid, 0, b"")
        loop.run_until_complete(sender.flush(rid, _FLUSH_TIMEOUT_S))
        timed.append(time.perf_counter() - start)
        conn.send(("drain", rid))
        if conn.recv() != "KVDone":
            raise RuntimeError(f"{name}: request {rid} did not end with KVDone")

    try:
        _median_s(once, reps)
    finally:
        sender.close()
        loop.close()
    conn.send(("digest", dst))
    if conn.recv() != _digest(pool, src):
        raise RuntimeError(f"{name}: decode's blocks differ from prefill's")
    return statistics.median(timed[_NUM_WARMUP:])


def run_workload(work: KVWorkload, transports: list[str], reps: int) -> dict[str, float]:
    """Seconds per transfer, by method."""
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    decode = ctx.Process(target=_decode_main, args=(child, work), daemon=True)
    decode.start()
    try:
        pool = work.pool(_SEED)
        seconds = {"memcpy": measure_memcpy(work, reps), "raw socket": measure_raw_socket(conn, work, reps)}
        for placement in PLACEMENTS:
            for name in transports:
                seconds[f"{name}, {placement}"] = measure_transport(conn, work, pool, name, reps, placement)
        conn.send(("stop",))
        conn.recv()
    finally:
        decode.join(30)
        if decode.is_alive():
            decode.kill()
    return seconds


def _rows(work: KVWorkload, seconds: dict[str, float]) -> list[list[str]]:
    gbps = {m: work.payload_bytes / s / 1e9 for m, s in seconds.items()}
    return [[work.name, method, f"{work.payload_bytes / 2**20:.0f}", f"{s * 1e3:.2f}", f"{gbps[method]:.2f}",
             f"{gbps[method] / gbps['memcpy']:.2f}", f"{gbps[method] / gbps['raw socket']:.2f}"]
            for method, s in seconds.items()]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--workloads", default="small,large")
    parser.add_argument("--transports", default="tcp,nixl" if nixl_available() else "tcp")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(_SEED)
    works = [WORKLOADS[name] for name in args.workloads.split(",")]
    transports = args.transports.split(",")
    print(hardware_line())
    for work in works:
        print(work.describe())
    results = [(work, run_workload(work, transports, args.reps)) for work in works]
    print_table(["workload", "method", "MiB", "median ms", "GB/s", "vs memcpy", "vs raw socket"],
                [row for work, seconds in results for row in _rows(work, seconds)])
    for work, s in results:
        ratios = []
        for placement in PLACEMENTS:
            if f"tcp, {placement}" in s:
                ratios.append(f"tcp {placement} / raw socket = {s['raw socket'] / s[f'tcp, {placement}']:.2f}")
            if f"nixl, {placement}" in s:
                ratios.append(f"nixl {placement} / memcpy = {s['memcpy'] / s[f'nixl, {placement}']:.2f}")
        print(f"{work.name} (targets: tcp >= 0.7 x raw socket, nixl >= 0.5 x memcpy): " + "; ".join(ratios))


if __name__ == "__main__":
    main()
