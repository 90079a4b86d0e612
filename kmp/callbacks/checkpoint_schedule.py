"""When AtomicCheckpoint writes: the best epoch's metric, every N steps, T seconds, a signal.

:func:`monitor_mode` reads which way ``save_best_only``'s metric improves;
:class:`InEpochSchedule` holds the settings of the checkpoints inside an epoch,
checked once (``from_arguments``), and decides (``due``, pure);
:class:`~kmp.callbacks.AtomicCheckpoint` acts on them.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Sequence
from typing import Any

from kmp._checks import check_choice, check_int, check_number
from kmp.callbacks.checkpoint_files import step_template, template_regex
from kmp.callbacks.preemption import DEFAULT_SIGNALS, normalize_signals

__all__ = ["InEpochSchedule", "monitor_mode"]


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


@dataclasses.dataclass(frozen=True)
class InEpochSchedule:
    """The checkpoints written inside an epoch, and their file name.

    Attributes:
        every_steps: Save every this many training steps (None: not by steps).
        every_seconds: Save when this many seconds passed since the last save.
        signals: Names of the signals that stop training with a checkpoint.
        step_filepath: The file-name template of these checkpoints (None when
            none is written inside an epoch).
    """

    every_steps: int | None = None
    every_seconds: float | None = None
    signals: tuple[str, ...] = ()
    step_filepath: str | None = None

    @classmethod
    def from_arguments(
        cls,
        filepath: str,
        *,
        every_steps: Any,
        every_seconds: Any,
        signals: Sequence[str] | None,
        save_best_only: bool,
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
        return cls(every_steps, every_seconds, names, step_filepath)

    @property
    def agreed_each_step(self) -> bool:
        """Whether the ranks must agree after every step (a signal, or the chief's clock)."""
        return bool(self.signals) or self.every_seconds is not None

    def due(self, steps: int, seconds: float) -> bool:
        """Whether a checkpoint is due after ``steps`` training steps of this fit.

        ``seconds`` is the time since the last checkpoint (the ranks then agree).
        """
        if self.every_steps is not None:
            return steps % self.every_steps == 0
        return self.every_seconds is not None and seconds >= self.every_seconds
