"""Scaling a learning rate by the number of ranks (``scale_lr=True``), written once.

With N ranks the global batch is N times larger, and Horovod's recipe (Goyal
et al., 2017) multiplies the learning rate by N. Every path that offers
``scale_lr`` (``kmp.wrap_optimizer``, ``kmp.compat.keras2``, ``kmp.compat.v1``)
calls :func:`scaled_learning_rate`, so a number, a tensor, a callable and a
schedule are treated the same way everywhere:

* a number or a variable: the number times N;
* a graph tensor: the tensor times N;
* a zero-argument callable: a callable returning its value times N;
* a schedule: wrapped, ``schedule(step) * N`` (:class:`ScaledLearningRate` for
  Keras 3), where the path can carry a wrapped schedule; elsewhere a clear error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import numpy as np
from keras import ops

from kmp import _checks

__all__ = ["ScaledLearningRate", "rescale_learning_rate", "scaled_learning_rate"]


@keras.saving.register_keras_serializable(package="kmp")
class ScaledLearningRate(keras.optimizers.schedules.LearningRateSchedule):
    """A learning-rate schedule multiplied by a constant (``scale_lr`` on a schedule).

    Args:
        schedule: The wrapped schedule.
        factor: The multiplier, e.g. the number of ranks.
    """

    def __init__(self, schedule: keras.optimizers.schedules.LearningRateSchedule, factor: float):
        self.schedule = schedule
        self.factor = float(factor)

    def __call__(self, step: Any) -> Any:
        """Return the scaled learning rate at ``step``."""
        return ops.multiply(self.schedule(step), self.factor)

    def get_config(self) -> dict:
        """Return the serializable config."""
        return {
            "schedule": keras.saving.serialize_keras_object(self.schedule),
            "factor": self.factor,
        }

    @classmethod
    def from_config(cls, config: dict) -> ScaledLearningRate:
        """Rebuild from :meth:`get_config` output."""
        config = dict(config)
        config["schedule"] = keras.saving.deserialize_keras_object(config["schedule"])
        return cls(**config)


def scaled_learning_rate(
    lr: Any,
    factor: float,
    *,
    schedule_type: type | tuple[type, ...] | None = None,
    wrap_schedule: Callable[[Any, float], Any] | None = None,
) -> Any:
    """Return the learning rate ``lr`` multiplied by ``factor``, in the form ``lr`` came in.

    Args:
        lr: The optimizer's learning rate: a number, a variable, a tensor, a
            zero-argument callable, or a schedule.
        factor: The multiplier (the number of ranks).
        schedule_type: The schedule base class(es) of the caller's Keras; an ``lr``
            of that type is a schedule.
        wrap_schedule: Builds the scaled schedule from ``(schedule, factor)``;
            None where the caller's path cannot carry one.

    Returns:
        The scaled learning rate, to assign back to the optimizer.

    Raises:
        ValueError: ``lr`` is a schedule and the path cannot wrap it.
    """
    factor = _checks.check_number("factor", factor, above=0)
    if schedule_type is not None and isinstance(lr, schedule_type):
        if wrap_schedule is None:
            raise ValueError(
                f"scale_lr=True cannot scale the learning-rate schedule {type(lr).__name__} on "
                "this path; pass scale_lr=False and build the schedule with its learning rate "
                "multiplied by kmp.distributed.size()."
            )
        return wrap_schedule(lr, factor)
    if _checks.is_real(lr):
        return float(lr) * factor
    if callable(lr) and not isinstance(lr, keras.Variable):

        def scaled() -> Any:
            return lr() * factor

        return scaled
    try:
        return float(np.asarray(lr)) * factor  # a variable or an eager tensor
    except (TypeError, ValueError, NotImplementedError):
        return lr * factor  # a graph tensor


def rescale_learning_rate(optimizer: Any, old_factor: float, new_factor: float) -> None:
    """Change a rate scaled by ``old_factor`` to one scaled by ``new_factor``, in place.

    For an elastic job whose rank count changed: a rate that ``scale_lr``
    multiplied by the old count is moved to the new count. A variable rate is
    assigned ``rate / old * new``; a schedule gets the factor ``new / old``
    (a :class:`ScaledLearningRate` has its factor changed, another schedule is
    wrapped in one); re-trace the train function for a schedule's new factor to
    take effect.

    Args:
        optimizer: The Keras 3 optimizer whose ``learning_rate`` was scaled (the
            inner one of a loss-scale wrapper).
        old_factor: The factor the rate carries now.
        new_factor: The factor it should carry.

    Raises:
        ValueError: The rate is a callable, which keeps its factor inside it.
    """
    old_factor = _checks.check_number("old_factor", old_factor, above=0)
    new_factor = _checks.check_number("new_factor", new_factor, above=0)
    lr = optimizer._learning_rate
    if isinstance(lr, ScaledLearningRate):
        lr.factor = lr.factor / old_factor * new_factor
    elif isinstance(lr, keras.optimizers.schedules.LearningRateSchedule):
        optimizer.learning_rate = ScaledLearningRate(lr, new_factor / old_factor)
    elif isinstance(lr, keras.Variable):
        lr.assign(float(np.asarray(lr.value)) / old_factor * new_factor)
    else:
        raise ValueError(
            f"Cannot re-scale a learning rate of type {type(lr).__name__} to {new_factor:g} "
            "ranks: pass a number or a keras.optimizers.schedules.LearningRateSchedule as the "
            "learning rate."
        )
