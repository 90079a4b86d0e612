"""LossScaleMonitor: the loss scale, its growths, skipped steps and the underflow it saw."""

from __future__ import annotations

import math
import warnings
from typing import Any

import keras
import numpy as np

from kmp._checks import check_bool, check_choice, check_int
from kmp.callbacks._ranks import chief_print, is_chief, model_optimizer, to_float

__all__ = ["STUCK_ACTIONS", "LossScaleMonitor"]

# What LossScaleMonitor(on_stuck=...) does when the scale is stuck at its minimum.
STUCK_ACTIONS = ("warn", "stop")


def _reports_nothing(optimizer: Any) -> bool:
    """True for a kmp optimizer that says it can never skip a step (no scaling, no windows)."""
    return getattr(optimizer, "can_skip", True) is False


def _kmp_style(optimizer: Any) -> bool:
    """True for an optimizer exposing ``loss_scale`` and ``skipped_steps`` as kmp's does."""
    return hasattr(optimizer, "skipped_steps") and hasattr(optimizer, "loss_scale")


def _find_scaler(optimizer: Any) -> Any | None:
    """Return the optimizer that holds the loss scale: ``optimizer`` or one it wraps.

    That is a kmp-style optimizer or a ``keras.optimizers.LossScaleOptimizer``,
    found along the ``inner_optimizer`` chain; None when there is none.
    """
    seen: set[int] = set()
    opt = optimizer
    while opt is not None and id(opt) not in seen:
        seen.add(id(opt))
        if _kmp_style(opt) or isinstance(opt, keras.optimizers.LossScaleOptimizer):
            return opt
        opt = getattr(opt, "inner_optimizer", None)
    return None


def _read_loss_scale(scaler: Any | None) -> tuple[float | None, int | None]:
    """Read ``(loss_scale, skipped_steps)`` from what :func:`_find_scaler` returned.

    A kmp optimizer exposes both; a plain ``keras.optimizers.LossScaleOptimizer``
    only its ``dynamic_scale`` (skipped steps are then None, counted by the caller).
    ``(None, None)`` when nothing scales the loss.
    """
    if scaler is None or _reports_nothing(scaler):
        return None, None
    if _kmp_style(scaler):
        scale, skipped = scaler.loss_scale, scaler.skipped_steps
        if scale is None:  # a kmp optimizer with loss scaling turned off
            return None, None
        return to_float(scale), None if skipped is None else int(to_float(skipped))
    scale = getattr(scaler, "dynamic_scale", None) if scaler.built else None
    return to_float(scaler.initial_scale if scale is None else scale), None


def _growths(before: float | None, after: float, scaler: Any | None) -> int:
    """How many growths took ``before`` to ``after`` (0 when it did not rise)."""
    if before is None or not after > before:
        return 0
    rule = getattr(scaler, "loss_scale_rule", None)
    factor = float(rule.growth_factor) if rule is not None else 2.0  # Keras's own factor
    return max(1, round(math.log(after / before) / math.log(factor)))


def _min_scale(scaler: Any | None) -> float | None:
    """The floor of a dynamic kmp scale (``loss_scale_rule.min_scale``), else None."""
    rule = getattr(scaler, "loss_scale_rule", None)
    return float(rule.min_scale) if rule is not None and rule.dynamic else None


def _at_floor(scale: float | None, floor: float) -> bool:
    """``scale`` (read from a float32 variable) sits at ``floor``, compared in float32."""
    return scale is not None and np.float32(scale) <= np.float32(floor)


class LossScaleMonitor(keras.callbacks.Callback):
    """Put the loss scale and the count of skipped steps into the logs; report a stuck scale.

    After every batch and epoch, ``logs["loss_scale"]``,
    ``logs["skipped_steps"]`` (steps skipped so far because of inf/nan
    gradients) and ``logs["scale_growths"]`` (times the scale grew in this
    training) are added, so the progress bar, ``History``, ``CSVLogger`` and
    ``TensorBoard`` show them; with kmp's underflow-aware rule (the default for
    float16), ``logs["underflow_share"]`` too: the share of the last step's
    gradient values that float16 held only as subnormals, the reading that grows
    the scale early. When the count of skipped steps rises, the chief prints
    ``overflow: step skipped, loss scale lowered to X``; with ``verbose=2`` it
    also prints each growth.

    A scale that sits at its ``min_scale`` while steps keep overflowing is
    *stuck*: every step is skipped and the model no longer trains. After
    ``patience`` such steps in a row the monitor warns (``on_stuck="warn"``,
    a ``RuntimeWarning``) or stops training with that message
    (``on_stuck="stop"``; every rank sees the same averaged gradients, so every
    rank stops at the same step). The message says what to do: lower the
    learning rate, check the data for NaN or inf, keep the layer that overflows
    in float32. Stuck detection needs a dynamic scale from ``kmp.wrap_optimizer``
    (its ``min_scale`` is the floor) and reads the scale after every batch.

    The scale is read from the model's optimizer: ``loss_scale`` and
    ``skipped_steps`` of a ``kmp.wrap_optimizer`` optimizer, or the
    ``dynamic_scale`` of a plain ``keras.optimizers.LossScaleOptimizer`` (whose
    skipped steps are counted here from the halvings of the scale). Without
    loss scaling nothing is logged; with ``verbose``, a note says so once, except
    for a ``kmp.wrap_optimizer`` optimizer that can never skip a step (float32
    and bfloat16 policies need no scaling, or ``loss_scale=None``), which stays silent.

    Args:
        verbose: 1 prints overflows on the chief; 0 only logs.
        batch_logs: Also put the scale into every batch's logs (default). False
            logs it at epoch end only; the scale is still read after each batch
            (one small read), for overflow messages and stuck detection.
        on_stuck: ``"warn"`` (default) or ``"stop"``.
        patience: Stuck steps in a row before the warning or the stop (default 10).

    Attributes:
        stuck_steps: Overflowing steps in a row taken at ``min_scale`` so far.
        stopped: True once the monitor stopped training.
        growths: Times the scale grew since training began (read after each batch; with
            ``steps_per_execution > 1`` growths and back-offs inside one call may
            cancel out).
    """

    def __init__(
        self,
        verbose: int = 1,
        batch_logs: bool = True,
        *,
        on_stuck: str = "warn",
        patience: int = 10,
    ):
        super().__init__()
        self.verbose = check_int("LossScaleMonitor(verbose)", verbose, minimum=0, maximum=2)
        self.batch_logs = check_bool("LossScaleMonitor(batch_logs)", batch_logs)
        self.on_stuck = check_choice("LossScaleMonitor(on_stuck)", on_stuck, STUCK_ACTIONS)
        self.patience = check_int(
            "LossScaleMonitor(patience)", patience, minimum=1, hint="e.g. 10 stuck steps."
        )
        self._reset()

    def _reset(self) -> None:
        self._last_scale: float | None = None
        self._last_skipped: int | None = None
        self._counted_skips = 0
        self._noted = False
        self._reported = False
        self.stuck_steps = 0
        self.stopped = False
        self.growths = 0

    def current(self, scaler: Any | None = None) -> tuple[float | None, int | None]:
        """Return ``(loss_scale, skipped_steps)`` now, or ``(None, None)`` without scaling."""
        if scaler is None:
            scaler = _find_scaler(self._optimizer())
        scale, skipped = _read_loss_scale(scaler)
        if scale is None:
            return None, None
        if skipped is None:  # plain Keras LossScaleOptimizer: count halvings
            if self._last_scale is not None and scale < self._last_scale:
                self._counted_skips += max(1, round(math.log2(self._last_scale / scale)))
            skipped = self._counted_skips
        return scale, skipped

    def _optimizer(self) -> keras.optimizers.Optimizer:
        return model_optimizer(self, "LossScaleMonitor")

    def _update(self, logs: dict | None, *, step: bool = False) -> None:
        scaler = _find_scaler(self._optimizer())  # one walk of the optimizer chain per read
        scale, skipped = self.current(scaler)
        if scale is None:
            if not self._noted:  # decided once: nothing to report this training
                self._noted = True
                if self.verbose and not _reports_nothing(scaler):
                    chief_print(
                        "LossScaleMonitor: the optimizer does not scale the loss (nothing to "
                        "report); use kmp.wrap_optimizer under a float16 policy to get loss "
                        "scaling."
                    )
            return
        if self._last_skipped is not None:
            new = skipped - self._last_skipped
            if new > 0 and self.verbose:
                steps = "step skipped" if new == 1 else f"{new} steps skipped"
                lowered = self._last_scale is not None and scale < self._last_scale
                now = f"lowered to {scale:g}" if lowered else f"kept at {scale:g}"
                chief_print(f"overflow: {steps}, loss scale {now}")
            if step:  # a batch ended: judge the steps it ran
                self._track_stuck(scaler, new, scale)
        grown = _growths(self._last_scale, scale, scaler)
        self.growths += grown
        printed = grown and self.verbose > 1
        # The reading costs a read of the optimizer: only when it is logged or printed.
        share = getattr(scaler, "underflow_share", None) if printed or logs is not None else None
        if printed:
            seen = "" if share is None else f" (underflow share {100 * share:.2f} %)"
            chief_print(f"loss scale raised to {scale:g}{seen}")
        self._last_scale, self._last_skipped = scale, skipped
        if logs is not None:
            logs["loss_scale"] = scale
            logs["skipped_steps"] = skipped
            logs["scale_growths"] = self.growths
            if share is not None:
                logs["underflow_share"] = share

    def _track_stuck(self, scaler: Any, new_skips: int, scale: float) -> None:
        """Count overflows taken at the floor; warn or stop after ``patience`` in a row.

        The optimizer's own ``overflow_streak`` (overflows in a row) bounds the
        count, so overflows broken up by a finite step never add up, whether a
        batch runs one step, several (``steps_per_execution``) or a micro-batch
        of an accumulation window.
        """
        floor = _min_scale(scaler)
        if floor is None:
            return
        at_floor = _at_floor(self._last_scale, floor) and _at_floor(scale, floor)
        # The streak costs a read of the optimizer: only while a stuck run can be going on.
        streak = (
            getattr(scaler, "overflow_streak", 0)
            if at_floor and (new_skips > 0 or self.stuck_steps > 0)
            else 0
        )
        if not streak:
            self.stuck_steps = 0
            self._reported = False
            return
        self.stuck_steps = min(self.stuck_steps + max(new_skips, 0), int(streak))
        if self.stuck_steps < self.patience or self._reported:
            return
        self._reported = True
        message = (
            f"The loss scale is stuck at its minimum ({floor:g}): the last "
            f"{self.stuck_steps} steps overflowed even there and were all skipped, so the "
            "model is not training. Lower the learning rate, check the data for NaN or inf, "
            "or keep the layer that overflows in float32 (dtype='float32'; kmp.audit(model) "
            "lists the risky ones)."
        )
        if self.on_stuck == "stop":
            self.model.stop_training = True
            self.stopped = True
            chief_print(f"LossScaleMonitor stopped training. {message}")
        elif is_chief():  # every rank sees the same state; one warning is enough
            warnings.warn(message, RuntimeWarning, stacklevel=2)

    def on_train_begin(self, logs: dict | None = None) -> None:
        """Read the starting scale, so the first overflow is detected."""
        self._reset()
        self._update(None)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """Add the scale and skipped steps to the batch logs; watch for a stuck scale."""
        self._update(logs if self.batch_logs else None, step=True)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        """Add the scale and skipped steps to the epoch logs."""
        self._update(logs)

    def get_config(self) -> dict[str, Any]:
        """Return the constructor arguments."""
        return {
            "verbose": self.verbose,
            "batch_logs": self.batch_logs,
            "on_stuck": self.on_stuck,
            "patience": self.patience,
        }
