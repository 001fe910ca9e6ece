"""Prefill/decode disaggregation: the KV layout handshake and the KV transports between workers."""
