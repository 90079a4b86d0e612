#!/usr/bin/env bash
# README command 2: set up .venv/ if needed, then run the whole test suite.
#   bash launch/test.sh              # everything (what CI runs), in two phases (below)
#   bash launch/test.sh -k policy    # extra arguments go to pytest, as one serial run
#
# The whole suite runs in two phases:
#   1. every test but the multi-host ones, on KMP_TEST_WORKERS pytest-xdist workers (default
#      2; 0 runs them in this process). `--dist loadscope` keeps each test module on one
#      worker, so a module's fixtures (a 2-rank job, a built model) run once;
#   2. the multi-host tests (marker `cluster`) alone, serially: they bring up one cluster of
#      network namespaces at a time. They use 0.8 of a core on average, but run beside
#      phase 1 (one clean-clone run) they made it 10 minutes longer, 35 min instead of 25:
#      their ranks and phase 1's run in lockstep, each waiting for its slowest on crowded
#      cores.
# The run fails if either phase fails.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/launch/setup.sh"
cd "$ROOT"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
PY="$ROOT/.venv/bin/python"
if [ "$#" -gt 0 ]; then
  exec "$PY" -m pytest "$@"
fi
WORKERS="${KMP_TEST_WORKERS:-2}"
case "$WORKERS" in
  '' | *[!0-9]*)
    echo "launch/test.sh: KMP_TEST_WORKERS=$WORKERS is not a number of workers (0 or more)" >&2
    exit 2
    ;;
esac
status=0
status2=0
echo "[test] phase 1 of 2: all but the multi-host tests, $WORKERS workers"
"$PY" -m pytest -n "$WORKERS" --dist loadscope --no-loadscope-reorder -m "not cluster" || status=$?
echo "[test] phase 2 of 2: the multi-host tests (marker cluster), serially"
"$PY" -m pytest -m cluster || status2=$?
echo "[test] phase 1: exit status $status; phase 2: exit status $status2"
if [ "$status" -ne 0 ]; then exit "$status"; fi
exit "$status2"
