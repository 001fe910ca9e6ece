"""Serving: the OpenAI-compatible HTTP API in front of anything that runs requests (an `EngineClient`:
a local engine, or disagg/'s router), with its metrics and live page. The PD router's and workers'
records and their series live in disagg/, plugged in through `app.AppExtras`, the dashboard's `Pool`
and `metrics.install_engine_metrics(extra=...)`."""
