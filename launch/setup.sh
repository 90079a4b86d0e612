#!/usr/bin/env bash
# Create or update the project environment in .venv/ (idempotent).
#
#   bash launch/setup.sh            # set up if needed; seconds when already done
#   KMP_SETUP_FORCE=1 bash launch/setup.sh   # reinstall everything
#
# Steps:
#   0. As root on Debian/Ubuntu (CI): the system packages the multi-host tests and MPI
#      need, if any is missing: openssh-server/-client, iproute2, iputils-ping (for
#      `kmp cluster`), openmpi-bin and libopenmpi-dev (Horovod's MPI controller).
#      KMP_SYSTEM_PACKAGES=0 skips this step; without root it is skipped with a note.
#   1. .venv/ with Python 3.11 (python3.11, else python3 if it is 3.11).
#   2. The pinned packages of requirements.txt, then kmp itself (editable).
#   3. Horovod 0.28.1 compiled from its source distribution against the
#      TensorFlow in .venv/, with TensorFlow ops and Gloo (and MPI when
#      OpenMPI's mpicxx is on PATH). horovod/tensorflow/xla_mpi_ops.cc is left
#      out of the build: it does not compile against TensorFlow >= 2.19 and only
#      provides Horovod's XLA (jit_compile) op registrations.
# A stamp file records what was installed; a second run with nothing changed
# only checks that horovod.tensorflow still loads.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
HOROVOD_VERSION=0.28.1
STAMP="$VENV/.kmp-setup-stamp"
log() { printf '[setup] %s\n' "$*" >&2; }
# pip, without the notes about local index folders that some machines configure.
pip_q() {
  local rc=0
  "$PY" -m pip "$@" 2> >(grep -v "^WARNING: Location 'file:" >&2) || rc=$?
  return $rc
}

find_python() {
  for cand in "${KMP_PYTHON:-}" python3.11 python3; do
    [ -n "$cand" ] || continue
    if command -v "$cand" >/dev/null 2>&1 &&
       "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
      command -v "$cand"; return 0
    fi
  done
  log "Python 3.11 is required (set KMP_PYTHON=/path/to/python3.11)."; return 1
}

want_stamp() {
  # Everything that decides what is installed.
  cat "$ROOT/requirements.txt" "$ROOT/pyproject.toml" "${BASH_SOURCE[0]}" | sha256sum | cut -c1-16
  command -v mpicxx >/dev/null 2>&1 && echo mpi || echo nompi
}

horovod_ok() {
  local want_mpi=0
  command -v mpicxx >/dev/null 2>&1 && want_mpi=1
  KMP_WANT_MPI=$want_mpi "$PY" - <<'PY' 2>/dev/null
import os
import horovod, horovod.tensorflow as hvd
from horovod.tensorflow import mpi_ops  # loads the compiled TF ops
assert horovod.__version__ == "0.28.1", horovod.__version__
assert hvd.gloo_built()
# Built with MPI exactly when OpenMPI is installed (a later install triggers a rebuild).
assert hvd.mpi_built() == (os.environ["KMP_WANT_MPI"] == "1")
PY
}

system_packages() {
  # The tools `kmp cluster` and Horovod's MPI controller need; installed only when missing.
  local missing=()
  [ -x /usr/sbin/sshd ] || missing+=(openssh-server)
  command -v ssh >/dev/null 2>&1 || missing+=(openssh-client)
  command -v ip >/dev/null 2>&1 || missing+=(iproute2)
  command -v ping >/dev/null 2>&1 || missing+=(iputils-ping)
  command -v mpirun >/dev/null 2>&1 || missing+=(openmpi-bin)
  command -v mpicxx >/dev/null 2>&1 || missing+=(libopenmpi-dev)
  [ "${#missing[@]}" -eq 0 ] && return 0
  if [ "${KMP_SYSTEM_PACKAGES:-1}" = 0 ]; then
    log "KMP_SYSTEM_PACKAGES=0: not installing ${missing[*]} (multi-host and MPI tests will skip)"
    return 0
  fi
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    log "not root with apt-get: skipping system packages ${missing[*]}" \
        "(multi-host and MPI tests will skip; install them to run those)"
    return 0
  fi
  local t0=$SECONDS
  log "installing system packages: ${missing[*]}"
  # Optional packages: a failed install is reported and the tests that need them skip.
  if DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null &&
     DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
       "${missing[@]}" >/dev/null; then
    log "system packages installed in $((SECONDS - t0)) s"
  else
    log "could not install ${missing[*]} (apt-get failed): multi-host and MPI tests will skip"
  fi
}

system_packages

if [ ! -x "$PY" ]; then
  PYTHON="$(find_python)"
  log "creating $VENV with $PYTHON"
  "$PYTHON" -m venv "$VENV"
fi

if [ "${KMP_SETUP_FORCE:-0}" = 1 ] || [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$(want_stamp)" ]; then
  t0=$SECONDS
  log "installing pinned packages (requirements.txt)"
  pip_q install -q --disable-pip-version-check --upgrade pip==25.0.1
  pip_q install -q --disable-pip-version-check -r "$ROOT/requirements.txt"
  # tf-keras (Keras 2, for TF_USE_LEGACY_KERAS=1) without its dependencies: they would
  # pull the full `tensorflow` wheel over tensorflow-cpu; everything it needs is there.
  pip_q install -q --disable-pip-version-check --no-deps tf-keras==2.21.0
  pip_q install -q --disable-pip-version-check --no-deps --no-build-isolation -e "$ROOT"
  log "packages installed in $((SECONDS - t0)) s"
fi

if ! horovod_ok; then
  t0=$SECONDS
  BUILD="$VENV/build"
  rm -rf "$BUILD"; mkdir -p "$BUILD"
  log "fetching the horovod==$HOROVOD_VERSION source distribution"
  pip_q download -q --disable-pip-version-check --no-binary :all: --no-deps \
    -d "$BUILD" "horovod==$HOROVOD_VERSION"
  tar -xzf "$BUILD/horovod-$HOROVOD_VERSION.tar.gz" -C "$BUILD"
  SRC="$BUILD/horovod-$HOROVOD_VERSION"
  CML="$SRC/horovod/tensorflow/CMakeLists.txt"
  # Drop the XLA op file from the TensorFlow sources (see the header above).
  sed -i 's#"\${PROJECT_SOURCE_DIR}/horovod/tensorflow/xla_mpi_ops.cc"##' "$CML"
  if grep -q 'xla_mpi_ops.cc' "$CML"; then
    log "could not remove xla_mpi_ops.cc from $CML; the Horovod sources changed?"; exit 1
  fi
  if command -v mpicxx >/dev/null 2>&1; then mpi="HOROVOD_WITH_MPI=1"; else mpi="HOROVOD_WITHOUT_MPI=1"; fi
  log "compiling Horovod (TensorFlow ops, Gloo, $mpi); this takes a few minutes"
  # The compiler's output goes to the terminal on failure.
  if ! env HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
      HOROVOD_WITH_GLOO=1 "$mpi" HOROVOD_CPU_OPERATIONS=gloo \
      MAKEFLAGS="-j$(nproc)" PATH="$VENV/bin:$PATH" \
      "$PY" -m pip install --disable-pip-version-check --no-build-isolation --no-cache-dir \
      --no-deps "$SRC" >"$BUILD/build.log" 2>&1; then
    grep -nE 'error|Error' "$BUILD/build.log" | head -40 >&2 || true
    tail -60 "$BUILD/build.log" >&2
    log "Horovod build FAILED; full log: $BUILD/build.log"; exit 1
  fi
  if ! horovod_ok; then
    "$PY" -c 'import horovod.tensorflow.mpi_ops' || true
    log "Horovod installed but horovod.tensorflow does not load"; exit 1
  fi
  log "Horovod built in $((SECONDS - t0)) s"
fi
want_stamp > "$STAMP"
log "environment ready: $VENV"
