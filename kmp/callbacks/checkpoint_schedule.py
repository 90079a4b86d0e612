"""When AtomicCheckpoint writes: the best epoch's metric, every N steps, T seconds, a signal.

:func:`monitor_mode` reads which way ``save_best_only``'s metric improves;
:class:`InEpochSchedule` holds the settings of the checkpoints inside an epoch,
checked once (``from_arguments``), and decides (``due``, pure);
:class:`~kmp.callbacks.AtomicCheckpoint` acts on them.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from collections.abc import Sequence
from typing import Any

from kmp._checks import check_choice, check_int, check_number
from kmp.callbacks.checkpoint_files import step_template, template_regex
from kmp.callbacks.preemption import DEFAULT_SIGNALS, normalize_signals

__all__ = [
    "DEFAULT_AGREE_EVERY_SECONDS",
    "AgreementCadence",
    "InEpochSchedule",
    "checked_counts",
    "monitor_mode",
]

# How often the ranks agree on a caught signal, by default. One small all-reduce after every
# step cost the byte-level GPT 14 % of its 150 ms step on 2 CPU ranks (bench/checkpoints.py,
# "signals"): a second meeting point per step. Every ~2 s it is about 1 %, and a signal is
# answered within 2 s plus a step and the write.
DEFAULT_AGREE_EVERY_SECONDS = 2.0


def monitor_mode(monitor: Any, mode: Any) -> str:
    """Return ``"min"`` or ``"max"``: how ``monitor`` improves (``"auto"`` reads its name).

    Raises:
        TypeError: ``monitor`` is not a metric name.
        ValueError: ``mode`` is not ``"auto"``, ``"min"`` or ``"max"``.
    """
    if not isinstance(monitor, str):
        raise TypeError(
            f"`AtomicCheckpoint(monitor)` must be a metric name; got {monitor!r}. "
            "Pass a key of the epoch logs, e.g. 'val_loss'."
        )
    mode = check_choice(
        "AtomicCheckpoint(mode)",
        mode,
        ("auto", "min", "max"),
        hint="Use 'min' for losses, 'max' for accuracies, or 'auto' to pick by the name.",
    )
    if mode == "auto":
        name = monitor.lower()
        mode = "max" if any(k in name for k in ("acc", "auc", "precision", "recall")) else "min"
    return mode


def checked_counts(keep: Any, save_freq: Any, verbose: Any) -> tuple[int | None, int, int]:
    """Check AtomicCheckpoint's ``keep``, ``save_freq`` and ``verbose``; return them.

    Raises:
        TypeError: Not an integer.
        ValueError: Out of range (``keep`` and ``save_freq`` at least 1, ``verbose`` 0-2).
    """
    if keep is not None:
        keep = check_int(
            "AtomicCheckpoint(keep)",
            keep,
            minimum=1,
            hint="Pass how many checkpoints to keep, or None to keep all.",
        )
    save_freq = check_int(
        "AtomicCheckpoint(save_freq)",
        save_freq,
        minimum=1,
        hint="Pass a number of epochs, e.g. 1 to save after every epoch.",
    )
    verbose = check_int(
        "AtomicCheckpoint(verbose)",
        verbose,
        minimum=0,
        maximum=2,
        hint="Use 0 (silent) or 1 (print a line per checkpoint written).",
    )
    return keep, save_freq, verbose


@dataclasses.dataclass(frozen=True)
class InEpochSchedule:
    """The checkpoints written inside an epoch, and their file name.

    Attributes:
        every_steps: Save every this many training steps (None: not by steps).
        every_seconds: Save when this many seconds passed since the last save.
        signals: Names of the signals that stop training with a checkpoint.
        step_filepath: The file-name template of these checkpoints (None when
            none is written inside an epoch).
        agree_every_seconds: About how often (in training time) several ranks
            agree on a caught signal or the chief's clock (0: after every step).
    """

    every_steps: int | None = None
    every_seconds: float | None = None
    signals: tuple[str, ...] = ()
    step_filepath: str | None = None
    agree_every_seconds: float = DEFAULT_AGREE_EVERY_SECONDS

    @classmethod
    def from_arguments(
        cls,
        filepath: str,
        *,
        every_steps: Any,
        every_seconds: Any,
        signals: Sequence[str] | None,
        save_best_only: bool,
        agree_every_seconds: Any = DEFAULT_AGREE_EVERY_SECONDS,
    ) -> InEpochSchedule:
        """Check AtomicCheckpoint's in-epoch arguments (see its docstring for their meaning).

        Raises:
            TypeError: A number or a signal of the wrong type.
            ValueError: A number out of range, both a step and a time frequency, an
                unknown signal, ``save_best_only`` with a frequency, or a name that
                cannot hold a position (no ``{epoch}``, epoch logs) with a frequency.
        """
        if every_steps is not None and every_seconds is not None:
            raise ValueError(
                "AtomicCheckpoint: give save_every_steps or save_every_seconds, not both "
                f"(got {every_steps} steps and {every_seconds} s)."
            )
        if every_steps is not None:
            every_steps = check_int(
                "AtomicCheckpoint(save_every_steps)",
                every_steps,
                minimum=1,
                hint="Pass a number of training steps, e.g. 500, or None.",
            )
        if every_seconds is not None:
            every_seconds = check_number(
                "AtomicCheckpoint(save_every_seconds)",
                every_seconds,
                above=0,
                hint="Pass a number of seconds, e.g. 600, or None.",
            )
        agree_every_seconds = check_number(
            "AtomicCheckpoint(agree_every_seconds)",
            agree_every_seconds,
            at_least=0,
            hint="Pass a number of seconds, e.g. 2.0 (0: the ranks agree after every step).",
        )
        asked = signals is not DEFAULT_SIGNALS
        names = normalize_signals(signals, name="AtomicCheckpoint(signals)")
        by_frequency = every_steps is not None or every_seconds is not None
        if by_frequency and save_best_only:
            raise ValueError(
                "AtomicCheckpoint: save_best_only compares epoch metrics, which a checkpoint "
                "inside an epoch does not have; drop save_every_steps/save_every_seconds, or "
                "save_best_only."
            )
        step_filepath = None
        if by_frequency or names:
            try:
                template_regex(os.path.basename(filepath))  # a position needs an {epoch}
                step_filepath = step_template(filepath)
            except ValueError:
                if by_frequency:
                    raise
                if asked:  # asked for, and impossible with this name
                    warnings.warn(
                        f"AtomicCheckpoint({filepath!r}): a checkpoint written on a signal "
                        "needs a name with {epoch} and no epoch logs, so signals are not "
                        "caught; use such a name (or a folder), or pass signals=().",
                        UserWarning,
                        stacklevel=3,
                    )
                names = ()
        return cls(every_steps, every_seconds, names, step_filepath, float(agree_every_seconds))

    @property
    def needs_agreement(self) -> bool:
        """Whether several ranks must agree inside an epoch (a signal, or the chief's clock)."""
        return bool(self.signals) or self.every_seconds is not None

    def due(self, steps: int, seconds: float) -> bool:
        """Whether a checkpoint is due after ``steps`` training steps of this fit.

        ``seconds`` is the time since the last checkpoint (the ranks then agree, at
        an :class:`AgreementCadence` meeting).
        """
        if self.every_steps is not None:
            return steps % self.every_steps == 0
        return self.every_seconds is not None and seconds >= self.every_seconds


class AgreementCadence:
    """After which steps the ranks agree (a signal caught, the chief's clock), and act on it.

    At the first step, then about every ``seconds`` of training: each rank proposes a
    number of steps from its own step time, the agreement's maximum is taken by every
    rank, so all of them meet at the same step. A rank never acts alone on a signal
    between two meetings (it would leave its peers waiting in a collective).

    Args:
        seconds: The time between meetings (0: after every step).
    """

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.next_step = 1
        self._since: tuple[int, float] | None = None  # (steps, time) at the last meeting

    def due(self, steps: int) -> bool:
        """Whether the ranks meet after ``steps`` training steps of this fit."""
        return steps >= self.next_step

    def proposal(self, steps: int, now: float) -> float:
        """This rank's number of steps to the next meeting, from its step time since the last."""
        if self.seconds <= 0 or self._since is None or steps <= self._since[0]:
            return 1.0
        step_s = max((now - self._since[1]) / (steps - self._since[0]), 1e-6)
        return float(min(10_000, max(1, math.ceil(self.seconds / step_s))))

    def agreed(self, steps: int, every: float, now: float) -> None:
        """Take the agreed number of steps to the next meeting."""
        self.next_step = steps + max(1, int(every))
        self._since = (steps, now)
