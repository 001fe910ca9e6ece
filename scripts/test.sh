#!/usr/bin/env bash
# The project's checks: lint, types, then the test suite. Run scripts/setup.sh (or the quickstart) first.
#   bash scripts/test.sh            everything (what CI runs)
#   bash scripts/test.sh --fast     without the tests marked `slow` (processes, clusters, > ~5 s)
# Any other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
pytest_args=()
if [ "${1:-}" = "--fast" ]; then
    shift
    pytest_args=(-m "not slow")
fi
.venv/bin/ruff check pdserve tests
.venv/bin/mypy pdserve
.venv/bin/python -m pytest -q --durations=25 "${pytest_args[@]}" "$@"
