"""Errors a KV transport raises to its callers."""

from __future__ import annotations


class KVTransferError(RuntimeError):
    """A transfer failed: the receiver rejected a payload, the connection broke, or the request was
    cancelled. The message says which request and why."""


class KVTransferTimeout(KVTransferError):
    """No progress on a request for the given time. The message starts with the stable text
    `KV cache transfer timed out` (operators grep logs for it). `limit_s`: the time it waited
    (the configured timeout, or longer for a peer that has been slow lately: cadence.py)."""

    def __init__(self, message: str, limit_s: float = 0.0) -> None:
        super().__init__(message)
        self.limit_s = limit_s


class KVAuthError(KVTransferError):
    """The KV handshake failed authentication: one side has no cluster secret or another one."""
