"""Builders for the KV transport tests: seeded pools, and a prefill-side sender living in another
process (spawned) that the test drives over a pipe, so transfers really cross processes."""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
from dataclasses import dataclass, replace
from typing import Any

import torch

from pdserve.disagg.handoff import HandOffDone
from pdserve.disagg.kv_layout import KVLayout, KVLayoutMismatch
from pdserve.disagg.transport import KVSender, KVTransferError, KVTransferTimeout, make_sender
from pdserve.model.kv_scales import KVScales, is_fp8


def record(first_token_id: int, generator_state: bytes | None = None, **fields: Any) -> bytes:
    """The encoded hand-off record a test's `send_done` carries (disagg/handoff.py)."""
    return HandOffDone(first_token_id, generator_state, **fields).encode()


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """A small pool: kv_cache[layer, k|v, block, slot, head, dim]."""

    model_id: str = "test-model"
    dtype: str = "float32"
    num_layers: int = 3
    num_blocks: int = 24
    block_size: int = 4
    num_kv_heads: int = 2
    head_dim: int = 8

    def with_(self, **changes: Any) -> PoolSpec:
        return replace(self, **changes)

    def pool(self, seed: int) -> torch.Tensor:
        shape = (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(shape, generator=gen).to(getattr(torch, self.dtype))

    def layout(self, pool: torch.Tensor, scales: KVScales | None = None) -> KVLayout:
        """`scales`: an FP8 pool's (default 1.0)."""
        if scales is None and is_fp8(pool.dtype):
            scales = KVScales.ones(self.num_layers)
        return KVLayout.from_pool(self.model_id, pool, scales=scales)


_ERRORS: dict[str, type[Exception]] = {
    "KVTransferTimeout": KVTransferTimeout,
    "KVTransferError": KVTransferError,
    "ValueError": ValueError,
    "ConnectionError": ConnectionError,
}


def _reraise(name: str, message: str, field: str) -> None:
    if name == "KVLayoutMismatch":
        raise KVLayoutMismatch(field, "", "", message)
    raise _ERRORS.get(name, RuntimeError)(message)


def _serve(conn: multiprocessing.connection.Connection, transport: str) -> None:
    """Child process: one command per message, ('ok', value) or ('err', type, message, field) back."""
    import asyncio

    torch.set_num_threads(1)
    senders: dict[str, tuple[KVSender, torch.Tensor]] = {}
    while True:
        command, key, args = conn.recv()
        if command == "stop":
            for sender, _ in senders.values():
                sender.close()
            conn.send(("ok", None))
            return
        try:
            if command == "sender":
                spec, seed = args
                pool = spec.pool(seed)
                senders[key] = (make_sender(transport, spec.layout(pool), pool), pool)
                result: Any = None
            elif command == "flush":
                result = asyncio.run(senders[key][0].flush(*args))
            else:
                result = getattr(senders[key][0], command)(*args)
            conn.send(("ok", result))
        except Exception as e:
            conn.send(("err", type(e).__name__, str(e), getattr(e, "field", "")))


class RemotePrefill:
    """Senders in a spawned process: `call("tcp-1", "send_layer", rid, layer, src, dst)`."""

    def __init__(self, transport: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_serve, args=(child, transport), daemon=True)
        self._process.start()

    def new_sender(self, key: str, spec: PoolSpec, seed: int) -> None:
        self.call(key, "sender", spec, seed)

    def call(self, key: str, command: str, *args: Any, timeout_s: float = 30.0) -> Any:
        self._conn.send((command, key, args))
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"remote prefill did not answer {command} within {timeout_s} s")
        reply = self._conn.recv()
        if reply[0] == "err":
            _reraise(*reply[1:])
        return reply[1]

    def stop(self) -> None:
        try:
            self.call("", "stop", timeout_s=10.0)
        finally:
            self._process.join(10.0)
            if self._process.is_alive():
                self._process.kill()
