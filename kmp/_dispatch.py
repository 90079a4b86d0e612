"""The face's ``kmp.wrap_optimizer``: one entry point for Keras 3 and tf-keras optimizers.

The core (:mod:`kmp.optimizer`) knows Keras 3 only and never imports
:mod:`kmp.compat`. This face-level function, which is what ``kmp.wrap_optimizer``
names, sends a tf-keras (Keras 2) optimizer to :func:`kmp.compat.keras2.wrap_optimizer`
and every other object to :func:`kmp.optimizer.wrap_optimizer`, with the same
arguments. Its signature is what both paths take: the optimizer, ``settings=`` and the
fields of :class:`kmp.OptimizerSettings` (built from the class, so it cannot drift),
plus the path's own options.
"""

from __future__ import annotations

import importlib
import inspect
import typing
from typing import Any

from kmp import optimizer as _optimizer
from kmp._checks import NOT_GIVEN
from kmp._legacy_keras import is_tf_keras_object
from kmp.optimizer_settings import FIELDS, OptimizerSettings

__all__ = ["wrap_optimizer"]


def wrap_optimizer(
    optimizer: Any, *, settings: OptimizerSettings | None = None, **fields: Any
) -> Any:
    """Return ``optimizer`` wrapped for loss scaling and gradient averaging over ranks.

    A Keras 3 optimizer goes to :func:`kmp.optimizer.wrap_optimizer` and comes back a
    :class:`~kmp.scaling_optimizer.DistributedLossScaleOptimizer`; a tf-keras (Keras 2)
    one goes to :func:`kmp.compat.keras2.wrap_optimizer` and comes back as
    ``LossScaleOptimizer(hvd.DistributedOptimizer(optimizer))``. Both take the same
    settings, with the same defaults (:data:`kmp.optimizer_settings.DEFAULTS`); each
    field is described in :class:`kmp.OptimizerSettings`. The loss-scale mode follows the
    dtype policy in force now: call :func:`kmp.enable` first.

    Args:
        optimizer: A Keras 3 optimizer instance (e.g. ``keras.optimizers.Adam(1e-3)``)
            or a ``tf_keras.optimizers`` one.
        settings: A :class:`kmp.OptimizerSettings`, or None.
        **fields: Any field of :class:`kmp.OptimizerSettings` (``loss_scale``,
            ``initial_scale``, ..., ``compression``, ``bucket_bytes``, ...), combined with
            ``settings`` (a field given both ways must agree); and, for a tf-keras
            optimizer, ``keras_module``.

    Returns:
        The wrapped optimizer, to pass to ``model.compile``.

    Raises:
        TypeError: Not an optimizer, or a setting of the wrong type.
        ValueError: A setting out of range, given twice differently, or one the
            optimizer's path cannot do (tf-keras: its fixed knobs, ``max_scale``,
            ``bucket_bytes``, ``master_weights``).
    """
    if settings is not None:
        fields["settings"] = settings
    if is_tf_keras_object(optimizer):
        keras2 = importlib.import_module("kmp.compat.keras2")
        return keras2.wrap_optimizer(optimizer, **fields)
    return _optimizer.wrap_optimizer(optimizer, **fields)


def _signature() -> inspect.Signature:
    """``wrap_optimizer``'s signature as both paths take it: the fields spelled out."""
    hints = typing.get_type_hints(OptimizerSettings)
    keyword = inspect.Parameter.KEYWORD_ONLY
    return inspect.Signature(
        [
            inspect.Parameter("optimizer", inspect.Parameter.POSITIONAL_OR_KEYWORD),
            inspect.Parameter(
                "settings", keyword, default=None, annotation=OptimizerSettings | None
            ),
            *(
                inspect.Parameter(k, keyword, default=NOT_GIVEN, annotation=hints[k])
                for k in FIELDS
            ),
            inspect.Parameter("path_options", inspect.Parameter.VAR_KEYWORD, annotation=Any),
        ],
        return_annotation=Any,
    )


wrap_optimizer.__signature__ = _signature()  # type: ignore[attr-defined]
