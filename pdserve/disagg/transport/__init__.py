"""KV transports chosen by name: `make_receiver("tcp", layout, pool)`, `make_sender("nixl", layout, pool)`.

Implementations are imported on first use, so `nixl` costs nothing (and needs no NIXL install)
unless it is chosen.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import torch

from pdserve.disagg.kv_layout import KVLayout, KVLayoutMismatch
from pdserve.disagg.transport.base import KVReceiver
from pdserve.disagg.transport.errors import KVTransferError, KVTransferTimeout
from pdserve.disagg.transport.messages import KVDone, KVEvent, KVProgress, KVRejected
from pdserve.disagg.transport.sender_base import KVSender

# name -> (module, receiver class, sender class)
_TRANSPORTS: dict[str, tuple[str, str, str]] = {
    "tcp": ("pdserve.disagg.transport.tcp", "TcpKVReceiver", "TcpKVSender"),
    "nixl": ("pdserve.disagg.transport.nixl", "NixlKVReceiver", "NixlKVSender"),
    "fake": ("pdserve.disagg.transport.fake", "FakeKVReceiver", "FakeKVSender"),
}
TRANSPORT_NAMES = tuple(_TRANSPORTS)


def make_receiver(name: str, layout: KVLayout, kv_cache: torch.Tensor, **options: Any) -> KVReceiver:
    """Options: tcp/nixl take `host`, `port` (0: any free port) and `peers` (KVPeerPolicy: the
    cluster secret, connection cap, handshake timeout)."""
    return _load(name, 1)(layout, kv_cache, **options)


def make_sender(name: str, layout: KVLayout, kv_cache: torch.Tensor, **options: Any) -> KVSender:
    """Options: `secret` (the cluster secret, for the handshake); fake takes `stall_after_layers`."""
    return _load(name, 2)(layout, kv_cache, **options)


def nixl_available() -> bool:
    return importlib.util.find_spec("nixl_cu12") is not None


def _load(name: str, index: int) -> Any:
    if name not in _TRANSPORTS:
        raise ValueError(f"unknown KV transport {name!r}; choose one of {', '.join(TRANSPORT_NAMES)}")
    spec = _TRANSPORTS[name]
    return getattr(importlib.import_module(spec[0]), spec[index])


__all__ = [
    "TRANSPORT_NAMES",
    "KVDone",
    "KVEvent",
    "KVLayout",
    "KVLayoutMismatch",
    "KVProgress",
    "KVReceiver",
    "KVRejected",
    "KVSender",
    "KVTransferError",
    "KVTransferTimeout",
    "make_receiver",
    "make_sender",
    "nixl_available",
]
