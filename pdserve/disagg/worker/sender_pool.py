"""Prefill role: one connected `KVSender` per decode worker, made on first use and kept while its
connection lives. A sender whose connection broke (the decode worker died or restarted on the same
address) is closed and replaced by a new one, with a fresh handshake, on the next `get`: the
attempts that were in flight on it have failed already (their hand-offs are retried), later ones
reach the restarted worker. A sender unused for `idle_s` with nothing in flight is closed at the
next `get` (a decode worker that left the pool leaves no connection behind). A `worn` sender (nixl:
it holds too much of the grants' metadata) gets no new request: a new one takes its place, and it
is closed once nothing of it is pending. `connected` hands out
a live sender without blocking, so the event loop asks it first and calls `get` on a thread only
when it says None."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from pdserve.disagg.auth import ClusterSecret
from pdserve.disagg.kv_layout import KVLayout
from pdserve.disagg.transport import make_sender
from pdserve.disagg.transport.ranked import HeadRange, RankedKVSender, count_links, split_address
from pdserve.disagg.transport.sender_base import KVSender

logger = logging.getLogger(__name__)

@dataclass(frozen=True, slots=True)
class PoolSettings:
    """Tensor parallelism with a pool per rank: `sending_heads`, the heads of each rank that sends
    (default: this pool's), of the model's `num_kv_heads` (default: this pool's), say how many
    connections carry each layer (`KVSender.copies`, transport/ranked.py). `idle_s`: a sender unused
    this long is closed; `clock` measures it."""

    idle_s: float = 600.0
    clock: Callable[[], float] = time.monotonic
    sending_heads: list[HeadRange] | None = None
    num_kv_heads: int | None = None


class SenderPool:
    def __init__(self, transport: str, layout: KVLayout, kv_cache: torch.Tensor,
                 options: Mapping[str, object] | None = None, secret: ClusterSecret | None = None,
                 settings: PoolSettings | None = None) -> None:
        """`kv_cache`: this worker's pool (or this rank's), which the senders read; `options` go to
        each sender, with the cluster `secret` each handshake proves; `settings`: see `PoolSettings`."""
        settings = settings or PoolSettings()
        self.transport = transport
        self.layout = layout
        self.kv_cache = kv_cache
        self.options = {**(options or {}), "secret": secret}
        self.idle_s = settings.idle_s
        self.sending_heads = settings.sending_heads or [(layout.kv_head_start, layout.kv_head_end)]
        self.num_kv_heads = settings.num_kv_heads or layout.num_kv_heads
        self._clock = settings.clock
        self._senders: dict[str, KVSender] = {}  # decode worker's KV address -> its sender
        self._last_used: dict[str, float] = {}  # address -> when `get` last handed its sender out
        self._retiring: list[KVSender] = []  # worn, replaced: closed once nothing of theirs is pending
        self._lock = threading.Lock()

    def get(self, address: str) -> KVSender:
        """The connected sender for a decode worker (handshake on first use, and again after its
        connection broke; KVLayoutMismatch on a layout disagreement). Blocking: call it off the
        event loop."""
        with self._lock:
            self._close_idle(keep=address)
            self._last_used[address] = self._clock()
            sender = self._senders.get(address)
            if sender is not None and sender.worn and not sender.broken:
                logger.info("replacing the worn KV connection to decode at %s", address)
                self._retiring.append(self._senders.pop(address))
                sender = None
            if sender is not None and sender.broken:
                logger.info("reconnecting to decode at %s: %s", address, sender.broken)
                del self._senders[address]
                # NOTE: its attempts already failed (`broken` fails every send); an attempt still
                # releasing its blocks finds nothing reading them once close() stopped its I/O.
                sender.close()
                sender = None
            if sender is None:
                sender = self._new_sender(address)
                try:
                    sender.connect(address)
                except BaseException:
                    sender.close()
                    raise
                self._senders[address] = sender
            return sender

    def _new_sender(self, address: str) -> KVSender:
        """A sender for `address`, not connected: a receiver per decode rank takes a RankedKVSender."""
        num_receivers = len(split_address(address))
        sender: KVSender
        if num_receivers > 1:
            sender = RankedKVSender(self.transport, self.layout, self.kv_cache, self.num_kv_heads, **self.options)
        else:
            sender = make_sender(self.transport, self.layout, self.kv_cache, **self.options)
        sender.copies = count_links(self.sending_heads, num_receivers, self.num_kv_heads)
        return sender

    def connected(self, address: str) -> KVSender | None:
        """The sender for a decode worker when `get` would hand it out without blocking: connected,
        not broken, and no other sender due to be closed as idle. None otherwise (or while another
        thread holds the pool, connecting): call `get` off the event loop then."""
        # NOTE: the common case, a live connection, needs no thread hop (PrefillService.submit).
        if not self._lock.acquire(blocking=False):
            return None
        try:
            sender = self._senders.get(address)
            now = self._clock()
            if sender is None or sender.broken or sender.worn or self._idle_addresses(now, keep=address):
                return None
            self._last_used[address] = now
            return sender
        finally:
            self._lock.release()

    def _idle_addresses(self, now: float, keep: str) -> list[str]:
        """Addresses whose senders were unused for `idle_s` and have nothing in flight (lock held)."""
        return [address for address, sender in self._senders.items()
                if address != keep and now - self._last_used.get(address, now) > self.idle_s
                and not sender.pending_request_ids()]

    def _close_idle(self, keep: str) -> None:
        """Close senders unused for `idle_s` that have nothing in flight, and retired ones whose
        requests are through (lock held)."""
        for sender in [s for s in self._retiring if s.broken or not s.pending_request_ids()]:
            self._retiring.remove(sender)
            sender.close()
        for address in self._idle_addresses(self._clock(), keep):
            logger.info("closing the idle KV connection to decode at %s", address)
            sender = self._senders.pop(address)
            self._last_used.pop(address, None)
            sender.close()

    def close(self) -> None:
        with self._lock:
            for sender in [*self._senders.values(), *self._retiring]:
                sender.close()
            self._senders.clear()
            self._retiring.clear()
