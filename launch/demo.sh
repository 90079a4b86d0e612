#!/usr/bin/env bash
# README command 1: set up .venv/ if needed, then run the demo: 2 Horovod
# processes train a CNN on the real handwritten digits that scikit-learn ships,
# in the mixed-precision policy kmp picks for this machine, and report what
# they measured. Extra arguments go to launch/demo.py (see --help).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/launch/setup.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/python" "$ROOT/launch/demo.py" "$@"
