#!/usr/bin/env bash
# Sets everything up from scratch and runs the lint and the whole test suite (CI runs exactly this).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/ruff check src tests benchmarks
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 "$@"
