"""Argument checks in kmp's error style, written once.

Every public function checks its arguments here before TensorFlow or JAX sees
them, so the same mistake gets the same error everywhere:

* a value of the wrong type raises :class:`TypeError`;
* a value of the right type but out of range or unknown raises :class:`ValueError`;
* the message names the argument, shows what was given, and says what to pass.

``NOT_GIVEN`` is the "not given" sentinel for keyword arguments whose absence
matters (re-wrapping an optimizer must tell "not passed" from "passed the
default"). This module imports nothing from kmp.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import Any

__all__ = [
    "NOT_GIVEN",
    "check_bool",
    "check_choice",
    "check_int",
    "check_number",
    "given",
    "is_int",
    "is_real",
]


class _NotGiven:
    """The type of :data:`NOT_GIVEN`: a keyword argument the caller did not pass."""

    _instance: _NotGiven | None = None

    def __new__(cls) -> _NotGiven:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "<default>"

    def __bool__(self) -> bool:
        return False

    def __reduce__(self) -> str:
        return "NOT_GIVEN"


NOT_GIVEN: Any = _NotGiven()


def given(value: Any) -> bool:
    """Return True unless ``value`` is the :data:`NOT_GIVEN` sentinel."""
    return value is not NOT_GIVEN


def is_int(value: Any) -> bool:
    """True for an integer (Python or NumPy), False for a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    """True for a real number (Python or NumPy), False for a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _fail(name: str, requirement: str, value: Any, hint: str) -> str:
    return f"`{name}` must be {requirement}; got {value!r}." + (f" {hint}" if hint else "")


def check_bool(name: str, value: Any, *, hint: str = "") -> bool:
    """Return ``value`` if it is True or False.

    Raises:
        TypeError: ``value`` is not a bool.
    """
    if not isinstance(value, bool):
        raise TypeError(_fail(name, "True or False", value, hint))
    return value


def check_int(
    name: str, value: Any, *, minimum: int | None = 1, maximum: int | None = None, hint: str = ""
) -> int:
    """Return ``value`` as an int if it is an integer in ``[minimum, maximum]``.

    Args:
        name: The argument, as the caller wrote it.
        value: What was passed.
        minimum: The smallest allowed value (None: no lower bound).
        maximum: The largest allowed value (None: no upper bound).
        hint: What to do instead, appended to the message.

    Raises:
        TypeError: ``value`` is not an integer (a bool is not one).
        ValueError: ``value`` is out of range.
    """
    if minimum is not None and maximum is not None:
        requirement = f"an integer from {minimum} to {maximum}"
    elif minimum == 1:
        requirement = "a positive integer"
    elif minimum is not None:
        requirement = f"an integer >= {minimum}"
    elif maximum is not None:
        requirement = f"an integer <= {maximum}"
    else:
        requirement = "an integer"
    if not is_int(value):
        raise TypeError(_fail(name, requirement, value, hint))
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(_fail(name, requirement, value, hint))
    return int(value)


def check_number(
    name: str,
    value: Any,
    *,
    above: float | None = None,
    at_least: float | None = None,
    below: float | None = None,
    at_most: float | None = None,
    hint: str = "",
) -> float:
    """Return ``value`` as a float if it is a finite real number within the bounds.

    Args:
        name: The argument, as the caller wrote it.
        value: What was passed.
        above: ``value`` must be greater than this.
        at_least: ``value`` must be at least this.
        below: ``value`` must be smaller than this.
        at_most: ``value`` must be at most this.
        hint: What to do instead, appended to the message.

    Raises:
        TypeError: ``value`` is not a real number (a bool is not one).
        ValueError: ``value`` is not finite or out of range.
    """
    bounds = []
    if above is not None:
        bounds.append(f"> {above:g}")
    if at_least is not None:
        bounds.append(f">= {at_least:g}")
    if below is not None:
        bounds.append(f"< {below:g}")
    if at_most is not None:
        bounds.append(f"<= {at_most:g}")
    if bounds == ["> 0"]:
        requirement = "a positive finite number"
    elif bounds:
        requirement = f"a finite number {' and '.join(bounds)}"
    else:
        requirement = "a finite number"
    if not is_real(value):
        raise TypeError(_fail(name, requirement, value, hint))
    x = float(value)
    if (
        not math.isfinite(x)
        or (above is not None and not x > above)
        or (at_least is not None and not x >= at_least)
        or (below is not None and not x < below)
        or (at_most is not None and not x <= at_most)
    ):
        raise ValueError(_fail(name, requirement, value, hint))
    return x


def check_choice(name: str, value: Any, choices: Iterable[str], *, hint: str = "") -> str:
    """Return the lower-cased ``value`` if it is one of ``choices``.

    Raises:
        TypeError: ``value`` is not a string.
        ValueError: ``value`` is not one of ``choices``.
    """
    options = tuple(choices)
    requirement = "one of " + ", ".join(repr(c) for c in options)
    if not isinstance(value, str):
        raise TypeError(_fail(name, requirement, value, hint))
    key = value.strip().lower()
    if key not in options:
        raise ValueError(_fail(name, requirement, value, hint))
    return key
