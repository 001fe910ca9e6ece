"""Prefill role: one connected `KVSender` per decode worker, made on first use and kept."""

from __future__ import annotations

import threading
from collections.abc import Mapping

import torch

from pdserve.disagg.kv_layout import KVLayout
from pdserve.disagg.transport import make_sender
from pdserve.disagg.transport.base import KVSender


class SenderPool:
    def __init__(self, transport: str, layout: KVLayout, kv_cache: torch.Tensor,
                 options: Mapping[str, object] | None = None) -> None:
        """`kv_cache`: this worker's pool, which the senders read; `options` go to each sender."""
        self.transport = transport
        self.layout = layout
        self.kv_cache = kv_cache
        self.options = dict(options or {})
        self._senders: dict[str, KVSender] = {}  # decode worker's KV address -> its sender
        self._lock = threading.Lock()

    def get(self, address: str) -> KVSender:
        """The connected sender for a decode worker (handshake on first use; KVLayoutMismatch on
        a layout disagreement). Blocking: call it off the event loop."""
        with self._lock:
            sender = self._senders.get(address)
            if sender is None:
                sender = make_sender(self.transport, self.layout, self.kv_cache, **self.options)
                try:
                    sender.connect(address)
                except BaseException:
                    sender.close()
                    raise
                self._senders[address] = sender
            return sender

    def close(self) -> None:
        with self._lock:
            for sender in self._senders.values():
                sender.close()
            self._senders.clear()
