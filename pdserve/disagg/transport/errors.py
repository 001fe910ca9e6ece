"""Errors a KV transport raises to its callers."""

from __future__ import annotations


class KVTransferError(RuntimeError):
    """A transfer failed: the receiver rejected a payload, the connection broke, or the request was
    cancelled. The message says which request and why."""


class KVTransferTimeout(KVTransferError):
    """No progress on a request for the given time. The message starts with the stable text
    `KV cache transfer timed out` (operators grep logs for it)."""


class KVAuthError(KVTransferError):
    """The KV handshake failed authentication: one side has no cluster secret or another one."""
