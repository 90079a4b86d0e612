"""Old public names kept working: a :class:`DeprecationWarning`, then the new name's value.

This module imports nothing from kmp.
"""

from __future__ import annotations

import warnings
from typing import Any

__all__ = ["DeprecatedAlias", "warn_renamed"]


def warn_renamed(old: str, new: str, *, what: str = "", stacklevel: int = 3) -> None:
    """Warn that ``old`` is deprecated and ``new`` is the name to use.

    Args:
        old: The old name, as the user wrote it (``"opt.step_counter"``).
        new: The name to use instead.
        what: What the new name holds, said in the message.
        stacklevel: Passed to :func:`warnings.warn` (3: the caller's caller).
    """
    holds = f" (it holds {what})" if what else ""
    warnings.warn(
        f"{old} is deprecated and will be removed; use {new}{holds}.",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


class DeprecatedAlias:
    """A class attribute that reads and writes another attribute, with a warning.

    Args:
        new: The attribute the alias stands for.
        what: What it holds, for the message.
    """

    def __init__(self, new: str, what: str = "") -> None:
        self.new = new
        self.what = what
        self.old = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.old = name

    def _warn(self, obj: Any) -> None:
        cls = type(obj).__name__
        warn_renamed(f"{cls}.{self.old}", f"{cls}.{self.new}", what=self.what, stacklevel=4)

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        self._warn(obj)
        return getattr(obj, self.new)

    def __set__(self, obj: Any, value: Any) -> None:
        self._warn(obj)
        setattr(obj, self.new, value)
