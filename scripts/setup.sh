#!/usr/bin/env bash
# Create .venv and install pdserve with its test and docs dependencies. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# NOTE: torch first, pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e ".[test,docs]"
# NIXL (KV transfer over UCX); --no-deps so it cannot pull another torch.
.venv/bin/python -m pip install -q --no-deps nixl-cu12
