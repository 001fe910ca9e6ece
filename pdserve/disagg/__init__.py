"""Disaggregation: prefill and decode roles, KV hand-off between them."""
