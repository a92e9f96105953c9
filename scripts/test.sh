#!/usr/bin/env bash
# README command (2): install everything (if not done yet), then run the test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m slow`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1
exec .venv/bin/python -m pytest "$@"
