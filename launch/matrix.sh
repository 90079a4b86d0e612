#!/usr/bin/env bash
# The version matrix: the core test suite in an environment other than the pinned one.
#
#   bash launch/matrix.sh oldest            # build (once) and test requirements-oldest.txt
#   bash launch/matrix.sh newest -x         # extra arguments go to pytest
#   KMP_MATRIX_BUILD_ONLY=1 bash launch/matrix.sh newest   # build it, print its path
#   bash launch/matrix.sh oldest tests/test_saving.py -x   # test paths replace the suite
#   KMP_MATRIX_SUITE=JAX_RERUN bash launch/matrix.sh newest  # another list of tests/suites.py
#
# requirements-NAME.txt names its Python on a line `# python: 3.X` and pins the rest. The
# environment is a venv in $KMP_CACHE_DIR/envs/ (default ~/.cache/kmp), named after the file's
# hash: built once per machine, like Horovod's wheel, and reused by every checkout (kmp is
# not installed into it: the tests import this checkout's). A Python that is not on this
# machine (python3.X on PATH, else pyenv's versions folder) is a skip with a note, not a
# failure. The suite: tests/suites.py's CORE_TESTS, in-process only (no multi-process
# jobs, no CLI), on the TensorFlow backend (KERAS_BACKEND=jax in the environment: on JAX).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
log() { printf '[matrix] %s\n' "$*" >&2; }
NAME="${1:?usage: launch/matrix.sh oldest|newest [pytest arguments]}"
shift
REQ="$ROOT/requirements-$NAME.txt"
[ -f "$REQ" ] || { log "no $REQ: name one of: $(cd "$ROOT" && ls requirements-*.txt | sed -n 's/^requirements-\(oldest\|newest\)\.txt$/\1/p' | tr '\n' ' ')"; exit 2; }
VER="$(sed -n 's/^# python: *\([0-9.]*\).*/\1/p' "$REQ" | head -1)"
[ -n "$VER" ] || { log "$REQ has no '# python: 3.X' line"; exit 2; }

find_python() {
  # python$VER that really runs (pyenv's shims exist for every version but fail for one
  # that is not selected), else the newest of pyenv's installed $VER.* builds.
  local cand
  for cand in "python$VER" $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}/versions/$VER".*/bin/python"$VER" 2>/dev/null | sort -V -r); do
    if "$cand" -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$VER'.split('.'))))" >/dev/null 2>&1; then
      command -v "$cand"; return 0
    fi
  done
  return 1
}

CACHE="${KMP_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kmp}"
HASH="$(cat "$REQ" | sha256sum | cut -c1-12)"
ENV="$CACHE/envs/$NAME-py$VER-$HASH"
if [ ! -f "$ENV/.kmp-matrix-ready" ]; then
  if ! PYTHON="$(find_python)"; then
    log "SKIPPED $NAME: no Python $VER on this machine (python$VER, or pyenv install $VER)"
    exit 0
  fi
  t0=$SECONDS
  log "building $ENV with $PYTHON from $(basename "$REQ")"
  rm -rf "$ENV" "$CACHE/envs/$NAME-py"*  # an unfinished build, or an older file's
  mkdir -p "$CACHE/envs"
  "$PYTHON" -m venv "$ENV"
  "$ENV/bin/python" -m pip install -q --disable-pip-version-check -r "$REQ" \
    2> >(grep -v "^WARNING: Location 'file:" >&2)
  touch "$ENV/.kmp-matrix-ready"
  log "built in $((SECONDS - t0)) s"
fi
# Build only: print where the environment is (nothing when it was skipped).
if [ "${KMP_MATRIX_BUILD_ONLY:-0}" = 1 ]; then echo "$ENV"; exit 0; fi

cd "$ROOT"
# Test paths among the arguments replace the suite (bash launch/matrix.sh oldest tests/x.py -x).
TESTS=()
if ! printf '%s\n' "$@" | grep -q '^tests/'; then
  SUITE="${KMP_MATRIX_SUITE:-CORE_TESTS}"
  mapfile -t TESTS < <("$ENV/bin/python" -c "from tests.suites import $SUITE as s; print(*s, sep='\n')")
fi
log "$NAME: $("$ENV/bin/python" -c 'import sys, keras, tensorflow as tf; import jax; print(f"Python {sys.version.split()[0]}, Keras {keras.__version__}, TensorFlow {tf.__version__}, JAX {jax.__version__}")' 2>/dev/null)"
# This checkout's kmp, in the test process and in any process it starts.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
exec "$ENV/bin/python" -m pytest -p no:cacheprovider ${TESTS[@]+"${TESTS[@]}"} \
  -m "not distributed" -k "not cli" "$@"
