#!/usr/bin/env bash
# The project's checks: lint, types, then the test suite. Run scripts/setup.sh (or the quickstart) first.
#   bash scripts/test.sh            everything (what CI runs)
#   bash scripts/test.sh --fast     without the tests marked `slow` (processes, clusters, > ~5 s)
# Any other arguments go to pytest (one run). Without them the test files run in three pytest
# processes, in order: the in-process clusters of some tests are not all freed when they end
# (engines reachable from their workers' threads), and one process for ~1,000 tests grows past a
# 24 GiB CI machine's memory.
set -euo pipefail
cd "$(dirname "$0")/.."
pytest_args=()
if [ "${1:-}" = "--fast" ]; then
    shift
    pytest_args=(-m "not slow")
fi
.venv/bin/ruff check pdserve tests
.venv/bin/mypy pdserve
if [ "$#" -gt 0 ]; then
    exec .venv/bin/python -m pytest -q --durations=25 "${pytest_args[@]}" "$@"
fi
mapfile -t files < <(ls tests/test_*.py | sort)
parts=3
per=$(( (${#files[@]} + parts - 1) / parts ))
status=0
for ((i = 0; i < ${#files[@]}; i += per)); do
    echo "== pytest, files $((i + 1))-$((i + per < ${#files[@]} ? i + per : ${#files[@]})) of ${#files[@]}"
    .venv/bin/python -m pytest -q --durations=10 "${pytest_args[@]}" "${files[@]:i:per}" || status=$?
done
exit "$status"
