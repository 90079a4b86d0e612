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
#   3. the version matrix (launch/matrix.sh), beside phase 2 (it waits on its network most
#      of the time): the in-process core suite (tests/suites.py's CORE_TESTS) on the
#      TensorFlow backend in the "oldest" and the "newest" environments, and its modules
#      that test_backends.py reruns on JAX (JAX_RERUN) on the JAX backend in the newest,
#      one process at a time. That JAX run replaces phase 1's (tests/test_backends.py), so
#      nothing runs twice; where Python 3.13 is missing (the newest is skipped), phase 1
#      keeps it.
#      Both environments are built once per machine and cached (~/.cache/kmp/envs).
# The run fails if any phase fails.
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
echo "[test] version matrix: the oldest and newest environments (built once, cached)"
OLDEST="$(KMP_MATRIX_BUILD_ONLY=1 bash "$ROOT/launch/matrix.sh" oldest)" || status3=$?
NEWEST="$(KMP_MATRIX_BUILD_ONLY=1 bash "$ROOT/launch/matrix.sh" newest)" || status3=$?
DESELECT=()
if [ -n "$NEWEST" ]; then
  DESELECT=(--deselect tests/test_backends.py::test_core_tests_pass_on_jax_backend)
fi
echo "[test] phase 1 of 3: all but the multi-host tests, $WORKERS workers"
"$PY" -m pytest -n "$WORKERS" --dist loadscope --no-loadscope-reorder -m "not cluster" \
  ${DESELECT[@]+"${DESELECT[@]}"} || status=$?
echo "[test] phase 2 of 3: the multi-host tests (marker cluster), serially;" \
  "phase 3 of 3 beside it: the version matrix"
matrix() {
  local rc=0
  if [ -n "$OLDEST" ]; then
    bash "$ROOT/launch/matrix.sh" oldest -q || rc=$?
  fi
  if [ -n "$NEWEST" ]; then
    bash "$ROOT/launch/matrix.sh" newest -q || rc=$?
    KMP_MATRIX_SUITE=JAX_RERUN KERAS_BACKEND=jax JAX_PLATFORMS=cpu \
      bash "$ROOT/launch/matrix.sh" newest -q -m "not distributed and not backend_agnostic" || rc=$?
  fi
  return "$rc"
}
MATRIX_LOG="$(mktemp -t kmp-matrix.XXXXXX)"
matrix > "$MATRIX_LOG" 2>&1 &
MATRIX_PID=$!
# Interrupted or failed early: stop the matrix's pytest too.
trap 'pkill -TERM -P "$MATRIX_PID" 2>/dev/null; kill "$MATRIX_PID" 2>/dev/null || true' EXIT
"$PY" -m pytest -m cluster || status2=$?
wait "$MATRIX_PID" || status3=$?
trap - EXIT
echo "[test] phase 3 (version matrix) output:"
cat "$MATRIX_LOG"
rm -f "$MATRIX_LOG"
echo "[test] phase 1: exit status $status; phase 2: exit status $status2;" \
  "phase 3: exit status $status3"
for rc in "$status" "$status2" "$status3"; do
  if [ "$rc" -ne 0 ]; then exit "$rc"; fi
done
