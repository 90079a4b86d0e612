#!/usr/bin/env bash
# Train on several machines listed in a hostfile, through `kmp launch` (horovodrun over ssh).
#
#   bash launch/hostfile.sh HOSTFILE [SCRIPT [ARGS...]]
#
#   HOSTFILE  one host per line: `node1 slots=4` (or `node1:4`, or `node1` for one slot);
#             blank lines and `# comments` are ignored. A malformed line is reported by number.
#   SCRIPT    training script; default launch/train.py
#   ARGS      passed to the script unchanged
#
# One process runs per slot (set KMP_NP to run fewer). Every host needs passwordless ssh
# from this one, and this checkout with its .venv/ at the same path (a shared file system,
# or the same set-up on each machine). Before the job starts, kmp launch checks that every
# host answers over ssh and has the interface given with --network-interface.
#
# Environment:
#   KMP_NP             number of processes; default: all slots in HOSTFILE
#   KMP_POLICY, KMP_*  forwarded to every rank on every host
#   KMP_LAUNCH_ARGS    extra `kmp launch` options, e.g. "--mpi" or "-p 2222 --network-interfaces eth0"
#
# Example:
#   printf 'node1 slots=4\nnode2 slots=4\n' > hosts.txt
#   KMP_LAUNCH_ARGS="--network-interface eth0" \
#     bash launch/hostfile.sh hosts.txt launch/train.py --model resnet50 --batch-size 64
#
# Tried on one machine first (root; see launch/README.md, "kmp cluster"):
#   kmp cluster up --hosts 2 --slots 2
#   printf 'h1 slots=2\nh2 slots=2\n' > hosts.txt
#   kmp cluster exec h1 -- env KMP_LAUNCH_ARGS="--network-interface eth0" \
#     bash launch/hostfile.sh hosts.txt launch/train.py --epochs 2
#   kmp cluster down
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"; else PY="${PYTHON:-python3}"; fi

if [ "$#" -lt 1 ]; then
  echo "usage: bash launch/hostfile.sh HOSTFILE [SCRIPT [ARGS...]]" >&2
  exit 2
fi
HOSTFILE="$1"; shift
SCRIPT="${1:-$ROOT/launch/train.py}"
[ "$#" -gt 0 ] && shift
NP_ARGS=()
[ -n "${KMP_NP:-}" ] && NP_ARGS=(-np "$KMP_NP")
read -r -a EXTRA <<< "${KMP_LAUNCH_ARGS:-}"

exec "$PY" -m kmp.cli launch "${NP_ARGS[@]}" --hostfile "$HOSTFILE" "${EXTRA[@]}" "$SCRIPT" "$@"
