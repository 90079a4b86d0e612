"""Preemption: catch a scheduler's signal during ``fit`` and stop every rank at one step.

A time limit (SLURM's ``--signal``, its SIGTERM at the end), a Kubernetes pod's
SIGTERM or a spot instance's notice asks a job to stop soon. During ``fit``,
:class:`SignalCatcher` turns the signals it is given into a flag (the handler only
sets it, and then calls any handler that was there before: a user's handler is
chained, not replaced). At meetings (after the first step, then about every 2 s of
training: :class:`~kmp.callbacks.checkpoint_schedule.AgreementCadence`) the ranks agree
whether any of them was signalled (:func:`agree`, one small all-reduce taking the
maximum), so all of them stop after the same step and no rank waits in a collective for
a peer that left.
:class:`~kmp.callbacks.AtomicCheckpoint` then writes one checkpoint on every rank's
behalf and raises :class:`Preempted`, a ``SystemExit`` with :data:`PREEMPTED_EXIT_CODE`:
the status that says "preempted, run me again to resume".
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kmp import distributed
from kmp._names import PREEMPTED_EXIT_CODE, PREEMPTED_MARKER_ENV

__all__ = [
    "DEFAULT_SIGNALS",
    "PREEMPTED_EXIT_CODE",
    "Preempted",
    "SignalCatcher",
    "agree",
    "inside_fit",
    "mark_preempted",
    "normalize_signals",
]

# What AtomicCheckpoint catches unless told otherwise: SLURM's and Kubernetes' stop
# signal, and the one `#SBATCH --signal=B:USR1@T` sends before a time limit.
DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")


class Preempted(SystemExit):
    """Raised out of ``fit`` after the checkpoint a signal asked for is written.

    A ``SystemExit``: a script that does not catch it exits with
    :data:`PREEMPTED_EXIT_CODE`. Attributes: ``signal`` (its name), ``path``
    (the checkpoint, on the chief; None elsewhere), ``epoch`` and ``step`` (the
    position it holds).
    """

    def __init__(self, signal_name: str, path: str | None, epoch: int, step: int):
        super().__init__(PREEMPTED_EXIT_CODE)
        self.signal = signal_name
        self.path = path
        self.epoch = epoch
        self.step = step

    def __str__(self) -> str:
        where = f" to {self.path}" if self.path else ""
        return (
            f"{self.signal}: checkpoint written{where} at epoch {self.epoch}, step "
            f"{self.step}; run the script again to resume (exit status {PREEMPTED_EXIT_CODE})"
        )


def normalize_signals(value: Any, *, name: str = "signals") -> tuple[str, ...]:
    """Check and normalise a list of signals (names such as ``"SIGTERM"`` or numbers).

    Args:
        value: A sequence of signal names or numbers; None or ``()`` for none.
        name: The argument's name, for errors.

    Returns:
        The signal names, upper-case, in order, without repeats.

    Raises:
        TypeError: ``value`` is not a sequence of names or numbers.
        ValueError: A name or number this system does not have, or SIGKILL/SIGSTOP
            (which no process can catch).
    """
    if value is None:
        return ()
    if isinstance(value, (str, int, signal.Signals)):
        value = (value,)
    if not isinstance(value, Sequence):
        raise TypeError(
            f"{name} must be a list of signal names, e.g. ('SIGTERM', 'SIGUSR1'); got {value!r}."
        )
    names: list[str] = []
    for item in value:
        if isinstance(item, bool) or not isinstance(item, (str, int)):
            raise TypeError(f"{name}: {item!r} is not a signal name or number.")
        try:
            if isinstance(item, str):
                key = item.upper()
                sig = signal.Signals[key if key.startswith("SIG") else "SIG" + key]
            else:
                sig = signal.Signals(item)
        except (KeyError, ValueError):
            raise ValueError(
                f"{name}: {item!r} is not a signal of this system; use names such as "
                "'SIGTERM', 'SIGUSR1', 'SIGINT'."
            ) from None
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(f"{name}: {sig.name} cannot be caught by any process.")
        if sig.name not in names:
            names.append(sig.name)
    return tuple(names)


class SignalCatcher:
    """While installed, the given signals set :attr:`caught` instead of ending the process.

    The same signal a second time puts the handlers back and does what it did before
    (ends the process, by default).

    Args:
        signals: Signal names (see :func:`normalize_signals`).
        active: Given the interrupted frame, whether the catcher still serves (None:
            always). A ``fit`` that raised never calls ``on_train_end``, so its
            handlers would stay; with :func:`inside_fit` a signal after it puts them
            back and does what it did without kmp, the first time.
    """

    def __init__(self, signals: Sequence[str], active: Callable[[Any], bool] | None = None):
        self.signals = tuple(signals)
        self._active = active
        self.caught: str | None = None
        self.caught_at: float | None = None  # time.monotonic() of the catch (or agreement)
        self._previous: dict[signal.Signals, Any] = {}
        self._received: dict[signal.Signals, int] = {}

    def number(self) -> int:
        """The caught signal's number (0: none), what the ranks :func:`agree` on."""
        return int(signal.Signals[self.caught]) if self.caught else 0

    def agreed(self, number: float) -> int:
        """Take the ranks' agreed signal (a number, 0 for none) as this rank's; return it."""
        number = int(number)
        if number and self.caught is None:  # a peer's signal stops this rank too
            self.caught, self.caught_at = signal.Signals(number).name, time.monotonic()
        return number

    @property
    def installed(self) -> bool:
        """Whether the handlers are in place."""
        return bool(self._previous)

    def _handle(self, signum: int, frame: Any) -> None:
        sig = signal.Signals(signum)
        if self._active is not None and not self._active(frame):  # left behind by a fit
            self.remove()  # that raised; the signal goes where it went before kmp
            signal.raise_signal(signum)
            return
        previous = self._previous.get(sig)
        self._received[sig] = self._received.get(sig, 0) + 1
        if self._received[sig] > 1:  # asked twice: no more waiting for a checkpoint
            self.remove()
            if previous in (None, signal.SIG_DFL):
                signal.raise_signal(signum)  # what it would have done without kmp
                return
        elif self.caught is None:
            self.caught, self.caught_at = sig.name, time.monotonic()
        if callable(previous) and previous is not signal.default_int_handler:
            previous(signum, frame)  # a handler someone installed before: chained
        elif previous is signal.default_int_handler and self._received[sig] > 1:
            raise KeyboardInterrupt

    def install(self) -> None:
        """Put the handlers in place (on the main thread only; elsewhere warn and do nothing)."""
        if not self.signals or self.installed:
            return
        if threading.current_thread() is not threading.main_thread():
            warnings.warn(
                "kmp: fit runs outside the main thread, where Python cannot catch signals: "
                f"{', '.join(self.signals)} will end the job without a checkpoint.",
                RuntimeWarning,
                stacklevel=3,
            )
            return
        self._received = {}
        for sig_name in self.signals:
            sig = signal.Signals[sig_name]
            previous = signal.signal(sig, self._handle)
            owner = getattr(previous, "__self__", None)
            if isinstance(owner, SignalCatcher) and owner is not self:  # left by a fit that
                previous = owner._previous.get(sig, signal.SIG_DFL)  # raised: passed over
            if previous is _exit_preempted:  # an earlier Preempted was caught: training again
                previous = signal.SIG_DFL
            self._previous[sig] = previous

    def remove(self, *, checkpointed: bool = False) -> None:
        """Put back the handlers that were there before.

        Args:
            checkpointed: The process is leaving with :data:`PREEMPTED_EXIT_CODE`,
                its checkpoint on disk. A signal whose handler was the default then
                ends it at once with that status instead of a signal's: a launcher
                that stops every rank when the first one leaves (``srun
                --kill-on-bad-exit``, Horovod's) must still read "preempted", not
                "killed by SIGTERM", from a rank that was leaving anyway (until Python
                finalizes; after that the chief's note, :func:`mark_preempted`, says it).
        """
        for sig, previous in self._previous.items():
            if previous in (None, signal.SIG_DFL):
                previous = _exit_preempted if checkpointed else signal.SIG_DFL
            signal.signal(sig, previous)
        self._previous = {}


def inside_fit(frame: Any) -> bool:
    """Whether ``frame`` runs inside a Keras ``fit`` (a signal handler's interrupted frame)."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "fit" and "keras" in code.co_filename.replace("\\", "/"):
            return True
        frame = frame.f_back
    return False


def _exit_preempted(signum: int, frame: Any) -> None:
    """A stop signal after the preemption checkpoint: exit with its status now."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()
    os._exit(PREEMPTED_EXIT_CODE)


def agree(flags: Sequence[float]) -> np.ndarray:
    """Return the element-wise maximum of ``flags`` over every rank (itself in one process).

    One all-reduce of a few numbers: every rank must call it at the same point.
    """
    local = np.asarray(flags, dtype=np.float32)
    if distributed.size() == 1:
        return local
    reduced = distributed.allreduce(local, op="max")
    return np.asarray(getattr(reduced, "numpy", lambda: reduced)(), dtype=np.float32)


def mark_preempted(path: str | None) -> None:
    """Write the preemption checkpoint's path where ``kmp launch`` looks for it (if it asked).

    ``$KMP_PREEMPTED_MARKER`` names the file; only the chief writes it, and only when its
    folder exists on this host (the launcher's). A failure to write is ignored: the exit
    status still says 75.
    """
    marker = os.environ.get(PREEMPTED_MARKER_ENV)
    if not marker or not os.path.isdir(os.path.dirname(marker) or "."):
        return
    with contextlib.suppress(OSError), open(marker, "w") as f:
        f.write(f"{path or ''}\n")
