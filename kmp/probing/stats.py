"""What 16-bit formats do to a set of measured values: pure NumPy, no Keras.

:class:`ValueStats` summarises every value a tensor (or several, for a layer called more
than once) held in a float32 pass: the largest and smallest non-zero magnitude, how many
overflow float16, bfloat16's relative rounding error, and a histogram of binary exponents
from which the fraction lost to float16 underflow at any power-of-two loss scale follows
exactly. :func:`recommend_loss_scale` is the rule that picks a scale from the gradients.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import numpy as np

# float16's largest value, and the headroom a scale leaves below it: the loss-scale rule's
# (its early growths stop where this module's recommended scale does).
from kmp.loss_scale import FLOAT16_MAX, SCALE_MARGIN

__all__ = [
    "FLOAT16_MAX",
    "FLOAT16_SMALLEST",
    "SCALE_MARGIN",
    "ValueStats",
    "recommend_loss_scale",
]

FLOAT16_SMALLEST = 2.0**-24  # the smallest subnormal: anything smaller is lost
BFLOAT16_MAX = float(np.finfo(np.float32).max)  # bfloat16 has float32's exponent range
# Binary exponents (np.frexp: |v| = m * 2**e, 0.5 <= m < 1) kept in the histogram.
_EXP_MIN, _EXP_MAX = -160, 160


def _bfloat16_relative_error(values: np.ndarray) -> np.ndarray:
    """|bfloat16(v) - v| / |v| for non-zero finite float32 ``values`` (in float32)."""
    import ml_dtypes  # installed with Keras

    rounded = values.astype(ml_dtypes.bfloat16).astype(np.float32)
    return np.abs(rounded - values) / values


@dataclasses.dataclass
class ValueStats:
    """The magnitudes of a set of float32 values, and what float16/bfloat16 make of them.

    Attributes:
        count: Values seen.
        zeros: Values that were exactly zero in float32.
        nonfinite: Values that were inf or NaN in float32.
        max_abs: Largest finite magnitude (0.0 when there was none).
        min_nonzero: Smallest non-zero finite magnitude (``inf`` when there was none).
        over_float16: Values whose magnitude exceeds float16's largest, 65504.
        bfloat16_error_max: Largest relative rounding error of bfloat16 over the non-zero values.
        bfloat16_error_sum: Sum of those errors (``bfloat16_error_mean`` divides it).
        exponents: Count of non-zero finite values per binary exponent (see ``np.frexp``),
            from ``-160`` (everything smaller included) to ``160``.
    """

    count: int = 0
    zeros: int = 0
    nonfinite: int = 0
    max_abs: float = 0.0
    min_nonzero: float = math.inf
    over_float16: int = 0
    bfloat16_error_max: float = 0.0
    bfloat16_error_sum: float = 0.0
    exponents: np.ndarray = dataclasses.field(
        default_factory=lambda: np.zeros(_EXP_MAX - _EXP_MIN + 1, np.int64)
    )

    def add(self, values: np.ndarray, detail: bool = True) -> ValueStats:
        """Count ``values`` (any float array) in; return ``self``.

        With ``detail=False`` only the counts, extremes and float16 overflow are kept (no
        exponent histogram, no bfloat16 error): what a layer's inputs need.
        """
        flat = np.asarray(values, dtype=np.float32).ravel()
        self.count += flat.size
        mags = np.abs(flat)
        finite = np.isfinite(mags)
        if not finite.all():
            self.nonfinite += int(flat.size - np.count_nonzero(finite))
            mags = mags[finite]
        nonzero = mags[mags > 0]
        self.zeros += int(mags.size - nonzero.size)
        if not nonzero.size:
            return self
        self.max_abs = max(self.max_abs, float(nonzero.max()))
        self.min_nonzero = min(self.min_nonzero, float(nonzero.min()))
        self.over_float16 += int(np.count_nonzero(nonzero > FLOAT16_MAX))
        if detail:
            errors = _bfloat16_relative_error(nonzero)
            self.bfloat16_error_max = max(self.bfloat16_error_max, float(errors.max()))
            self.bfloat16_error_sum += float(errors.sum(dtype=np.float64))
            _, exps = np.frexp(nonzero)
            bins = np.clip(exps, _EXP_MIN, _EXP_MAX) - _EXP_MIN
            self.exponents += np.bincount(bins, minlength=len(self.exponents))
        return self

    @property
    def nonzero(self) -> int:
        """Non-zero finite values seen."""
        return self.count - self.zeros - self.nonfinite

    @property
    def bfloat16_error_mean(self) -> float:
        """Mean relative rounding error of bfloat16 over the non-zero values."""
        return self.bfloat16_error_sum / self.nonzero if self.nonzero else 0.0

    def lost_to_underflow(self, scale: float = 1.0) -> float:
        """Fraction of the non-zero values whose magnitude times ``scale`` is below 2**-24.

        Exact for a power-of-two ``scale`` (the histogram's bins are binades); another
        scale is rounded down to a power of two.
        """
        if not self.nonzero:
            return 0.0
        k = math.floor(math.log2(scale))
        # |v| lies in [2**(e-1), 2**e): |v| * 2**k < 2**-24 for every such v iff e <= -24 - k.
        last = min(-24 - k, _EXP_MAX) - _EXP_MIN
        lost = int(self.exponents[: last + 1].sum()) if last >= 0 else 0
        return lost / self.nonzero

    def overflows_float16(self, scale: float = 1.0) -> float:
        """Fraction of the non-zero values whose magnitude times ``scale`` exceeds 65504.

        Exact at scale 1; at another scale a value counts from ``2**16 / scale`` on (the
        binade that holds 65504 is counted as overflowing only at scale 1).
        """
        if not self.nonzero:
            return 0.0
        if scale == 1.0:
            return self.over_float16 / self.nonzero
        k = math.floor(math.log2(scale))
        first = max(17 - k, _EXP_MIN) - _EXP_MIN
        return (
            int(self.exponents[first:].sum()) / self.nonzero
            if first <= len(self.exponents)
            else 0.0
        )

    def to_dict(self) -> dict:
        """JSON-ready figures (the histogram as ``{exponent: count}`` of its non-empty bins)."""
        bins = {int(e + _EXP_MIN): int(c) for e, c in enumerate(self.exponents) if c}
        return {
            "count": self.count,
            "zeros": self.zeros,
            "nonfinite": self.nonfinite,
            "max_abs": self.max_abs,
            "min_nonzero": None if math.isinf(self.min_nonzero) else self.min_nonzero,
            "over_float16": self.over_float16,
            "bfloat16_error_max": self.bfloat16_error_max,
            "bfloat16_error_mean": self.bfloat16_error_mean,
            "exponents": bins,
        }


def recommend_loss_scale(
    gradient_maxima: Iterable[float],
    *,
    min_scale: float = 1.0,
    max_scale: float = 2.0**24,
    margin: float = SCALE_MARGIN,
) -> float:
    """The largest power of two that keeps every scaled gradient ``margin`` below 65504.

    Args:
        gradient_maxima: The largest gradient magnitude of each tensor (at loss scale 1).
        min_scale: The result is never below this.
        max_scale: The result is never above this.
        margin: Headroom factor below float16's largest value.

    Returns:
        A power of two in ``[min_scale, max_scale]`` (``max_scale`` rounded down to a
        power of two when there are no non-zero gradients).
    """
    largest = max((g for g in gradient_maxima if g > 0 and math.isfinite(g)), default=0.0)
    top = 2.0 ** math.floor(math.log2(max_scale))
    if largest == 0.0:
        return max(top, min_scale)
    scale = 2.0 ** math.floor(math.log2(FLOAT16_MAX / (margin * largest)))
    return float(min(max(scale, min_scale), top))
