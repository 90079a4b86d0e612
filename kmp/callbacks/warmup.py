"""LearningRateWarmup: a linear learning-rate ramp over the first epochs."""

from __future__ import annotations

from typing import Any

import keras

from kmp._checks import check_int, check_number
from kmp.callbacks._ranks import (
    chief_print,
    innermost_optimizer,
    model_optimizer,
    to_float,
    world_size,
)

__all__ = ["LearningRateWarmup"]


class LearningRateWarmup(keras.callbacks.Callback):
    """Raise the learning rate linearly over the first epochs, batch by batch.

    With N ranks the effective batch is N times larger and the learning rate
    usually N times larger too (``kmp.wrap_optimizer(..., scale_lr=True)``).
    Starting at that rate can diverge; Goyal et al. (2017, "Accurate, Large
    Minibatch SGD") start at the single-rank rate and raise it linearly to the
    target over the first epochs. At batch ``b`` of epoch ``e`` the rate is::

        start_lr + (target_lr - start_lr) * (e + b / steps_per_epoch) / warmup_epochs

    and ``target_lr`` from ``warmup_epochs`` on. Afterwards the callback does
    not touch the rate again, so other schedulers can take over.

    The optimizer must have a float learning rate: a
    ``keras.optimizers.schedules.LearningRateSchedule`` cannot be set from a
    callback (put the warm-up into the schedule instead, e.g.
    ``keras.optimizers.schedules.CosineDecay(..., warmup_target=..., warmup_steps=...)``).

    Args:
        warmup_epochs: Length of the warm-up in epochs (> 0; may be fractional).
        target_lr: Rate reached at the end of the warm-up. Default: the
            optimizer's rate when training starts. Pass it explicitly when
            resuming a run that stopped during the warm-up.
        start_lr: Rate of the first batch. Default: ``target_lr / size()``
            (the single-rank rate); in one process that is ``target_lr`` and
            the warm-up changes nothing unless ``start_lr`` is given.
        steps_per_epoch: Batches per epoch. Default: taken from ``fit``; needed
            when the dataset's length is unknown.
        verbose: 1 (or 2) prints the start and the end of the warm-up on the chief.

    Raises:
        TypeError: An argument has the wrong type (e.g. a rate given as a string).
        ValueError: An argument is out of range (e.g. ``warmup_epochs <= 0``).
    """

    def __init__(
        self,
        warmup_epochs: float = 5,
        *,
        target_lr: float | None = None,
        start_lr: float | None = None,
        steps_per_epoch: int | None = None,
        verbose: int = 0,
    ):
        super().__init__()
        self.warmup_epochs = check_number(
            "LearningRateWarmup(warmup_epochs)",
            warmup_epochs,
            above=0,
            hint="Pass a number of epochs, e.g. 5 (to train without warm-up, leave the "
            "callback out).",
        )
        self.target_lr = (
            None
            if target_lr is None
            else check_number(
                "LearningRateWarmup(target_lr)",
                target_lr,
                above=0,
                hint="Pass a float learning rate, e.g. 0.1, or None for the optimizer's rate.",
            )
        )
        self.start_lr = (
            None
            if start_lr is None
            else check_number(
                "LearningRateWarmup(start_lr)",
                start_lr,
                at_least=0,
                hint="Pass a float learning rate, e.g. 0.01, or None for target_lr / size().",
            )
        )
        self.steps_per_epoch = (
            None
            if steps_per_epoch is None
            else check_int(
                "LearningRateWarmup(steps_per_epoch)",
                steps_per_epoch,
                minimum=1,
                hint="Pass the batches per epoch, or None to take it from fit().",
            )
        )
        self.verbose = check_int(
            "LearningRateWarmup(verbose)",
            verbose,
            minimum=0,
            maximum=2,
            hint="Use 0 (silent) or 1 (print the start and the end of the warm-up).",
        )
        self._target: float | None = None
        self._start: float | None = None
        self._steps: int | None = None
        self._epoch = 0
        self._warming = False
        self._done = False

    def lr_at(self, epoch: int, batch: int) -> float:
        """Return the warm-up rate for batch ``batch`` of epoch ``epoch`` (both 0-based).

        Only valid once training has started (the start and target are resolved then).

        Raises:
            RuntimeError: Training has not started yet.
        """
        if self._target is None or self._start is None or self._steps is None:
            raise RuntimeError("LearningRateWarmup.lr_at() is available once training started.")
        progress = (epoch + batch / self._steps) / self.warmup_epochs
        if progress >= 1.0:
            return self._target
        return self._start + (self._target - self._start) * progress

    def on_train_begin(self, logs: dict | None = None) -> None:
        """Resolve the start and target rates and the epoch length."""
        optimizer = model_optimizer(self, "LearningRateWarmup")
        inner = innermost_optimizer(optimizer)
        raw = getattr(inner, "_learning_rate", None)
        if isinstance(raw, keras.optimizers.schedules.LearningRateSchedule) or (
            callable(raw) and not isinstance(raw, keras.Variable)
        ):
            raise TypeError(
                f"LearningRateWarmup needs a float learning rate, but the optimizer uses "
                f"{type(raw).__name__}, whose rate cannot be set from a callback. Either create "
                "the optimizer with a float learning_rate, or leave this callback out and put "
                "the warm-up into the schedule (e.g. keras.optimizers.schedules.CosineDecay("
                "..., warmup_target=..., warmup_steps=...))."
            )
        steps = self.steps_per_epoch or (self.params or {}).get("steps")
        if not steps:
            raise ValueError(
                "LearningRateWarmup does not know how many batches an epoch has (the dataset's "
                "length is unknown): pass steps_per_epoch= to LearningRateWarmup (and to fit)."
            )
        self._steps = int(steps)
        self._done = False
        if self._target is None:
            self._target = (
                self.target_lr if self.target_lr is not None else to_float(optimizer.learning_rate)
            )
            self._start = (
                self.start_lr if self.start_lr is not None else self._target / world_size()
            )
            if self.verbose:
                chief_print(
                    f"LearningRateWarmup: learning rate from {self._start:.6g} to "
                    f"{self._target:.6g} over {self.warmup_epochs:g} epochs"
                )

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        """Remember the epoch; end a warm-up that stopped short of its last batch."""
        self._epoch = epoch
        if epoch >= self.warmup_epochs and self._warming:
            self._finish(epoch)

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        """Set the rate of this batch while warming up."""
        if self._done or self._epoch >= self.warmup_epochs:
            return
        if (self._epoch + batch / self._steps) >= self.warmup_epochs:
            self._finish(self._epoch)
            return
        self._warming = True
        self.model.optimizer.learning_rate = self.lr_at(self._epoch, batch)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        """Add ``learning_rate`` to the epoch logs."""
        if logs is not None:
            logs["learning_rate"] = to_float(self.model.optimizer.learning_rate)

    def _finish(self, epoch: int) -> None:
        self.model.optimizer.learning_rate = self._target
        self._warming = False
        self._done = True
        if self.verbose:
            chief_print(
                f"Epoch {epoch + 1}: learning-rate warm-up done, learning rate {self._target:.6g}"
            )

    def get_config(self) -> dict[str, Any]:
        """Return the constructor arguments."""
        return {
            "warmup_epochs": self.warmup_epochs,
            "target_lr": self.target_lr,
            "start_lr": self.start_lr,
            "steps_per_epoch": self.steps_per_epoch,
            "verbose": self.verbose,
        }
