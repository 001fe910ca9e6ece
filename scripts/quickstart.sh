#!/usr/bin/env bash
# Set everything up, then start router + prefill + decode workers on http://127.0.0.1:8000.
# Extra arguments go to `pdserve up` (e.g. --model /path/to/Qwen3-0.6B --decode 2 --port 9000).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/pdserve up "$@"
