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
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from types import ModuleType

from kmp._imports import optional_import

__all__ = ["MODULE", "answer_probes", "main"]

# How kmp starts it: ``python -m`` this module.
MODULE = "kmp.launching.horovodrun"
# Horovod's probes, by the name horovod.runner.launch calls them, and the flag each reads.
_PROBES = {"gloo_built": "gloo", "mpi_built": "mpi"}


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
    sys.argv = ["horovodrun", *(sys.argv[1:] if argv is None else argv)]
    launch.run_commandline()
    return 0


if __name__ == "__main__":
    sys.exit(main())
