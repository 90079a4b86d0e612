"""What the launcher (``horovodrun``, ``mpirun``, ``srun``) announced in the environment.

The one place in kmp that reads launcher variables. A launcher tells each
process the size of the job and its rank on the host before any collective
library starts, so these reads work before ``hvd.init()`` and never start
anything themselves. A variable that is set to something other than a number
of the right kind raises :class:`ValueError` naming the variable, whichever
kind it is.

This module imports nothing from kmp.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = [
    "LAUNCH_SIZE_VARS",
    "LOCAL_RANK_VARS",
    "launched_elastic",
    "launched_world_size",
    "launcher_local_rank",
]

# Environment variables through which launchers announce the world size, in the
# order they are checked: horovodrun (Gloo), Open MPI, MPICH / Intel MPI, MVAPICH.
LAUNCH_SIZE_VARS: tuple[str, ...] = (
    "HOROVOD_SIZE",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_SIZE",
    "MV2_COMM_WORLD_SIZE",
)

# Environment variables through which launchers announce the local rank, in the
# order they are checked: horovodrun, Open MPI, MPICH / Intel MPI, MVAPICH, SLURM srun.
LOCAL_RANK_VARS: tuple[str, ...] = (
    "HOROVOD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "MPI_LOCALRANKID",
    "MV2_COMM_WORLD_LOCAL_RANK",
    "SLURM_LOCALID",
)


def _first_int(
    environ: Mapping[str, str] | None,
    names: tuple[str, ...],
    *,
    minimum: int,
    meaning: str,
    hint: str,
) -> int | None:
    """Return the first of ``names`` that is set (and not empty), as an int, or None.

    Args:
        environ: Environment to read (None: ``os.environ``).
        names: Variables to try, in order.
        minimum: The smallest value that makes sense.
        meaning: What the value is, for the message (e.g. "a world size").
        hint: What to do about a bad value, for the message.

    Raises:
        ValueError: The first variable set is not an integer >= ``minimum``.
    """
    env = os.environ if environ is None else environ
    for var in names:
        value = env.get(var)
        if value is None or value == "":
            continue
        try:
            number = int(value)
        except ValueError:
            number = None
        if number is None or number < minimum:
            kind = {0: "a non-negative integer", 1: "a positive integer"}.get(
                minimum, f"an integer >= {minimum}"
            )
            raise ValueError(
                f"The launcher variable {var}={value!r} is not {meaning} ({kind}); {hint}"
            )
        return number
    return None


def launched_world_size(environ: Mapping[str, str] | None = None) -> int | None:
    """Return the world size a launcher announced in the environment, or None.

    Args:
        environ: Environment to read (default ``os.environ``).

    Returns:
        The number of processes ``horovodrun`` / ``mpirun`` started, or None when
        the process was not started by such a launcher (no variable of
        :data:`LAUNCH_SIZE_VARS` set).

    Raises:
        ValueError: The first variable set is not a positive integer; the message
            names it.
    """
    return _first_int(
        environ,
        LAUNCH_SIZE_VARS,
        minimum=1,
        meaning="a world size",
        hint="unset it, or start the job with horovodrun or mpirun, which set it.",
    )


def launched_elastic(environ: Mapping[str, str] | None = None) -> bool:
    """Return True when ``horovodrun --min-np/--max-np`` started this process (elastic).

    An elastic job's world can shrink to one process and grow again, so Horovod
    must run even when the announced size is 1. ``horovodrun`` marks elastic
    workers with ``HOROVOD_ELASTIC=1``.

    Args:
        environ: Environment to read (default ``os.environ``).
    """
    env = os.environ if environ is None else environ
    return env.get("HOROVOD_ELASTIC", "") == "1"


def launcher_local_rank(environ: Mapping[str, str] | None = None) -> int | None:
    """Return the local rank a launcher announced in the environment, or None.

    ``horovodrun`` sets ``HOROVOD_LOCAL_RANK``, ``mpirun`` (Open MPI)
    ``OMPI_COMM_WORLD_LOCAL_RANK``, MPICH ``MPI_LOCALRANKID`` and ``srun``
    ``SLURM_LOCALID``; the first one set wins.

    Args:
        environ: Environment to read (default ``os.environ``).

    Returns:
        The rank of this process among the processes on its host, or None when
        no variable of :data:`LOCAL_RANK_VARS` is set.

    Raises:
        ValueError: The first variable set is not a non-negative integer; the
            message names it.
    """
    return _first_int(
        environ,
        LOCAL_RANK_VARS,
        minimum=0,
        meaning="a local rank",
        hint=(
            "unset it, or start the job with horovodrun or mpirun, which set it (to choose a "
            "GPU yourself, pass kmp.configure_gpus(visible=) an explicit GPU index)."
        ),
    )
