#!/usr/bin/env bash
# The project's checks: lint, then the whole test suite. Run scripts/setup.sh (or the quickstart) first.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check pdserve tests
.venv/bin/python -m pytest -q "$@"
