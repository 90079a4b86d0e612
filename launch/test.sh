#!/usr/bin/env bash
# README command 2: set up .venv/ if needed, then run the whole test suite.
#   bash launch/test.sh              # everything (what CI runs), in two phases (below)
#   bash launch/test.sh -k policy    # extra arguments go to pytest, as one serial run
#
# The whole suite runs in two phases:
#   1. every test but those of phase 2, on KMP_TEST_WORKERS pytest-xdist workers (default 2;
#      0 runs them in this process). `--dist loadscope` keeps each test module on one worker,
#      so a module's fixtures (a 2-rank job, a built model) run once;
#   2. the multi-host tests (marker `cluster`) serially: they bring up one cluster of network
#      namespaces at a time. They use 0.8 of a core on average (measured), so a second
#      session runs beside them: the long single-process tests marked `beside_cluster`
#      (those BESIDE_CLUSTER lists in tests/conftest.py); its output goes to a file and is
#      printed when both have ended. Not all of phase 1 beside them: tried in one clean-clone
#      run, phase 1 then took 35 min instead of 25, its ranks and the cluster's in lockstep,
#      each waiting for its slowest on crowded cores.
# The run fails if any of the three sessions fails.
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
status3=0
echo "[test] phase 1 of 2: all but the multi-host tests and those beside them, $WORKERS workers"
"$PY" -m pytest -n "$WORKERS" --dist loadscope --no-loadscope-reorder \
  -m "not cluster and not beside_cluster" || status=$?
BESIDE_LOG="$(mktemp "${TMPDIR:-/tmp}/kmp-beside-cluster.XXXXXX")"
echo "[test] phase 2 of 2: the multi-host tests (marker cluster), serially; beside them the" \
  "tests marked beside_cluster (output: $BESIDE_LOG)"
set -m  # its own process group, where SIGINT is not ignored: an interrupt reaches it
"$PY" -m pytest -m "beside_cluster and not cluster" >"$BESIDE_LOG" 2>&1 &
BESIDE_PID=$!
set +m
stop_beside() {
  kill -INT -- "-$BESIDE_PID" 2>/dev/null || true
  wait "$BESIDE_PID" 2>/dev/null || true
}
trap 'stop_beside; exit 130' INT TERM
"$PY" -m pytest -m cluster || status2=$?
wait "$BESIDE_PID" || status3=$?
trap - INT TERM
echo "[test] phase 2, the tests beside the multi-host ones ($BESIDE_LOG):"
cat "$BESIDE_LOG"
rm -f "$BESIDE_LOG"
echo "[test] phase 1: exit status $status; phase 2: multi-host $status2, beside them $status3"
for s in "$status" "$status2" "$status3"; do
  if [ "$s" -ne 0 ]; then exit "$s"; fi
done
