"""The NIXL pieces both sides of the nixl transport share (see nixl.py): the agent, how its
notifications are polled and read, where a payload's regions are in a pool, and registrations whose
metadata a peer gets (decode's grants: grants.py, staging.py)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pdserve.disagg import wire
from pdserve.disagg.kv_layout import KVLayout
from pdserve.disagg.transport import regions
from pdserve.disagg.transport.messages import Message, decode_message, encode_message, message_type

logger = logging.getLogger(__name__)

# Polling: NIXL's Python API offers no file descriptor to wait on, so the I/O thread polls. Right
# after any progress (a notification heard, a claim or grant opened or closed) it polls every
# ~50 us: a blocking nap, because asyncio rounds any timer below 1 ms up to 1 ms and a pure spin
# starves the peer process when both share a core. While nothing moves (a grant open while prefill
# computes its next layer, a claim not yet answered), the nap doubles after each empty poll, up to
# 1 ms. Every poll takes the GIL from the engine thread. With nothing open but something expected
# (decode: a reservation waits for KV; prefill: an acknowledgement is due) and nothing moved for
# `_ACTIVE_WINDOW_S`, it polls every millisecond, so a new claim waits at most ~1 ms to be noticed.
# With nothing expected at all, it polls every `_QUIET_POLL_S` (housekeeping, UCX's own traffic),
# or at once when woken (`Poller.wake`: a claim to send, a reservation opened). Polled every
# millisecond instead, a prefill worker's I/O thread slowed a tiny model's prefill step by ~15 %.
_ACTIVE_WINDOW_S = 0.005
_ACTIVE_NAP_S = 0.00005
_MAX_ACTIVE_NAP_S = 0.001
_IDLE_POLL_S = 0.001
_QUIET_POLL_S = 0.02
_WARM_UP_S = 1.0  # after the poller starts (a new connection's UCX wire-up), never quiet


def new_agent(role: str) -> Any:
    from nixl_cu12._api import nixl_agent, nixl_agent_config

    name = f"pdserve-{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False,
                                              backends=["UCX"]))


def conn_info_metadata(agent: Any) -> bytes:
    """Our agent's connection info without any memory registration (decode only replies to us)."""
    # the compiled _bindings module has no stubs, so mypy cannot see it
    from nixl_cu12 import _bindings  # type: ignore[attr-defined]

    return agent.get_partial_agent_metadata(_bindings.nixlRegDList(_bindings.DRAM_SEG), inc_conn_info=True)


def memory_kind(kv_cache: torch.Tensor) -> tuple[str, int]:
    """NIXL memory type and device id of the pool."""
    if kv_cache.device.type == "cpu":
        return "DRAM", 0
    return "VRAM", kv_cache.device.index or 0


def region_addrs(kv_cache: torch.Tensor, layout: KVLayout, layer: int, block_ids: tuple[int, ...]) -> np.ndarray:
    """Addresses of kv_cache[layer, 0, b] for b in block_ids, then of kv_cache[layer, 1, b]."""
    return kv_cache.data_ptr() + regions.payload_offsets(layout, kv_cache.shape[2], layer, block_ids)


@dataclass(frozen=True, slots=True)
class Registration:
    """Byte ranges registered with an agent: `descs` is what `deregister_memory` takes back,
    `metadata` the agent's partial metadata for exactly them (their remote keys, no connection
    info): what a peer loads (`add_remote_agent`) to WRITE into them, and nothing else."""

    descs: Any
    metadata: bytes
    num_bytes: int
    device_id: int  # what a WRITE's remote descriptors must name (see `register`)


_generations = itertools.count(1)


def register(agent: Any, starts: np.ndarray, lengths: np.ndarray, kind: tuple[str, int]) -> Registration:
    """Register the ranges `starts[i]` .. `starts[i] + lengths[i]` (absolute addresses) of memory
    of `kind` (`memory_kind`) as one registration.

    NOTE: a peer keeps every registration it loaded (NIXL cannot unload part of a remote agent),
    and NIXL finds the registration covering a WRITE's remote range by its start address alone: a
    revoked registration starting inside a live one (same memory, an earlier reservation) hides the
    live one and the WRITE fails (NIXL_ERR_NOT_FOUND). Host memory ignores the device id, and NIXL
    matches it too, so each host-memory registration gets a device id of its own (a generation):
    old registrations never match a new grant's WRITE. GPU memory needs its real device id: not
    isolated so (nixl.py, Trust)."""
    mem_type, device_id = kind
    if mem_type == "DRAM":
        device_id = next(_generations)
    rows = np.empty((len(starts), 3), dtype=np.uint64)
    rows[:, 0] = starts
    rows[:, 1] = lengths
    rows[:, 2] = device_id
    descs = agent.register_memory(rows, mem_type)
    try:
        metadata = agent.get_partial_agent_metadata(descs, inc_conn_info=False)
    except BaseException:
        agent.deregister_memory(descs)
        raise
    return Registration(descs, metadata, int(np.sum(lengths)), device_id)


class Poller:
    """Decides how long the I/O thread pauses between two polls (see _ACTIVE_WINDOW_S). Made and
    used on the I/O thread."""

    def __init__(self) -> None:
        self._last_activity = time.monotonic() - _ACTIVE_WINDOW_S
        self._quiet_after = time.monotonic() + _WARM_UP_S
        self._nap_s = _ACTIVE_NAP_S
        self._state: object = None
        self._woken = asyncio.Event()

    def wake(self) -> None:
        """Something is about to be expected: end a quiet pause now. I/O thread only."""
        self._woken.set()

    async def pause(self, heard: int, busy: bool, state: object = None, expecting: bool = True) -> None:
        """`heard`: notifications this poll; `busy`: work is open (claims, grants, writes);
        `state`: a snapshot of that work (a change counts as progress); `expecting`: something
        may arrive without being asked for now."""
        now = time.monotonic()
        if heard or state != self._state:
            self._state = state
            self._last_activity = now
            self._nap_s = _ACTIVE_NAP_S
        else:
            self._nap_s = min(2 * self._nap_s, _MAX_ACTIVE_NAP_S)
        if busy or now - self._last_activity < _ACTIVE_WINDOW_S:
            time.sleep(self._nap_s)  # NOTE: blocks this loop for <= 1 ms; it only serves NIXL here
            await asyncio.sleep(0)
        elif expecting or now < self._quiet_after:
            await asyncio.sleep(_IDLE_POLL_S)
        else:
            # NOTE: not `asyncio.wait_for`: before Python 3.12 it swallows a cancel that comes just as
            # the wait ends (woken, or timed out), and the poll loop went on: a sender's close then
            # waited forever for its cancelled poll task (`IoThread.stop`)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_QUIET_POLL_S):
                    await self._woken.wait()
            self._woken.clear()


def poll_notifs(agent: Any, handle: Callable[[str, bytes], None]) -> int:
    """Hand every new notification to `handle`; returns how many there were. NOTE: also what
    progresses UCX on this agent (no progress thread)."""
    notifs = agent.get_new_notifs()
    for peer, messages in notifs.items():
        for raw in messages:
            try:
                handle(peer, raw)
            except Exception:  # a bug must not kill the poll loop: every transfer would hang
                logger.exception("failed to handle a NIXL notification from %s", peer)
    return sum(len(messages) for messages in notifs.values())


def encode_notif(message: Message) -> bytes:
    return bytes([message_type(message)]) + encode_message(message)


def decode_notif(raw: bytes) -> Message:
    if not raw:
        raise wire.WireFormatError("empty notification")
    return decode_message(raw[0], raw[1:])


def accept_notif(peer: str, known_peer: bool, raw: bytes) -> Message | None:
    """A notification's message, or None (logged) if it comes from a stranger or does not decode."""
    if not known_peer:
        logger.warning("dropped a NIXL notification from unknown agent %s", peer)
        return None
    try:
        return decode_notif(raw)
    except wire.WireFormatError as e:
        logger.warning("dropped an undecodable NIXL notification from %s: %s", peer, e)
        return None


def agent_name(name: bytes | str) -> str:
    # NOTE: add_remote_agent returns the name as bytes, get_new_notifs keys it as str.
    return name.decode() if isinstance(name, bytes) else name
