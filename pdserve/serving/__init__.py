"""Serving: the OpenAI-compatible HTTP API in front of an engine."""
