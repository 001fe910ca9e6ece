"""Qwen3 dense model: config parsing, weights loading, and the math."""
