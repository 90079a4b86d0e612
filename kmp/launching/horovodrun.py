"""``horovodrun`` without its start-up probe, where kmp's build record answers it.

Before it starts anything, Horovod's launcher asks whether Gloo (or MPI) was built
into Horovod. It asks by forking a process that imports Horovod's TensorFlow
extension, and with it TensorFlow: about 8 s of CPU and 7 s of wall per launch on
a 2-core machine (measured: ``horovodrun --gloo -np 1 /bin/true`` takes 7.5 s).
``kmp install-horovod`` verified the build and recorded what it was built with
(:func:`kmp.install.record.built_flags`); while that record describes the library
installed now, this entry point answers Horovod's two questions from it and runs
Horovod's own launcher, unchanged otherwise. Without a current record it is plain
``horovodrun``. ``kmp launch`` runs jobs through it::

    python -m kmp.launching.horovodrun -np 2 -H localhost:2 --gloo python train.py

``horovodrun --check-build`` still loads the library: it is what the flags come from.

Two more changes serve preemption (``kmp.callbacks.AtomicCheckpoint``'s signals):
SIGUSR1 (a time limit's warning, which Horovod's launcher would die of) is taken as
the SIGTERM Horovod passes on to its ranks, and the ranks get :data:`STOP_GRACE_S`
(``KMP_STOP_GRACE_S``) instead of Horovod's 5 s between that SIGTERM and a SIGKILL,
time to write their checkpoint. A job whose ranks stopped after one exits with their
status, 75 (:func:`rank_status`), not Horovod's 1.
"""

from __future__ import annotations

import os
import re
import signal
import sys
from collections.abc import Mapping, Sequence
from types import ModuleType

from kmp._imports import optional_import

__all__ = ["MODULE", "STOP_GRACE_S", "answer_probes", "main", "rank_status"]

# How kmp starts it: ``python -m`` this module.
MODULE = "kmp.launching.horovodrun"
# Horovod's probes, by the name horovod.runner.launch calls them, and the flag each reads.
_PROBES = {"gloo_built": "gloo", "mpi_built": "mpi"}
# Seconds between the SIGTERM Horovod's launcher sends its ranks and its SIGKILL.
STOP_GRACE_S = 30.0
# How Horovod's launcher reports the first rank that failed (horovod/runner/gloo_run.py).
_FIRST_FAILURE = re.compile(r"exited with non-zero status.*?Exit code: (-?\d+)", re.S)


def rank_status(message: str) -> int | None:
    """The exit status of the first failed rank, read from Horovod's launcher's error."""
    m = _FIRST_FAILURE.search(message)
    return None if m is None else int(m.group(1))


def _stop_grace() -> float:
    raw = os.environ.get("KMP_STOP_GRACE_S", "")
    try:
        return float(raw) if raw else STOP_GRACE_S
    except ValueError:
        print(f"kmp launch: KMP_STOP_GRACE_S={raw!r} is not a number; using {STOP_GRACE_S} s")
        return STOP_GRACE_S


def answer_probes(launch: ModuleType, built: Mapping[str, bool]) -> None:
    """Make ``launch`` (``horovod.runner.launch``) read ``built`` instead of probing."""
    for name, flag in _PROBES.items():
        value = bool(built[flag])
        setattr(launch, name, lambda verbose=False, _value=value: _value)


def main(argv: Sequence[str] | None = None) -> int:
    """Run Horovod's launcher on ``argv`` (``sys.argv[1:]`` when None)."""
    # Imported here: kmp.launching.job reads MODULE, and `kmp launch` should not pay for
    # the install package's imports (half of job's import time) to build a command.
    from kmp.install import record

    launch = optional_import("horovod.runner.launch", feature="kmp launch on several processes")
    built = record.built_flags()
    if built is not None:
        answer_probes(launch, built)
    safe_shell_exec = optional_import(
        "horovod.runner.common.util.safe_shell_exec", feature="kmp launch on several processes"
    )
    safe_shell_exec.GRACEFUL_TERMINATION_TIME_S = _stop_grace()
    signal.signal(signal.SIGUSR1, lambda signum, frame: os.kill(os.getpid(), signal.SIGTERM))
    sys.argv = ["horovodrun", *(sys.argv[1:] if argv is None else argv)]
    try:
        launch.run_commandline()
    except RuntimeError as exc:
        code = rank_status(str(exc))
        if code is None or code <= 0:
            raise
        print(f"horovodrun: {exc}".rstrip(), file=sys.stderr)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
