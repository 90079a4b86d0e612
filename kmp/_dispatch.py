"""The face's ``kmp.wrap_optimizer``: one entry point for Keras 3 and tf-keras optimizers.

The core (:mod:`kmp.optimizer`) knows Keras 3 only and never imports
:mod:`kmp.compat`. This face-level function, which is what ``kmp.wrap_optimizer``
names, sends a tf-keras (Keras 2) optimizer to :func:`kmp.compat.keras2.wrap_optimizer`
and every other object to :func:`kmp.optimizer.wrap_optimizer`, with the same
arguments: the optimizer, ``settings=`` and overrides of :class:`kmp.OptimizerSettings`'s
fields, plus the path's own options.
"""

from __future__ import annotations

import importlib
from typing import Any

from kmp import optimizer as _optimizer
from kmp._legacy_keras import is_tf_keras_object
from kmp.optimizer_settings import OptimizerSettings

__all__ = ["wrap_optimizer"]


def wrap_optimizer(
    optimizer: Any, settings: OptimizerSettings | None = None, **overrides: Any
) -> Any:
    """Return ``optimizer`` wrapped for loss scaling and gradient averaging over ranks.

    A Keras 3 optimizer goes to :func:`kmp.optimizer.wrap_optimizer` and comes back a
    :class:`~kmp.scaling_optimizer.DistributedLossScaleOptimizer`; a tf-keras (Keras 2)
    one goes to :func:`kmp.compat.keras2.wrap_optimizer` and comes back as
    ``LossScaleOptimizer(hvd.DistributedOptimizer(optimizer))``. Both take the same
    :class:`kmp.OptimizerSettings`, which holds every field, its default and its meaning.
    The loss-scale mode follows the dtype policy in force now: call :func:`kmp.enable`
    first::

        opt = kmp.wrap_optimizer(keras.optimizers.Adam(1e-3), compression="fp16")

    Args:
        optimizer: A Keras 3 optimizer instance (e.g. ``keras.optimizers.Adam(1e-3)``)
            or a ``tf_keras.optimizers`` one.
        settings: A :class:`kmp.OptimizerSettings`; None: the defaults.
        **overrides: Fields of :class:`kmp.OptimizerSettings` (``loss_scale``,
            ``initial_scale``, ..., ``compression``, ``bucket_bytes``, ...) that replace
            those of ``settings``; and, for a tf-keras optimizer, ``keras_module``.

    Returns:
        The wrapped optimizer, to pass to ``model.compile``.

    Raises:
        TypeError: Not an optimizer, not a setting, or a value of the wrong type.
        ValueError: A value out of range, or one the optimizer's path cannot do
            (tf-keras: its fixed knobs, ``max_scale``, ``bucket_bytes``,
            ``master_weights``).
    """
    if is_tf_keras_object(optimizer):
        keras2 = importlib.import_module("kmp.compat.keras2")
        return keras2.wrap_optimizer(optimizer, settings, **overrides)
    return _optimizer.wrap_optimizer(optimizer, settings, **overrides)
