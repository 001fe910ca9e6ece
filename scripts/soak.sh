#!/usr/bin/env bash
# The soak (pdserve/bench/soak.py): 10 minutes of mixed load through `pdserve up --queue redis://…`
# with client cancellations, a prefill and a decode SIGKILL and a Redis restart on a schedule, then
# the checks (answers equal to colocated, no KV block held, no queue entry pending, RSS growth).
# Needs redis-server on PATH. Exit status 1 if a check fails.
#   bash scripts/soak.sh                    the full 10 minutes
#   bash scripts/soak.sh --duration 120     the short version CI runs
#   bash scripts/soak.sh --chaos            a SIGKILL every 15-30 s of a random worker's API or engine
#                                           process, 16 clients (CI: --chaos --duration 120)
# Any other arguments go to `python -m pdserve.bench.soak` (--help lists them).
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m pdserve.bench.soak "$@"
