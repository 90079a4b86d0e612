"""The face's ``kmp.wrap_optimizer``: one entry point for Keras 3 and tf-keras optimizers.

The core (:mod:`kmp.optimizer`) knows Keras 3 only and never imports
:mod:`kmp.compat`. This face-level function, which is what ``kmp.wrap_optimizer``
names, sends a tf-keras (Keras 2) optimizer to :func:`kmp.compat.keras2.wrap_optimizer`
and every other object to :func:`kmp.optimizer.wrap_optimizer`, with the same
keyword arguments.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

from kmp import optimizer as _optimizer
from kmp._legacy_keras import is_tf_keras_object

__all__ = ["wrap_optimizer"]


@functools.wraps(_optimizer.wrap_optimizer)
def wrap_optimizer(optimizer: Any, **kwargs: Any) -> Any:
    """Route ``optimizer`` by its Keras; the docstring is the core's (functools.wraps)."""
    if is_tf_keras_object(optimizer):
        keras2 = importlib.import_module("kmp.compat.keras2")
        return keras2.wrap_optimizer(optimizer, **kwargs)
    return _optimizer.wrap_optimizer(optimizer, **kwargs)
