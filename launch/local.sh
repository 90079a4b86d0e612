#!/usr/bin/env bash
# Train on one machine: one process per GPU (or N processes on CPU), through `kmp launch`.
#
#   bash launch/local.sh [N] [SCRIPT [ARGS...]]
#
#   N        number of processes; default: one per GPU that `nvidia-smi -L` lists, else 1
#   SCRIPT   training script; default launch/train.py
#   ARGS     passed to the script unchanged
#
# Environment:
#   KMP_POLICY         dtype policy for every rank (auto, mixed_float16, mixed_bfloat16, float32)
#   KMP_*              every KMP_ setting is forwarded to every rank
#   KMP_LAUNCH_ARGS    extra `kmp launch` options, split on spaces, e.g. "--gloo --dry-run"
#
# Examples:
#   bash launch/local.sh                                         # train.py on every GPU
#   bash launch/local.sh 2 launch/train.py --model digits_cnn --epochs 3
#   KMP_LAUNCH_ARGS=--dry-run bash launch/local.sh 4             # show the horovodrun command
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"; else PY="${PYTHON:-python3}"; fi

if [[ "${1:-}" =~ ^[0-9]+$ ]]; then
  NP="$1"; shift
elif command -v nvidia-smi >/dev/null 2>&1 && [ "$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')" -gt 0 ]; then
  NP="$(nvidia-smi -L | grep -c '^GPU')"
else
  NP=1
fi
SCRIPT="${1:-$ROOT/launch/train.py}"
[ "$#" -gt 0 ] && shift
read -r -a EXTRA <<< "${KMP_LAUNCH_ARGS:-}"

exec "$PY" -m kmp.cli launch -np "$NP" -H "localhost:$NP" "${EXTRA[@]}" "$SCRIPT" "$@"
