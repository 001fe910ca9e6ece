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
- "served, from DTYPE": the same, from a prefill pool in another KV dtype (`CONVERT_FROM`: the
  bfloat16 <-> float32 pairs, so half or twice the bytes on the wire; MiB is decode's): decode lands
  each layer in staging and casts it into its blocks. Its verdict line gives the paired ratio to
  the same-dtype "served" row. (float16 -> bfloat16 would keep the bytes equal, but this CPU casts
  between the two half types at ~5 ns an element, 2-3x a float32 <-> bfloat16 cast.)
Measured in rounds: each round runs every method once, back to back, `--reps` rounds after warm-up
rounds. A row's time is the median over rounds; its ratios are medians of the per-round ratios, so
a slow spell of a shared machine slows a method and its baseline alike instead of skewing the
ratio. The baselines also run alone first (back to back, nothing in between: their best case),
and each transport's verdict line gives both ratios. After the rounds, every transport moves the
KV once more into zeroed blocks, which must then equal the source. Both processes use one torch
thread and are not pinned: over loopback the kernel copies faster when the scheduler may run
sender and receiver on one core (pinned to two cores, the raw socket took ~135 ms for 256 MiB
instead of ~85).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import multiprocessing
import multiprocessing.connection
import socket
import statistics
import time

import torch

from pdserve.bench.common import hardware_line, print_table
from pdserve.bench.kv_peers import FLUSH_TIMEOUT_S, decode_main, raw_socket_main
from pdserve.bench.kv_workload import PLACEMENTS, SEED, WORKLOADS, KVWorkload, buffer, digest, random_bytes
from pdserve.disagg.handoff import HandOffDone
from pdserve.disagg.transport import KVSender, make_sender, nixl_available

_NUM_WARMUP = 2
BASELINES = ("memcpy", "raw socket")
# decode pool's dtype -> the prefill pool's in the converted rows
CONVERT_FROM = {"bfloat16": "float32", "float16": "float32", "float32": "bfloat16"}


class _Memcpy:
    def __init__(self, work: KVWorkload) -> None:
        self._src = random_bytes(work.payload_bytes)
        self._dst = buffer(work.payload_bytes)
        self._dst.fill_(0)

    def once(self, _: str) -> None:
        self._dst.copy_(self._src)

    def close(self) -> None:
        pass


class _RawSocket:
    def __init__(self, work: KVWorkload) -> None:
        self._view = random_bytes(work.payload_bytes).numpy().data
        ctx = multiprocessing.get_context("spawn")
        conn, child = ctx.Pipe()
        self._process = ctx.Process(target=raw_socket_main, args=(child, work.payload_bytes), daemon=True)
        self._process.start()
        self._sock = socket.create_connection(("127.0.0.1", conn.recv()))
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def once(self, _: str) -> None:
        self._sock.sendall(self._view)
        if self._sock.recv(1) != b"k":
            raise RuntimeError("raw socket peer went away")

    def close(self) -> None:
        self._sock.close()
        self._process.join(30)


class _Transport:
    """`send_layer` for every layer + `send_done`, until `flush` returns. Reserving the blocks
    (`expect`) and draining decode's events happen outside `once`, untimed."""

    def __init__(self, conn: multiprocessing.connection.Connection, work: KVWorkload, pool: torch.Tensor,
                 name: str, sender: KVSender, placement: str) -> None:
        """`pool` is the sender's (in another dtype than decode's for a converted row)."""
        self._conn, self._work, self._pool, self.name = conn, work, pool, name
        self.src, self.dst = work.placement(placement)
        self._sender = sender
        self._loop = asyncio.new_event_loop()

    def expect(self, rid: str) -> None:
        self._conn.send(("expect", self.name, rid, self.dst))
        self._conn.recv()

    def once(self, rid: str) -> None:
        for layer in range(self._work.num_layers):
            self._sender.send_layer(rid, layer, self.src, self.dst)
        self._sender.send_done(rid, HandOffDone(0, b"").encode())
        self._loop.run_until_complete(self._sender.flush(rid, FLUSH_TIMEOUT_S))

    def drain(self, rid: str) -> None:
        self._conn.send(("drain", self.name, rid))
        if self._conn.recv() != "KVDone":
            raise RuntimeError(f"{self.name}: request {rid} did not end with KVDone")

    def check(self, rid: str) -> None:
        """One more transfer into zeroed destination blocks; they must then equal the source."""
        self._conn.send(("clear", self.dst))
        self._conn.recv()
        self.expect(rid)
        self.once(rid)
        self.drain(rid)
        self._conn.send(("digest", self.dst))
        sent = self._pool[:, :, torch.tensor(self.src)].to(getattr(torch, self._work.dtype))
        if self._conn.recv() != digest(sent, list(range(len(self.src)))):
            raise RuntimeError(f"{self.name}: decode's blocks differ from prefill's")

    def close(self) -> None:
        self._loop.close()


def run_workload(work: KVWorkload, transports: list[str], reps: int) -> dict[str, list[float]]:
    """Seconds per transfer, by method, one entry per round. Every round runs every method once,
    back to back, so a slow spell of the (shared) machine hits all of them alike."""
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    decode = ctx.Process(target=decode_main, args=(child, work), daemon=True)
    decode.start()
    methods: dict[str, _Memcpy | _RawSocket | _Transport] = {}
    senders: dict[str, KVSender] = {}
    try:
        pool = work.pool(SEED)
        baselines: dict[str, _Memcpy | _RawSocket] = {"memcpy": _Memcpy(work), "raw socket": _RawSocket(work)}
        methods.update(baselines)
        methods.update(_transports(conn, work, pool, transports, senders))
        seconds: dict[str, list[float]] = {f"{method}, alone": _alone(baselines[method], reps)
                                           for method in BASELINES}
        seconds.update({method: [] for method in methods})
        for round_ in range(-_NUM_WARMUP, reps):
            for method, runner in methods.items():
                elapsed = _timed_once(runner, f"{method}-{round_}")
                if round_ >= 0:
                    seconds[method].append(elapsed)
        for method, runner in methods.items():
            if isinstance(runner, _Transport):
                runner.check(f"{method}-check")
        for runner in methods.values():
            runner.close()
        for sender in senders.values():
            sender.close()
        conn.send(("stop",))
        conn.recv()
    finally:
        decode.join(30)
        if decode.is_alive():
            decode.kill()
    return seconds


def _timed_once(runner: _Memcpy | _RawSocket | _Transport, rid: str) -> float:
    """Seconds one transfer `rid` takes (a transport's: expected before, drained after the clock)."""
    if isinstance(runner, _Transport):
        runner.expect(rid)
    start = time.perf_counter()
    runner.once(rid)
    elapsed = time.perf_counter() - start
    if isinstance(runner, _Transport):
        runner.drain(rid)
    return elapsed


def _transports(conn: multiprocessing.connection.Connection, work: KVWorkload, pool: torch.Tensor,
                transports: list[str], senders: dict[str, KVSender]) -> dict[str, _Transport]:
    """Each transport's methods: one per placement, and the converted one; `senders` gets the
    senders (two per transport: one per prefill pool, both to the same receiver)."""
    other = dataclasses.replace(work, dtype=CONVERT_FROM[work.dtype])
    other_pool = other.pool(SEED)
    for name in transports:  # one sender per transport, as a prefill worker has per decode worker
        conn.send(("receiver", name))
        address = conn.recv()
        senders[name] = make_sender(name, work.layout(), pool)
        senders[f"{name}, from"] = make_sender(name, other.layout(), other_pool)
        for sender in (senders[name], senders[f"{name}, from"]):
            sender.connect(address)
    methods = {f"{name}, {placement}": _Transport(conn, work, pool, name, senders[name], placement)
               for placement in PLACEMENTS for name in transports}
    for name in transports:
        methods[f"{name}, served, from {other.dtype}"] = _Transport(conn, work, other_pool, name,
                                                                    senders[f"{name}, from"], "served")
    return methods


def _alone(runner: _Memcpy | _RawSocket, reps: int) -> list[float]:
    """A baseline run back to back, nothing else in between: its best conditions."""
    times = []
    for i in range(-_NUM_WARMUP, reps):
        start = time.perf_counter()
        runner.once("")
        if i >= 0:
            times.append(time.perf_counter() - start)
    return times


def ratio(seconds: dict[str, list[float]], baseline: str, method: str) -> float:
    """Median over rounds of (baseline time / method time) in the same round: > 1 is faster."""
    return statistics.median(b / m for b, m in zip(seconds[baseline], seconds[method], strict=True))


def _rows(work: KVWorkload, seconds: dict[str, list[float]]) -> list[list[str]]:
    rows = []
    for method, times in seconds.items():
        median_s = statistics.median(times)
        paired = not method.endswith(", alone")
        ratios = [ratio(seconds, base, method) if paired else statistics.median(seconds[base]) / median_s
                  for base in BASELINES]
        rows.append([work.name, method, f"{work.payload_bytes / 2**20:.0f}", f"{median_s * 1e3:.2f}",
                     f"{work.payload_bytes / median_s / 1e9:.2f}", *(f"{r:.2f}" for r in ratios)])
    return rows


def _verdicts(seconds: dict[str, list[float]]) -> list[str]:
    """Each transport against its target's baseline: paired rounds, and the baseline's median alone."""
    out = []
    for placement in PLACEMENTS:
        for name, base in (("tcp", "raw socket"), ("nixl", "memcpy")):
            method = f"{name}, {placement}"
            if method in seconds:
                alone = statistics.median(seconds[f"{base}, alone"]) / statistics.median(seconds[method])
                out.append(f"{name} {placement} / {base} = {ratio(seconds, base, method):.2f} (vs {base} alone: "
                           f"{alone:.2f})")
    for method in [m for m in seconds if ", from " in m]:
        same = method.split(", from ")[0]
        out.append(f"{method} / {same} (the conversion's cost, paired) = {ratio(seconds, same, method):.2f}")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--workloads", default="small,large")
    parser.add_argument("--transports", default="tcp,nixl" if nixl_available() else "tcp")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    works = [WORKLOADS[name] for name in args.workloads.split(",")]
    transports = args.transports.split(",")
    print(hardware_line())
    for work in works:
        print(work.describe())
    results = [(work, run_workload(work, transports, args.reps)) for work in works]
    print_table(["workload", "method", "MiB", "median ms", "GB/s", "vs memcpy", "vs raw socket"],
                [row for work, seconds in results for row in _rows(work, seconds)])
    for work, s in results:
        print(f"{work.name} (targets: tcp >= 0.7 x raw socket, nixl >= 0.5 x memcpy): " + "; ".join(_verdicts(s)))


if __name__ == "__main__":
    main()
