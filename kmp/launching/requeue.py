"""Requeue a SLURM batch job whose ranks stopped on a signal after their checkpoint.

A rank that a scheduler's signal stopped (``kmp.callbacks.Preempted``) exits with
:data:`kmp._names.PREEMPTED_EXIT_CODE` (75) once its checkpoint is on disk. Inside a
SLURM batch job, ``kmp launch`` then puts the job back in the queue itself
(``scontrol requeue``), up to ``--max-requeues`` times, and the requeued run resumes
from the checkpoint: a job whose work is longer than its time limit finishes across
its requeues (``#SBATCH --signal=USR1@90`` asks for the signal before the limit).

Only a time limit's warning is answered with a requeue. ``scancel``, a time limit
reached without a warning and SLURM's own preemption send SIGTERM to the batch
shell, which is ``kmp launch`` itself, as well as to the ranks: the ranks still
checkpoint and exit 75, but the job is ending (or SLURM requeues it itself), so a
launcher that received SIGTERM or SIGINT never requeues. The warning reaches the
ranks (``--signal=USR1@T``) or the batch shell (``--signal=B:USR1@T``, which
``kmp launch`` passes on), never as SIGTERM.

:func:`plan_requeue` decides (pure); :func:`requeue` runs ``scontrol``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

from kmp._names import PREEMPTED_EXIT_CODE, PREEMPTED_MARKER_ENV
from kmp.launching.hosts import LaunchError

__all__ = [
    "DEFAULT_MAX_REQUEUES",
    "ENDING_SIGNALS",
    "WARNED_EXIT_CODE",
    "RequeuePlan",
    "after_job",
    "check_requeue_args",
    "job_status",
    "configure_requeue",
    "plan_requeue",
    "preemption_marker",
    "requeue",
]

# How many times kmp launch requeues one job by default: SLURM's own bound on a batch
# job's requeues (slurm.conf MaxBatchRequeue, default 5). SLURM counts them in
# SLURM_RESTART_COUNT, failed nodes' requeues included.
DEFAULT_MAX_REQUEUES = 5
# Signals that mean "this job is ending" when kmp launch itself receives them.
ENDING_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# srun's status when the ranks died of the warning itself (128 + the signal): it came
# before they caught signals (SLURM's timer may send it up to a minute early, during the
# ranks' start-up), so nothing since the last checkpoint is lost either: requeued too.
WARNED_EXIT_CODE = 128 + signal.SIGUSR1


@dataclasses.dataclass(frozen=True)
class RequeuePlan:
    """What to do after a job ended: requeue ``job_id`` (or not, and why).

    Attributes:
        job_id: The SLURM job to requeue; None: nothing to do.
        note: One line for the log: what is done, or why not.
    """

    job_id: str | None
    note: str


def plan_requeue(
    code: int,
    environ: Mapping[str, str],
    max_requeues: int,
    received: Iterable[int] = (),
) -> RequeuePlan | None:
    """Decide whether a job that ended with ``code`` is requeued.

    Args:
        code: The job's exit status.
        environ: ``kmp launch``'s environment (``SLURM_JOB_ID``,
            ``SLURM_RESTART_COUNT``).
        max_requeues: The most requeues of one job (0: never).
        received: The signals ``kmp launch`` itself received while the job ran: one
            of :data:`ENDING_SIGNALS` (scancel, the time limit reached) means the job
            is ending and is not requeued.

    Returns:
        None when the job was not preempted (a status other than 75, or
        :data:`WARNED_EXIT_CODE`) or runs outside SLURM; otherwise the plan, with
        a note.
    """
    if code not in (PREEMPTED_EXIT_CODE, WARNED_EXIT_CODE):
        return None
    job = environ.get("SLURM_JOB_ID")
    if not job:
        return None
    try:
        done = int(environ.get("SLURM_RESTART_COUNT") or 0)
    except ValueError:
        done = 0
    ending = [signal.Signals(s).name for s in received if s in ENDING_SIGNALS]
    if ending:
        return RequeuePlan(
            None,
            f"preempted; kmp launch itself got {ending[0]} (scancel, or the time limit "
            f"reached): job {job} is ending and is not requeued (resume it with sbatch, "
            "from its checkpoint)",
        )
    if max_requeues <= 0:
        return RequeuePlan(None, f"preempted; not requeuing job {job} (--max-requeues 0)")
    if done >= max_requeues:
        return RequeuePlan(
            None,
            f"preempted; job {job} ran {done + 1} times, --max-requeues {max_requeues} "
            "reached: not requeued (resume it with sbatch, from its checkpoint)",
        )
    how = (
        "preempted after a checkpoint"
        if code == PREEMPTED_EXIT_CODE
        else "the ranks died of SIGUSR1, a time limit's warning that came before they caught "
        "signals (during start-up): the last checkpoint stands"
    )
    return RequeuePlan(
        job, f"{how}; requeuing job {job} (requeue {done + 1} of at most {max_requeues})"
    )


def requeue(plan: RequeuePlan) -> bool:
    """Run ``scontrol requeue`` for ``plan.job_id``; return whether SLURM accepted it."""
    if plan.job_id is None:
        return False
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        print("kmp launch: scontrol is not on PATH: the job is not requeued", flush=True)
        return False
    done = subprocess.run(
        [scontrol, "requeue", plan.job_id], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        print(
            f"kmp launch: scontrol requeue {plan.job_id} failed: "
            f"{(done.stderr or done.stdout).strip()} (submit the job with --requeue, or "
            "resume it with sbatch)",
            flush=True,
        )
        return False
    return True


def configure_requeue(parser: argparse.ArgumentParser) -> None:
    """Add ``--max-requeues`` to ``kmp launch``'s parser."""
    parser.add_argument(
        "--max-requeues",
        type=int,
        default=DEFAULT_MAX_REQUEUES,
        metavar="N",
        help="inside a SLURM batch job, requeue a job whose ranks stopped on a time limit's "
        "warning (--signal) after their checkpoint (exit status 75) at most N times "
        f"(default {DEFAULT_MAX_REQUEUES}, SLURM's MaxBatchRequeue; 0: never). A job "
        "cancelled with SIGTERM (scancel) is never requeued",
    )


def check_requeue_args(args: argparse.Namespace) -> None:
    """Raise LaunchError for a negative ``--max-requeues``."""
    if args.max_requeues < 0:
        raise LaunchError(f"--max-requeues {args.max_requeues}: give 0 (never) or more.")


@contextlib.contextmanager
def preemption_marker() -> Iterator[Path]:
    """Name a file for the chief's preemption note (``$KMP_PREEMPTED_MARKER``) while a job runs.

    The ranks inherit the variable; the chief writes the file after its checkpoint
    (:func:`kmp.callbacks.preemption.mark_preempted`). Removed afterwards.
    """
    folder = Path(tempfile.mkdtemp(prefix="kmp-launch-"))
    previous = os.environ.get(PREEMPTED_MARKER_ENV)
    os.environ[PREEMPTED_MARKER_ENV] = str(folder / "preempted")
    try:
        yield folder / "preempted"
    finally:
        if previous is None:
            os.environ.pop(PREEMPTED_MARKER_ENV, None)
        else:
            os.environ[PREEMPTED_MARKER_ENV] = previous
        shutil.rmtree(folder, ignore_errors=True)


def job_status(code: int, marker: Path | None) -> int:
    """The job's status: 75 when the chief wrote its preemption note and ``code`` is a failure.

    ``srun --kill-on-bad-exit`` (and Horovod's launcher) stop the other ranks as soon as
    the first leaves with 75; one still exiting is then counted as killed (137, 143).
    A 0 stays 0: ranks that caught ``Preempted`` and ended cleanly chose to.
    """
    if code not in (0, PREEMPTED_EXIT_CODE) and marker is not None and marker.exists():
        print(
            f"kmp launch: the ranks stopped after a preemption checkpoint "
            f"({marker.read_text().strip() or 'written'}); status {PREEMPTED_EXIT_CODE} "
            f"(the launcher reported {code}: it stopped the last ranks as the first left)",
            file=sys.stderr,
            flush=True,
        )
        return PREEMPTED_EXIT_CODE
    return code


def after_job(
    code: int, args: argparse.Namespace, received: Iterable[int] = (), marker: Path | None = None
) -> int:
    """Requeue the job when :func:`plan_requeue` says so; return its status (:func:`job_status`)."""
    code = job_status(code, marker)
    plan = plan_requeue(code, os.environ, args.max_requeues, received)
    if plan is not None:
        print(f"kmp launch: {plan.note}", file=sys.stderr, flush=True)
        if plan.job_id is not None:
            requeue(plan)
    return code
