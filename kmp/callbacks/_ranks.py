"""Helpers shared by kmp's callbacks: ranks, chief printing, optimizer look-ups.

The rank, the chief and the world size are read from :mod:`kmp.distributed` at
each call, through the module attribute, so a callback can be made before
``kmp.distributed.init()`` and tests can patch ``kmp.distributed.is_chief``.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from kmp import distributed
from kmp._checks import check_choice, check_int

__all__ = [
    "chief_print",
    "innermost_optimizer",
    "is_chief",
    "model_optimizer",
    "this_rank",
    "to_float",
    "verbosity",
    "world_size",
]

_VERBOSITY_HINT = "Use 'auto', 0, 1 or 2, as for model.fit(verbose=...)."


def this_rank() -> int:
    """Return this process's rank (0 in a single process)."""
    return int(distributed.rank())


def is_chief() -> bool:
    """Return True on the chief (rank 0, or a single process)."""
    return bool(distributed.is_chief())


def world_size() -> int:
    """Return the number of ranks (1 in a single process)."""
    return int(distributed.size())


def chief_print(message: str) -> None:
    """Print ``message`` (flushed) on the chief only."""
    if is_chief():
        print(message, flush=True)


def to_float(value: Any) -> float:
    """Convert a Keras variable, tensor, NumPy or Python scalar to a float."""
    if isinstance(value, keras.Variable):
        value = value.value
    return float(np.asarray(value))


def model_optimizer(callback: keras.callbacks.Callback, what: str) -> keras.optimizers.Optimizer:
    """Return the optimizer of the callback's model, or say that ``what`` needs one.

    Raises:
        ValueError: The model is not compiled with an optimizer.
    """
    optimizer = getattr(callback.model, "optimizer", None)
    if optimizer is None:
        raise ValueError(
            f"{what} needs a compiled model with an optimizer, but model.optimizer is None. "
            "Call model.compile(optimizer=...) before model.fit(...)."
        )
    return optimizer


def innermost_optimizer(optimizer: Any) -> Any:
    """Follow the ``inner_optimizer`` chain (loss scaling, kmp wrappers) to its end."""
    seen = set()
    while getattr(optimizer, "inner_optimizer", None) is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        optimizer = optimizer.inner_optimizer
    return optimizer


def verbosity(chief: int | str = "auto") -> int | str:
    """Return the ``verbose`` value for ``model.fit``: ``chief`` on rank 0, 0 elsewhere.

    Args:
        chief: The verbosity to use on the chief (``"auto"``, 0, 1 or 2).

    Returns:
        ``chief`` on the chief rank (or in a single process), else 0, so that
        only one progress bar is printed.

    Raises:
        TypeError: ``chief`` is neither a string nor an int (a bool is not one).
        ValueError: ``chief`` is not one of ``"auto"``, 0, 1, 2.
    """
    if isinstance(chief, str):
        chief = check_choice("verbosity(chief)", chief, ("auto",), hint=_VERBOSITY_HINT)
    else:
        chief = check_int("verbosity(chief)", chief, minimum=0, maximum=2, hint=_VERBOSITY_HINT)
    return chief if is_chief() else 0
