#!/usr/bin/env bash
# README command 2: set up .venv/ if needed, then run the whole test suite.
#   bash launch/test.sh              # everything (what CI runs), in two parts at once (below)
#   bash launch/test.sh -k policy    # extra arguments go to pytest, as one serial run
#
# The whole suite runs as two pytest sessions side by side:
#   1. every test but the multi-host ones, on KMP_TEST_WORKERS pytest-xdist workers (default
#      2; 0 runs them in one process). `--dist loadscope` keeps each test module on one
#      worker, so a module's fixtures (a 2-rank job, a built model) run once;
#   2. the multi-host tests (marker `cluster`), serially in a session of their own: they
#      bring up one cluster of network namespaces at a time. They spend most of their time
#      waiting (0.8 of a core on average, measured), so they run beside part 1, not after
#      it; their output goes to a file and is printed when both have ended.
# Each test process computes with one TensorFlow thread (TF_NUM_INTRAOP_THREADS=1 unless
# set): the workers already fill the cores, and more threads only contend for them.
# The run fails if either session fails.
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
export TF_NUM_INTRAOP_THREADS="${TF_NUM_INTRAOP_THREADS:-1}"
CLUSTER_LOG="$(mktemp "${TMPDIR:-/tmp}/kmp-cluster-tests.XXXXXX")"
echo "[test] the multi-host tests (marker cluster), serially, beside the rest: $CLUSTER_LOG"
set -m  # its own process group, where SIGINT is not ignored: an interrupt reaches it
"$PY" -m pytest -m cluster >"$CLUSTER_LOG" 2>&1 &
CLUSTER_PID=$!
set +m
stop_cluster_tests() {
  # SIGINT: pytest stops and its fixtures take the cluster down.
  kill -INT -- "-$CLUSTER_PID" 2>/dev/null || true
  wait "$CLUSTER_PID" 2>/dev/null || true
}
trap 'stop_cluster_tests; exit 130' INT TERM
echo "[test] every other test, $WORKERS workers"
status=0
status2=0
"$PY" -m pytest -n "$WORKERS" --dist loadscope --no-loadscope-reorder -m "not cluster" || status=$?
wait "$CLUSTER_PID" || status2=$?
trap - INT TERM
echo "[test] the multi-host tests ($CLUSTER_LOG):"
cat "$CLUSTER_LOG"
rm -f "$CLUSTER_LOG"
echo "[test] every other test: exit status $status; the multi-host tests: exit status $status2"
if [ "$status" -ne 0 ]; then exit "$status"; fi
exit "$status2"
