#!/usr/bin/env bash
# README command (1): install everything, then train the default job. Extra arguments are
# Hydra overrides for m2flow-train, e.g. `bash scripts/train.sh env.num_envs=8`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1
exec .venv/bin/m2flow-train "$@"
