#!/usr/bin/env bash
# Set everything up, then serve the embedded default model on http://127.0.0.1:8000.
# Extra arguments go to `pdserve serve` (e.g. --model /path/to/Qwen3-0.6B --port 9000).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/pdserve serve "$@"
