"""What the launcher (``horovodrun``, ``mpirun``, ``srun``) announced in the environment.

The one place in kmp that reads launcher variables. A launcher tells each
process the size of the job and its rank on the host before any collective
library starts, so these reads work before ``hvd.init()`` and never start
anything themselves. A variable that is set to something other than a number
of the right kind raises :class:`ValueError` naming the variable, whichever
kind it is.

It also holds the one variable kmp itself gives every process it runs or starts
(the ``kmp`` commands, the ranks of ``kmp launch``, the demo's): TensorFlow's C++
log level, ``TF_CPP_MIN_LOG_LEVEL=1`` unless the user set it (:func:`quiet_env`),
so TensorFlow's INFO start-up notices stay out of kmp's output while its warnings
and errors still show. :func:`tf_log_level` reads the level as TensorFlow does.

This module imports only kmp._names (the engine names) from kmp.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from kmp._names import ENGINE_NAMES

__all__ = [
    "COORDINATOR_VAR",
    "ENGINE_VAR",
    "JAX_HEARTBEAT_VAR",
    "JAX_SHUTDOWN_VAR",
    "JAX_TIMEOUT_VAR",
    "JaxTimeouts",
    "LOCAL_RUN_VARS",
    "LAUNCH_RANK_VARS",
    "LAUNCH_SIZE_VARS",
    "LOCAL_RANK_VARS",
    "LOCAL_SIZE_VARS",
    "QUIET_TF_LOG_LEVEL",
    "TF_LOG_LEVEL_VAR",
    "launched_coordinator",
    "launched_elastic",
    "launched_engine",
    "launched_jax_step",
    "launched_jax_timeouts",
    "launched_local_run_size",
    "launched_rank",
    "launched_world_size",
    "launcher_cross",
    "launcher_local_rank",
    "launcher_local_size",
    "quiet_env",
    "tf_log_level",
]

# Set by `kmp launch --engine E` for every process: which engine runs the collectives, and
# (JAX) the coordinator's host:port and how long to wait for every process to join.
ENGINE_VAR = "KMP_ENGINE"
COORDINATOR_VAR = "KMP_COORDINATOR"
JAX_TIMEOUT_VAR = "KMP_JAX_TIMEOUT"
# How long JAX's distributed service waits for a process's heartbeat before it takes the
# process for dead and ends the whole job, and how long a process that finished waits at
# exit for the others (JaxTimeouts: the defaults and why).
JAX_HEARTBEAT_VAR = "KMP_JAX_HEARTBEAT_TIMEOUT"
JAX_SHUTDOWN_VAR = "KMP_JAX_SHUTDOWN_TIMEOUT"
# Which train step the JAX engine runs: kmp's (gradients reduced in one flat all-reduce,
# kmp.distributed._jax_step) or Keras's own (XLA reduces each gradient), for comparison.
JAX_STEP_VAR = "KMP_JAX_STEP"
JAX_STEPS = ("flat", "keras")
# Set by kmp's own local launcher (kmp.launching.local_run) for JAX-engine jobs:
# rank, size, local rank, local size.
LOCAL_RUN_VARS = ("KMP_RANK", "KMP_SIZE", "KMP_LOCAL_RANK", "KMP_LOCAL_SIZE")

# TensorFlow's C++ log level (0 all, 1 no INFO, 2 no WARNING, 3 no ERROR), which kmp sets for
# every process it runs or starts unless the user did: 1 drops TensorFlow's INFO start-up
# notices (oneDNN, CPU instructions, devices) and keeps its warnings and errors.
TF_LOG_LEVEL_VAR = "TF_CPP_MIN_LOG_LEVEL"
QUIET_TF_LOG_LEVEL = "1"

# Environment variables through which launchers announce the world size, in the
# order they are checked: horovodrun (Gloo), Open MPI, MPICH / Intel MPI, MVAPICH.
LAUNCH_SIZE_VARS: tuple[str, ...] = (
    "HOROVOD_SIZE",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_SIZE",
    "MV2_COMM_WORLD_SIZE",
)

# ... the global rank (the JAX engine's process id), in the same order, then kmp's own
# launchers, then SLURM srun. kmp's come before SLURM's: a process kmp starts inside a
# SLURM job inherits the job's SLURM_PROCID (0 in a batch script) and must not read it.
LAUNCH_RANK_VARS: tuple[str, ...] = (
    "HOROVOD_RANK",
    "OMPI_COMM_WORLD_RANK",
    "PMI_RANK",
    "MV2_COMM_WORLD_RANK",
    "KMP_RANK",
    "SLURM_PROCID",
)

# ... the number of processes on this host.
LOCAL_SIZE_VARS: tuple[str, ...] = (
    "HOROVOD_LOCAL_SIZE",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "MPI_LOCALNRANKS",
    "MV2_COMM_WORLD_LOCAL_SIZE",
    "KMP_LOCAL_SIZE",
    "SLURM_NTASKS_PER_NODE",
)

# ... which host this is and how many hosts there are (horovodrun).
CROSS_RANK_VARS: tuple[str, ...] = ("HOROVOD_CROSS_RANK",)
CROSS_SIZE_VARS: tuple[str, ...] = ("HOROVOD_CROSS_SIZE",)

# Environment variables through which launchers announce the local rank, in the
# order they are checked: horovodrun, Open MPI, MPICH / Intel MPI, MVAPICH, kmp's own
# launchers, SLURM srun.
LOCAL_RANK_VARS: tuple[str, ...] = (
    "HOROVOD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "MPI_LOCALRANKID",
    "MV2_COMM_WORLD_LOCAL_RANK",
    "KMP_LOCAL_RANK",
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


def launched_rank(environ: Mapping[str, str] | None = None) -> int | None:
    """Return the global rank a launcher announced (:data:`LAUNCH_RANK_VARS`), or None.

    Raises:
        ValueError: The first variable set is not a non-negative integer.
    """
    return _first_int(
        environ,
        LAUNCH_RANK_VARS,
        minimum=0,
        meaning="a rank",
        hint="unset it, or start the job with kmp launch, horovodrun or mpirun, which set it.",
    )


def launcher_local_size(environ: Mapping[str, str] | None = None) -> int | None:
    """Return the number of processes on this host a launcher announced, or None.

    Raises:
        ValueError: The first variable set is not a positive integer.
    """
    return _first_int(
        environ,
        LOCAL_SIZE_VARS,
        minimum=1,
        meaning="a local size",
        hint="unset it, or start the job with kmp launch, horovodrun or mpirun, which set it.",
    )


def launched_engine(environ: Mapping[str, str] | None = None) -> str | None:
    """Return the engine ``kmp launch --engine`` chose (``KMP_ENGINE``), or None when unset.

    Raises:
        ValueError: ``KMP_ENGINE`` is set to an unknown engine.
    """
    env = os.environ if environ is None else environ
    value = env.get(ENGINE_VAR, "").strip().lower()
    if not value:
        return None
    if value not in ENGINE_NAMES:
        raise ValueError(
            f"{ENGINE_VAR}={env[ENGINE_VAR]!r} is not an engine; use one of "
            f"{', '.join(ENGINE_NAMES)} (kmp launch --engine sets it), or unset it."
        )
    return value


def launched_coordinator(environ: Mapping[str, str] | None = None) -> str | None:
    """Return the JAX coordinator's ``host:port`` (``KMP_COORDINATOR``), or None when unset.

    Raises:
        ValueError: It is not ``host:port`` with a port from 1 to 65535.
    """
    env = os.environ if environ is None else environ
    value = env.get(COORDINATOR_VAR, "").strip()
    if not value:
        return None
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(
            f"{COORDINATOR_VAR}={value!r} is not host:port (e.g. 10.0.0.1:29500); kmp launch "
            "--engine jax sets it to the first host and a free port."
        )
    return value


@dataclasses.dataclass(frozen=True)
class JaxTimeouts:
    """The JAX engine's timeouts, in seconds (``jax.distributed.initialize``'s).

    Attributes:
        join: How long a process waits for every process to join (``KMP_JAX_TIMEOUT``).
        heartbeat: How long JAX's distributed service waits for a process's heartbeat
            before it takes the process for dead and ends every process of the job
            (``KMP_JAX_HEARTBEAT_TIMEOUT``). JAX's own default, 100 s, ends a job whose
            process is stalled that long: starved on a loaded node, paused, swapping. kmp
            waits 600 s (PyTorch's default for an NCCL collective), more than
            SLURM's default ``SlurmdTimeout`` (300 s), so a failed node is SLURM's to find
            and requeue, as with ``--gloo-timeout`` (docs/slurm.md). A process that dies
            is noticed at once all the same: its peers' collectives fail.
        shutdown: How long a process that finished waits at exit for the others
            (``KMP_JAX_SHUTDOWN_TIMEOUT``). JAX's default, 300 s, fails a job whose
            chief still saves, evaluates or exports after the others finished; kmp
            waits 600 s.
    """

    join: int = 300
    heartbeat: int = 600
    shutdown: int = 600


def launched_jax_timeouts(environ: Mapping[str, str] | None = None) -> JaxTimeouts:
    """Return the JAX engine's timeouts: :class:`JaxTimeouts`'s defaults, or the variables'.

    Args:
        environ: Environment to read (default ``os.environ``).

    Raises:
        ValueError: A variable is set to something other than a positive integer.
    """
    defaults = JaxTimeouts()
    found = {}
    for field, var, what in (
        ("join", JAX_TIMEOUT_VAR, "to wait for every process to join"),
        ("heartbeat", JAX_HEARTBEAT_VAR, "a silent process has before the job ends"),
        ("shutdown", JAX_SHUTDOWN_VAR, "a finished process waits for the others"),
    ):
        value = _first_int(
            environ,
            (var,),
            minimum=1,
            meaning="a number of seconds",
            hint=f"unset it ({getattr(defaults, field)} s), or give the seconds {what}.",
        )
        if value is not None:
            found[field] = value
    return dataclasses.replace(defaults, **found)


def launched_jax_step(environ: Mapping[str, str] | None = None) -> str:
    """Return the JAX engine's train step (``KMP_JAX_STEP``): ``"flat"`` (default) or ``"keras"``.

    Raises:
        ValueError: It is set to another value.
    """
    value = (os.environ if environ is None else environ).get(JAX_STEP_VAR, "").strip().lower()
    if not value:
        return JAX_STEPS[0]
    if value not in JAX_STEPS:
        raise ValueError(
            f"{JAX_STEP_VAR}={value!r} is not one of {JAX_STEPS}: unset it for kmp's step "
            "(one flat all-reduce per step), or set 'keras' for Keras's own."
        )
    return value


def launcher_cross(environ: Mapping[str, str] | None = None) -> tuple[int, int] | None:
    """Return ``(cross_rank, cross_size)``, which host and how many, as horovodrun said, or None.

    Raises:
        ValueError: A variable is set to something other than a suitable integer.
    """
    hint = "unset it, or start the job with kmp launch or horovodrun, which set it."
    rank = _first_int(environ, CROSS_RANK_VARS, minimum=0, meaning="a host rank", hint=hint)
    size = _first_int(environ, CROSS_SIZE_VARS, minimum=1, meaning="a host count", hint=hint)
    return None if rank is None or size is None else (rank, size)


def launched_local_run_size(environ: Mapping[str, str] | None = None) -> int | None:
    """Return the size kmp's local launcher announced (``KMP_SIZE``), or None.

    Kept apart from :func:`launched_world_size`: that launcher starts JAX-engine
    jobs only, and Horovod must not try to start from it.

    Raises:
        ValueError: ``KMP_SIZE`` is set to something other than a positive integer.
    """
    return _first_int(
        environ,
        ("KMP_SIZE",),
        minimum=1,
        meaning="a world size",
        hint="unset it; kmp launch --engine jax sets it for the processes it starts.",
    )


def quiet_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Return the variables to add to ``environ`` so that TensorFlow starts quietly.

    ``{"TF_CPP_MIN_LOG_LEVEL": "1"}``, or nothing when ``environ`` already sets it
    (not empty): the user's level wins, ``0`` included. Set it before TensorFlow is
    imported, in this process (``os.environ.update(quiet_env())``) and in the
    environment of the processes it starts.

    Args:
        environ: Environment to read (default ``os.environ``).
    """
    env = os.environ if environ is None else environ
    return {} if env.get(TF_LOG_LEVEL_VAR, "").strip() else {TF_LOG_LEVEL_VAR: QUIET_TF_LOG_LEVEL}


def tf_log_level(environ: Mapping[str, str] | None = None) -> int:
    """Return TensorFlow's C++ minimum log level in ``environ``, read as TensorFlow reads it.

    0 (everything) when ``TF_CPP_MIN_LOG_LEVEL`` is unset or not an integer.

    Args:
        environ: Environment to read (default ``os.environ``).
    """
    env = os.environ if environ is None else environ
    try:
        return int(env.get(TF_LOG_LEVEL_VAR, "").strip())
    except ValueError:
        return 0
