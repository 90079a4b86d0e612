"""Which Keras ``tf.keras`` is in this process, answered without importing either.

TensorFlow routes ``tf.keras`` to tf-keras (Keras 2) when ``TF_USE_LEGACY_KERAS``
is set to a value it accepts and the ``tf_keras`` package is installed. The core
(:mod:`kmp.policy`, :mod:`kmp.optimizer`) needs two facts about that, which live
here so that it never imports :mod:`kmp.compat`: whether legacy Keras is on, and
whether an object belongs to tf-keras. :mod:`kmp.compat.keras2` builds on them.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType
from typing import Any

from kmp._imports import optional_import
from kmp._names import normalize_policy

__all__ = [
    "LEGACY_KERAS_ENV_VAR",
    "is_legacy_keras",
    "is_tf_keras_object",
    "set_legacy_global_policy",
]

LEGACY_KERAS_ENV_VAR = "TF_USE_LEGACY_KERAS"
# The values TensorFlow itself accepts (tensorflow/__init__.py routes tf.keras on these).
_TRUTHY = ("true", "True", "1")


def is_legacy_keras() -> bool:
    """Return True when ``tf.keras`` is tf-keras (Keras 2) in this process.

    That is: ``TF_USE_LEGACY_KERAS`` is set to a value TensorFlow accepts
    (``1``, ``true``, ``True``) and the ``tf_keras`` package is installed.
    Neither TensorFlow nor tf-keras is imported to find out.
    """
    if os.environ.get(LEGACY_KERAS_ENV_VAR) not in _TRUTHY:
        return False
    try:
        return importlib.util.find_spec("tf_keras") is not None
    except (ImportError, ValueError):
        return False


def is_tf_keras_object(obj: Any) -> bool:
    """Return True when ``obj``'s class (or a base) comes from the ``tf_keras`` package."""
    return any((c.__module__ or "").startswith("tf_keras") for c in type(obj).__mro__)


def set_legacy_global_policy(name: str, keras_module: ModuleType | None = None) -> Any:
    """Set tf-keras's (or ``keras_module``'s) global dtype policy to the policy ``name``.

    Args:
        name: A policy name; ``"auto"`` must be resolved first.
        keras_module: The Keras module to set it on; None means ``tf_keras``.

    Returns:
        That module's global policy after the change.

    Raises:
        TypeError: ``name`` is not a string.
        ValueError: ``name`` is not a concrete policy name.
        ImportError: tf-keras is not installed.
    """
    key = normalize_policy(name, allow_auto=False)
    km = keras_module
    if km is None:
        km = optional_import("tf_keras", feature="the tf-keras (Keras 2) path")
    km.mixed_precision.set_global_policy(key)
    return km.mixed_precision.global_policy()
