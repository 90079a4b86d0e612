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
#   1. .venv/ with the Python KMP_PYTHON names (any of 3.10-3.13, the range kmp/versions.py
#      holds; a .venv of another Python is rebuilt), else the pinned Python 3.11 (what CI
#      runs), else the newest supported one found (python3.X on PATH, then pyenv's builds).
#      requirements*.txt pin per Python where a pin has no wheel for it (markers).
#   2. The install plan (kmp/install/plan.py, standard library only): NVIDIA GPUs
#      (nvidia-smi) or KMP_DEVICE=cuda mean tensorflow[and-cuda]==2.21.0 and Horovod with
#      NCCL; otherwise tensorflow-cpu==2.21.0. `kmp install-horovod --dry-run` prints it.
#   3. The plan's TensorFlow and the pinned packages of requirements.txt and of
#      requirements-docs.txt (the documentation site's tools), then kmp itself (editable).
#      KerasHub (requirements-hub.txt: keras-hub without its tensorflow-text requirement)
#      unless KMP_HUB=0.
#   4. `kmp install-horovod`: Horovod 0.28.1 compiled against that TensorFlow (TensorFlow
#      ops, Gloo, MPI when OpenMPI's mpicxx is on PATH, NCCL on GPUs, the TensorFlow >= 2.19
#      source fix), verified, and its wheel cached in ~/.cache/kmp (KMP_CACHE_DIR) so that
#      another checkout on this machine installs it in seconds.
# A stamp file records what was installed (the plan included); a second run with nothing
# changed only checks that the installed Horovod still loads with the planned flags.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
STAMP="$VENV/.kmp-setup-stamp"
log() { printf '[setup] %s\n' "$*" >&2; }
# pip, without the notes about local index folders that some machines configure.
pip_q() {
  local rc=0
  "$PY" -m pip "$@" 2> >(grep -v "^WARNING: Location 'file:" >&2) || rc=$?
  return $rc
}

# Whether a Python is one kmp supports (kmp/versions.py decides; it needs only the
# standard library); prints why not.
supported() {
  PYTHONPATH="$ROOT" "$1" -W ignore -c \
    "import sys, kmp.versions as v; sys.exit(v.main(['--python']))" 2>/dev/null
}

find_python() {
  if [ -n "${KMP_PYTHON:-}" ]; then
    local want="$KMP_PYTHON" why
    if ! "$want" -c '' 2>/dev/null; then
      # A name such as python3.13 that only pyenv's shim answers: pyenv's own build of it.
      want="$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}/versions/${KMP_PYTHON#python}".*/bin/"$KMP_PYTHON" \
        2>/dev/null | sort -V | tail -1)"
      if [ -z "$want" ] || ! "$want" -c '' 2>/dev/null; then
        log "KMP_PYTHON=$KMP_PYTHON does not run: name a python3.X on PATH or its full path."
        return 1
      fi
    fi
    if ! why="$(supported "$want")"; then
      log "KMP_PYTHON=$KMP_PYTHON: ${why:-not a Python kmp supports}"; return 1
    fi
    command -v "$want"; return 0
  fi
  local cand
  for cand in python3.11 python3.13 python3.12 python3.10 python3 \
      $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[0-3].*/bin/python3.1[0-3] 2>/dev/null | sort -V -r); do
    # pyenv's shims exist for every version and fail for one that is not selected.
    if command -v "$cand" >/dev/null 2>&1 && supported "$cand" >/dev/null; then
      command -v "$cand"; return 0
    fi
  done
  log "no supported Python (3.10-3.13) found: install one, or set KMP_PYTHON=/path/to/python3.X."
  return 1
}

minor() { "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])'; }

want_stamp() {
  # Everything that decides what is installed: the files and the plan.
  cat "$ROOT/requirements.txt" "$ROOT/requirements-docs.txt" "$ROOT/requirements-hub.txt" \
    "$ROOT/requirements-serve.txt" "$ROOT/pyproject.toml" \
    "${BASH_SOURCE[0]}" "$ROOT/kmp/install/plan.py" | sha256sum | cut -c1-16
  echo "hub=${KMP_HUB:-1} serve=${KMP_SERVE:-1} python=$(minor "$PY")"
  echo "$PLAN"
}

system_packages() {
  # The tools `kmp cluster` (and its SLURM) and Horovod's MPI controller need; installed
  # only when missing.
  local missing=()
  [ -x /usr/sbin/sshd ] || missing+=(openssh-server)
  command -v ssh >/dev/null 2>&1 || missing+=(openssh-client)
  command -v ip >/dev/null 2>&1 || missing+=(iproute2)
  command -v ping >/dev/null 2>&1 || missing+=(iputils-ping)
  command -v mpirun >/dev/null 2>&1 || missing+=(openmpi-bin)
  command -v mpicxx >/dev/null 2>&1 || missing+=(libopenmpi-dev)
  # SLURM on `kmp cluster up --slurm` (the tests' real SLURM cluster), with munge.
  [ -x /usr/sbin/slurmctld ] || missing+=(slurmctld)
  [ -x /usr/sbin/slurmd ] || missing+=(slurmd)
  command -v sinfo >/dev/null 2>&1 || missing+=(slurm-client)
  [ -x /usr/sbin/munged ] || missing+=(munge)
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
  DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null || true
  # Optional packages: a failed install is reported and the tests that need them skip.
  # SLURM's go apart, so that a failure of theirs cannot take ssh or MPI with it.
  local base=() slurm=() pkg
  for pkg in "${missing[@]}"; do
    case "$pkg" in slurm*|munge) slurm+=("$pkg") ;; *) base+=("$pkg") ;; esac
  done
  local group
  for group in base slurm; do
    local -n pkgs="$group"
    [ "${#pkgs[@]}" -eq 0 ] && continue
    if DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
         "${pkgs[@]}" >/dev/null; then
      log "installed ${pkgs[*]} ($((SECONDS - t0)) s so far)"
    else
      log "could not install ${pkgs[*]} (apt-get failed): the tests that need them will skip"
    fi
  done
}

system_packages

if [ -x "$PY" ] && [ -n "${KMP_PYTHON:-}" ]; then
  PYTHON="$(find_python)"
  if [ "$(minor "$PYTHON")" != "$(minor "$PY")" ]; then
    log "KMP_PYTHON is Python $(minor "$PYTHON"), $VENV has $(minor "$PY"): rebuilding it"
    rm -rf "$VENV"
  fi
fi
if [ ! -x "$PY" ]; then
  PYTHON="$(find_python)"
  log "creating $VENV with $PYTHON (Python $(minor "$PYTHON"))"
  "$PYTHON" -m venv "$VENV"
fi

# The plan needs only the standard library: it runs before anything is installed.
PLAN="$(PYTHONPATH="$ROOT" "$PY" -m kmp.commands.install_horovod --summary)"
TF_REQ="$(printf '%s\n' $PLAN | sed -n 's/^tensorflow=//p')"
log "plan: $PLAN"

if [ "${KMP_SETUP_FORCE:-0}" = 1 ] || [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$(want_stamp)" ]; then
  t0=$SECONDS
  log "installing $TF_REQ and the pinned packages (requirements*.txt)"
  pip_q install -q --disable-pip-version-check --upgrade pip==25.0.1
  # tensorflow-cpu and tensorflow both provide the `tensorflow` package: keep only the plan's.
  other=tensorflow-cpu; case "$TF_REQ" in tensorflow-cpu*) other=tensorflow;; esac
  if "$PY" -m pip show -q "$other" >/dev/null 2>&1; then
    log "removing $other (the plan installs $TF_REQ)"
    pip_q uninstall -q -y "$other"
  fi
  pip_q install -q --disable-pip-version-check "$TF_REQ" -r "$ROOT/requirements.txt" \
    -r "$ROOT/requirements-docs.txt"
  # tf-keras (Keras 2, for TF_USE_LEGACY_KERAS=1) without its dependencies: they would
  # pull the full `tensorflow` wheel over tensorflow-cpu; everything it needs is there.
  pip_q install -q --disable-pip-version-check --no-deps tf-keras==2.21.0
  # KerasHub, the optional extra (KMP_HUB=0 leaves it out; its tests then skip): what it
  # imports, with dependencies, then keras-hub itself without them, so that its
  # tensorflow-text requirement cannot pull a second TensorFlow (requirements-hub.txt).
  if [ "${KMP_HUB:-1}" != 0 ]; then
    pip_q install -q --disable-pip-version-check -r "$ROOT/requirements-hub.txt"
    mapfile -t no_deps < <(sed -n 's/^# no-deps: //p' "$ROOT/requirements-hub.txt")
    pip_q install -q --disable-pip-version-check --no-deps "${no_deps[@]}"
  fi
  # The export converters and runtimes (requirements-serve.txt; KMP_SERVE=0 leaves them out).
  if [ "${KMP_SERVE:-1}" != 0 ]; then
    pip_q install -q --disable-pip-version-check -r "$ROOT/requirements-serve.txt"
  fi
  pip_q install -q --disable-pip-version-check --no-deps --no-build-isolation -e "$ROOT"
  log "packages installed in $((SECONDS - t0)) s"
fi

# Builds (or installs the cached wheel of) Horovod only when the installed one does not
# match the plan; its output says which.
"$VENV/bin/kmp" install-horovod
want_stamp > "$STAMP"
log "environment ready: $VENV"
