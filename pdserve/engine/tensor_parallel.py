"""Tensor parallelism: N ranks as processes, rank 0 the engine's own process.

    engine process (rank 0)                         rank r = 1..N-1 (spawned)
    scheduler -> plan_step -> StepPlan --pipe--->   recv StepPlan
    ModelRunner.run(plan) (heads of rank 0)   <->   ModelRunner.run(plan) (heads of rank r)
        all-reduce after o_proj and down_proj, all-gather of the logit slices (on CPU through a
        shared-memory file, gloo for what does not fit; NCCL on CUDA; the collectives are inside
        the model, see model/parallel.py and shared_memory_group.py)
    sampler (rank 0 only)

Rank 0 runs the scheduler and sends each step's plan (plain integers) to the other ranks; they
only compute. On CPU every rank maps one shared KV pool file and writes only its heads into it, so
rank 0's `kv_cache` holds every head: the KV transports and the disk tier use it as with one
process (the KV hand-off across TP sizes needs nothing more, but that rank 0 reports a layer to KV
streaming once every rank wrote it: `_OnceEveryRankWrote`). On CUDA each rank has its own pool
(`rank_pools`; on CPU too with PDSERVE_TP_RANK_POOLS=1): a prefill worker's ranks then each send
their own heads, which a rank hook does on every rank (`install_rank_hook`, disagg/worker/rank_streaming.py):

    rank 0                                            rank r
    install_rank_hook(spec)        --pipe-->          hook = spec(kv_cache, config, r)  -> "ok"
    rank_command(message)          --pipe-->          hook.command(message)          -> its reply
    StepPlan{rank_message}         --pipe-->          runner.run(plan, hook.step(rank_message))

KV heads replicated on several ranks (fewer KV heads than ranks) are written by each of them to the
same slots of the shared pool: the same bytes (same weights, same all-reduced input, same kernel
shapes), so the race is benign. NOTE: the pool file is unlinked once every rank has mapped it; a
rank 0 killed during start-up leaves it in /dev/shm (sparse: no memory until written).

A rank that dies fails the next step on rank 0 (a liveness check, or the collective's error);
the engine then ends like any engine whose step raised (AsyncLLM: EngineDeadError, exit non-zero).
A rank whose parent dies reads EOF on its pipe and exits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pdserve import envs
from pdserve.config import EngineConfig
from pdserve.engine import shared_memory_group
from pdserve.engine.host_memory import keep_large_allocations_on_heap
from pdserve.engine.kv_transfer import RankHook, RankHookSpec, RankPools
from pdserve.engine.model_runner import ModelRunner, PromptLogits, StepSamples
from pdserve.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from pdserve.engine.shared_memory_group import SharedMemoryGroup
from pdserve.engine.step_plan import StepPlan
from pdserve.model.loader import load_model
from pdserve.model.parallel import TPShard

logger = logging.getLogger(__name__)
# NOTE: a safety net only: a collective waits this long for a rank that is alive but stuck. A rank
# that dies closes its sockets, which fails a gloo collective at once; a shared-memory one notices
# within ~20 ms (its waiters ask whether the ranks' processes are alive).
_COLLECTIVE_TIMEOUT = timedelta(seconds=300)
_START_TIMEOUT_S = 300.0
_MAX_SLOT_BYTES = 16 * 1024**2  # per rank and half of the shared collective file (sparse: touched pages only)


class RankDiedError(RuntimeError):
    """A tensor-parallel rank exited: the engine cannot compute another step."""


@dataclass(frozen=True, slots=True)
class _InstallHook:
    spec: RankHookSpec


@dataclass(frozen=True, slots=True)
class _HookCommand:
    message: Any


class TorchGroup:
    """`ParallelGroup` over a standalone torch.distributed process group (no global default group,
    so several engines may live in one process, as tests do). On CPU, collectives that fit go
    through `shared` (the ranks' shared-memory file) instead of gloo: see shared_memory_group.py."""

    def __init__(self, rank: int, size: int, store: dist.Store, device: torch.device,
                 shared: SharedMemoryGroup | None = None) -> None:
        self.rank, self.size = rank, size
        if device.type == "cuda":
            torch.cuda.set_device(device)
            self.pg: Any = dist.ProcessGroupNCCL(store, rank, size, dist.ProcessGroupNCCL.Options())
        else:
            self.pg = dist.ProcessGroupGloo(store, rank, size, _COLLECTIVE_TIMEOUT)
        self.shared = shared
        self.reduce_s = 0.0  # time spent in all-reduces (the benchmark's share of a step)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        if self.shared is not None and self.shared.fits(tensor):
            self.shared.all_reduce(tensor)
        else:
            self.pg.allreduce([tensor]).wait()
        self.reduce_s += time.perf_counter() - start
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.shared is not None and self.shared.fits(tensor):
            return self.shared.all_gather(tensor)
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        self.pg.allgather([parts], [tensor.contiguous()]).wait()
        return torch.cat(parts, dim=-1)


def collective_slot_bytes(config: EngineConfig) -> int:
    """One rank's slot in the shared collective file: the largest step's activations ([tokens,
    hidden] in the model's dtype), at most `_MAX_SLOT_BYTES` (bigger ones go through gloo)."""
    element = torch.empty((), dtype=config.dtype).element_size()
    wanted = config.scheduler.max_num_batched_tokens * config.model.hidden_size * element
    return -(-min(wanted, _MAX_SLOT_BYTES) // 64) * 64


def shared_group(path: str | None, config: EngineConfig, rank: int,
                 alive: Callable[[], bool]) -> SharedMemoryGroup | None:
    if path is None:
        return None
    return SharedMemoryGroup(path, rank, config.tensor_parallel_size, collective_slot_bytes(config), alive,
                             _COLLECTIVE_TIMEOUT.total_seconds())


def build_rank_runner(config: EngineConfig, group: TorchGroup, pool_path: str | None,
                      runner_class: type[ModelRunner] = ModelRunner) -> ModelRunner:
    """This rank's model slice and runner (its heads of the shared pool on CPU)."""
    rank, size = group.rank, group.size
    model = load_model(config.model_path, config.dtype, config.device, config.scheduler.max_model_len,
                       batch_size_hint=min(config.scheduler.max_num_seqs, 64), group=group)
    if pool_path is None:
        return runner_class(config, model)
    m = config.model
    shape = (m.num_hidden_layers, 2, config.cache.num_kv_blocks, config.cache.block_size, m.num_key_value_heads,
             m.head_dim)
    pool = torch.from_file(pool_path, shared=True, size=math.prod(shape), dtype=config.kv_dtype).view(shape)
    if config.cache.prefault and rank == 0:  # NOTE: the file reads as zeros; writing them commits its pages for all
        pool.view(-1).view(torch.uint8).zero_()
    return runner_class(config, model, pool, TPShard(rank, size).kv_head_range(m))


@dataclass(frozen=True, slots=True)
class RankStart:
    """What rank 0 sends a new rank first."""

    config: EngineConfig
    rank: int
    store_port: int
    pool_path: str | None  # the shared KV pool file (CPU), else None
    collective_path: str | None  # the shared-memory collective file (CPU on x86), else None


def rank_main(conn: Connection) -> None:
    """A rank other than 0 (`python -m pdserve.engine.tp_rank`): build its runner, then run every
    plan rank 0 sends until told to stop."""
    # NOTE: Ctrl-C (or `pdserve up`'s SIGINT to the group) reaches every rank; rank 0 handles it
    # and stops this one (None, or EOF once it is gone), with no traceback from here
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    start: RankStart = conn.recv()
    conn.send("started")
    config, rank = rank_config(start.config, start.rank), start.rank
    torch.set_num_threads(rank_threads(config))
    if config.device.type == "cpu":
        keep_large_allocations_on_heap()
    runner = _join_group(conn, start, config)
    conn.send("ready")
    hook: RankHook | None = None
    while True:
        try:
            message: StepPlan | _InstallHook | _HookCommand | None = conn.recv()
        except EOFError:  # rank 0 is gone
            os._exit(1)
        if message is None:
            if hook is not None:
                hook.close()
            return
        if isinstance(message, StepPlan):
            runner.run(message, None if hook is None else hook.step(message.rank_message))
            continue
        try:
            if isinstance(message, _InstallHook):
                hook, reply = message.spec(runner.kv_cache, config, rank), None
            else:
                assert hook is not None, "a rank command before its hook"
                reply = hook.command(message.message)
        except Exception as exc:  # noqa: BLE001 - rank 0 raises it
            logger.exception("tensor-parallel rank %d: hook failed", rank)
            conn.send(("error", repr(exc)))
        else:
            conn.send(("ok", reply))


def _join_group(conn: Connection, start: RankStart, config: EngineConfig) -> ModelRunner:
    """This rank's runner, in the group with the others (an error goes to rank 0, then SystemExit)."""
    rank = start.rank
    try:
        store = dist.TCPStore("127.0.0.1", start.store_port, config.tensor_parallel_size, is_master=False,
                              timeout=_COLLECTIVE_TIMEOUT)
        parent = os.getppid()
        shared = shared_group(start.collective_path, config, rank, lambda: os.getppid() == parent)
        return build_rank_runner(config, TorchGroup(rank, config.tensor_parallel_size, store, config.device, shared),
                                 start.pool_path)
    except Exception as exc:  # noqa: BLE001 - rank 0 reports it
        conn.send(repr(exc))
        raise SystemExit(1) from exc


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """On CUDA rank r computes on the r-th GPU from the configured one; on CPU nothing changes."""
    if config.device.type != "cuda":
        return config
    return dataclasses.replace(config, device=torch.device("cuda", (config.device.index or 0) + rank))


def rank_threads(config: EngineConfig) -> int:
    """--num-threads per rank, else the cores shared out between the ranks."""
    if config.num_threads:
        return config.num_threads
    return max(1, (os.cpu_count() or 1) // config.tensor_parallel_size)


class TPModelRunner(ModelRunner):
    """Rank 0: a `ModelRunner` over its own heads that first sends each step's plan to the other
    ranks. Build it with `start_tensor_parallel`."""

    step_message: Callable[[list[ScheduledChunk]], object] | None = None  # see install_rank_hook
    _chunks: list[ScheduledChunk] = []  # the step's, while it runs

    @property
    def rank_pools(self) -> RankPools | None:
        """This runner, when each rank has a KV pool of its own, holding its heads (CUDA; CPU with
        PDSERVE_TP_RANK_POOLS=1): `kv_cache` holds rank 0's only. None: the ranks share one pool."""
        return self if self.local_cache is self.kv_cache else None  # NOTE: a shared pool's local cache is a view

    @property
    def num_other_ranks(self) -> int:
        return len(self.processes)

    def install_rank_hook(self, spec: RankHookSpec,
                          step_message: Callable[[list[ScheduledChunk]], object] | None = None) -> None:
        """Build `spec`'s hook on every other rank (RuntimeError naming the rank that failed);
        from now on each step's plan carries `step_message(the step's chunks)` to them."""
        self._ask(_InstallHook(spec))
        self.step_message = step_message

    def rank_command(self, message: Any) -> list[Any]:
        """Run `message` through every other rank's hook, between steps (engine thread); their
        replies, rank 1 first. RuntimeError naming the rank whose hook raised."""
        return self._ask(_HookCommand(message))

    def _ask(self, message: _InstallHook | _HookCommand) -> list[Any]:
        try:
            for conn in self.conns:
                conn.send(message)
        except OSError as exc:
            raise RankDiedError(f"a tensor-parallel rank is gone: {exc}") from exc
        replies, errors = [], []
        for rank, (process, conn) in enumerate(zip(self.processes, self.conns, strict=True), start=1):
            try:
                status, reply = conn.recv()
            except EOFError as exc:
                raise RankDiedError(f"tensor-parallel rank {rank} exited (code {process.wait()})") from exc
            if status != "ok":
                errors.append(f"rank {rank}: {reply}")
            replies.append(reply)
        if errors:
            raise RuntimeError("; ".join(errors))
        return replies

    def execute(self, out: SchedulerOutput, layer_done: Callable[[int], None] | None = None) -> StepSamples:
        self._chunks = out.chunks
        try:
            return super().execute(out, layer_done)
        finally:
            self._chunks = []

    def attach_ranks(self, processes: list[subprocess.Popen[bytes]], conns: list[Connection], group: TorchGroup,
                     store: dist.Store) -> None:
        """`store`: the rendezvous store rank 0 serves; it lives as long as the group. The ranks
        stop with `close`, or when this runner is garbage-collected (an `LLM` dropped unclosed)."""
        self.processes, self.conns, self.group, self.store = processes, conns, group, store
        self._finalizer = weakref.finalize(self, _stop_ranks, processes, conns)

    def run(self, plan: StepPlan, layer_done: Callable[[int], None] | None = None,
            prompt_logits: PromptLogits | None = None) -> torch.Tensor | None:
        for rank, process in enumerate(self.processes, start=1):
            if process.poll() is not None:
                raise RankDiedError(f"tensor-parallel rank {rank} exited (code {process.returncode})")
        if self.step_message is not None:
            plan.rank_message = self.step_message(self._chunks)
        try:
            for conn in self.conns:
                conn.send(plan)
        except OSError as exc:
            raise RankDiedError(f"a tensor-parallel rank is gone: {exc}") from exc
        if layer_done is None or self.rank_pools is not None:
            return super().run(plan, layer_done, prompt_logits)
        reports = _OnceEveryRankWrote(layer_done)
        logits = super().run(plan, reports, prompt_logits)
        reports.finish()
        return logits

    def close(self) -> None:
        """Stop the other ranks (they finish nothing: the engine is done)."""
        self._finalizer()


class _OnceEveryRankWrote:
    """`layer_done` for rank 0 of a shared pool: layer l is reported once every rank wrote its heads
    of it, not when rank 0 wrote its own (the model reports a layer right after its attention, while
    the other ranks may still be computing theirs). Rank 0 past layer l's o_proj all-reduce means
    every rank entered it, each after its attention l: so layer l is reported when rank 0 reaches
    attention l + 1, the last layer once the forward returns."""

    def __init__(self, layer_done: Callable[[int], None]) -> None:
        self.layer_done = layer_done
        self.last: int | None = None

    def __call__(self, layer: int) -> None:
        if self.last is not None:
            self.layer_done(self.last)
        self.last = layer

    def finish(self) -> None:
        if self.last is not None:
            self.layer_done(self.last)
            self.last = None


def _stop_ranks(processes: list[subprocess.Popen[bytes]], conns: list[Connection]) -> None:
    for conn in conns:
        with contextlib.suppress(OSError):
            conn.send(None)
    for process in processes:
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    for conn in conns:
        conn.close()


def make_runner(config: EngineConfig) -> ModelRunner:
    """The engine's runner: rank 0 of `tensor_parallel_size` processes, or this process's model."""
    if config.tensor_parallel_size > 1:
        return start_tensor_parallel(config)
    model = load_model(config.model_path, config.dtype, config.device, config.scheduler.max_model_len,
                       batch_size_hint=min(config.scheduler.max_num_seqs, 64))
    return ModelRunner(config, model)


def start_tensor_parallel(config: EngineConfig) -> TPModelRunner:
    """Spawn ranks 1..N-1, join them in one process group, build rank 0's runner here."""
    size = config.tensor_parallel_size
    torch.set_num_threads(rank_threads(config))
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False, timeout=_COLLECTIVE_TIMEOUT)
    cpu = config.device.type == "cpu"
    pool_path = _new_shared_file("kv") if cpu and not envs.tp_rank_pools() else None
    collective_path = _new_shared_file("collectives") if cpu and shared_memory_group.available() else None
    processes: list[subprocess.Popen[bytes]] = []
    conns: list[Connection] = []
    try:
        for rank in range(1, size):
            process, conn = _spawn_rank()
            processes.append(process)
            conns.append(conn)
            conn.send(RankStart(config, rank, store.port, pool_path, collective_path))
        # NOTE: a rank that cannot even start is reported now, not after the group's timeout
        _wait_for(processes, conns, "started")
        shared = shared_group(collective_path, config, 0, lambda: all(p.poll() is None for p in processes))
        group = TorchGroup(0, size, store, config.device, shared)
        runner = build_rank_runner(config, group, pool_path, TPModelRunner)
        assert isinstance(runner, TPModelRunner)
        runner.attach_ranks(processes, conns, group, store)
        _wait_for(processes, conns, "ready")
        if runner.step_buffers is not None:  # the Triton backend: its kernels compile now, on every rank
            runner.warm_up_prefill()
        logger.info("tensor parallel: %d ranks (rank 0: pid %d; others: %s), %s", size, os.getpid(),
                    ", ".join(str(p.pid) for p in processes),
                    "nccl" if not cpu else "gloo" if collective_path is None else "shared memory (gloo for large)")
    except BaseException:
        for process in processes:
            process.kill()
            process.wait()
        raise
    finally:
        for path in (pool_path, collective_path):
            if path is not None:
                os.unlink(path)  # NOTE: every rank has mapped it (or failed): the mappings live on
    return runner


def _new_shared_file(kind: str) -> str:
    """An empty file in shared memory that every rank maps (the KV pool, the collectives' slots;
    pages commit on write)."""
    directory = "/dev/shm" if os.path.isdir("/dev/shm") else None
    fd, path = tempfile.mkstemp(prefix=f"pdserve-{kind}-", dir=directory)
    os.close(fd)
    return path


def spawn_module(module: str) -> tuple[subprocess.Popen[bytes], socket.socket]:
    """`python -m module FD`: a fresh interpreter (no fork of a threaded process, no re-import of the
    caller's script) holding the other end FD of a socket pair: the link is private to the two
    processes, and each sees EOF when the other dies. (TP ranks; the engine core process.)"""
    ours, theirs = socket.socketpair()
    # NOTE: the child imports the very pdserve this process runs, wherever it was imported from
    package_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    with theirs:
        process = subprocess.Popen([sys.executable, "-m", module, str(theirs.fileno())],
                                   pass_fds=(theirs.fileno(),), env=env)
    return process, ours


def _spawn_rank() -> tuple[subprocess.Popen[bytes], Connection]:
    process, ours = spawn_module("pdserve.engine.tp_rank")
    return process, Connection(ours.detach())


def _wait_for(processes: list[subprocess.Popen[bytes]], conns: list[Connection], expected: str) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    for rank, (process, conn) in enumerate(zip(processes, conns, strict=True), start=1):
        if not conn.poll(max(0.0, deadline - time.monotonic())):
            raise RankDiedError(f"tensor-parallel rank {rank} did not start (exit code: {process.poll()})")
        try:
            message = conn.recv()
        except EOFError as exc:
            raise RankDiedError(f"tensor-parallel rank {rank} exited while starting ({process.wait()})") from exc
        if message != expected:
            raise RankDiedError(f"tensor-parallel rank {rank} failed to start: {message}")
