#!/usr/bin/env bash
# README command 2: set up .venv/ if needed, then run the whole test suite.
#   bash launch/test.sh              # everything (what CI runs)
#   bash launch/test.sh -k policy    # extra arguments go to pytest
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/launch/setup.sh"
cd "$ROOT"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
exec "$ROOT/.venv/bin/python" -m pytest "$@"
