"""The loss-scale rule, written once: a frozen description and its update.

A :class:`LossScale` says *how* the loss is scaled (``"none"``, ``"static"`` or
``"dynamic"``) and with which knobs; :func:`update` is the one implementation
of what happens after a step, used by every path kmp has:

* the stateful Keras 3 path (TensorFlow, PyTorch): ``kmp.scaling_optimizer``
  (``DistributedLossScaleOptimizer.apply``, built by ``kmp.wrap_optimizer``);
* the stateless Keras 3 path (JAX): ``kmp.scaling_optimizer`` too (``stateless_apply``);
* TF1 graphs: ``kmp.compat.v1`` (the same function, on ``tf`` ops);
* tf-keras: ``kmp.compat.keras2`` validates with the same class and hands the
  knobs that tf-keras's own ``LossScaleOptimizer`` has to it.

The dynamic rule, for each step (``finite`` is the same on every rank because
it is decided on the averaged gradients)::

    finite step:     apply it; good_steps += 1; overflow_streak = 0
                     if good_steps == growth_interval:
                         scale = min(scale * growth_factor, max_scale); good_steps = 0
    overflowing step: skip it; skipped += 1; good_steps = 0; overflow_streak += 1
                     if overflow_streak >= hysteresis:
                         scale = max(scale * backoff_factor, min_scale)

So the scale never leaves ``[min_scale, max_scale]``, every overflowing step is
skipped and counted, and with ``hysteresis=h`` the first ``h - 1`` overflows
in a row only skip (each further one in the same run backs off). A static
scale never changes; overflowing steps are still skipped and counted.

That is Keras's and PyTorch's ``GradScaler``'s rule: it only looks at overflow.
kmp's default also looks at underflow (``underflow_threshold``, None turns it
off): :func:`gradient_stats` measures, on the same averaged, still-scaled
gradients, the share of values that float16 holds only as subnormals (below
``2**-14``: they lose precision, and a little smaller they are lost) and the
largest magnitude. A finite step then also grows the scale when::

    good_steps >= underflow_patience                     # at least that many finite steps
    and share > underflow_threshold                      # float16 is losing gradient bits
    and peak * growth_factor * SCALE_MARGIN <= 65504     # the grown scale keeps headroom

The headroom test is :func:`kmp.probe`'s recommended scale
(:func:`kmp.probing.stats.recommend_loss_scale`, the same margin): the rule
never grows early past the scale the probe would recommend for these
gradients. A growth needs ``underflow_patience`` finite steps, so growths alone
can make at most one step in ``underflow_patience + 1`` overflow.

:func:`update` is written against a small array namespace (``keras.ops`` by
default; ``tensorflow`` and ``numpy`` have the same functions), so each path
runs the same lines in its own ops.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from kmp import _checks
from kmp._names import LOSS_SCALE_KINDS, LOSS_SCALE_MODES

__all__ = ["GradientStats", "LossScale", "ScaleState", "gradient_stats", "update"]

# float16's limits as the rule (and kmp.probe) see them.
FLOAT16_MAX = 65504.0
FLOAT16_SMALLEST_NORMAL = 2.0**-14  # below it float16 holds a value as a subnormal
# A scale leaves the largest scaled gradient this factor below FLOAT16_MAX (three doublings
# of headroom: gradients grow as training moves); kmp.probe's recommended scale too.
SCALE_MARGIN = 8.0

# The knobs and their defaults, as kmp.wrap_optimizer documents them.
DEFAULTS: dict[str, Any] = {
    "initial_scale": 2.0**15,
    "growth_interval": 2000,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "min_scale": 1.0,
    "max_scale": 2.0**24,
    "hysteresis": 1,
    "underflow_threshold": 0.01,
    "underflow_patience": 100,
}
KNOBS: tuple[str, ...] = tuple(DEFAULTS)
# The scale lives in a float32 variable: it must stay a normal, finite float32.
FLOAT32_TINY = 1.1754943508222875e-38
FLOAT32_MAX = 3.4028234663852886e38


@dataclasses.dataclass(frozen=True)
class LossScale:
    """How the loss is scaled: a small, frozen, validated value.

    Attributes:
        kind: ``"none"`` (no scaling), ``"static"`` (a fixed scale) or ``"dynamic"``.
        initial_scale: The first scale of a dynamic rule, or the fixed scale of a
            static one.
        growth_interval: Finite steps in a row after which a dynamic scale grows.
        growth_factor: What a dynamic scale is multiplied by when it grows (> 1).
        backoff_factor: What it is multiplied by when it backs off, in (0, 1).
        min_scale: The lowest dynamic scale (> 0).
        max_scale: The highest dynamic scale (>= ``min_scale``).
        hysteresis: Overflowing steps in a row that are only skipped before the
            scale backs off (1: back off at every overflow).
        underflow_threshold: A dynamic scale also grows when more than this share of
            the gradient values sit below float16's smallest normal (0.01); None:
            only overflow moves it (Keras's and ``GradScaler``'s rule).
        underflow_patience: Finite steps since the scale last moved before underflow
            may grow it (100).

    Raises:
        TypeError: A knob of the wrong type.
        ValueError: A knob out of range: ``growth_factor <= 1``, ``backoff_factor``
            outside (0, 1), ``min_scale > max_scale``, a dynamic ``initial_scale``
            outside ``[min_scale, max_scale]``, ``hysteresis < 1``, or an unknown kind.
    """

    kind: str = "dynamic"
    initial_scale: float = DEFAULTS["initial_scale"]
    growth_interval: int = DEFAULTS["growth_interval"]
    growth_factor: float = DEFAULTS["growth_factor"]
    backoff_factor: float = DEFAULTS["backoff_factor"]
    min_scale: float = DEFAULTS["min_scale"]
    max_scale: float = DEFAULTS["max_scale"]
    hysteresis: int = DEFAULTS["hysteresis"]
    underflow_threshold: float | None = DEFAULTS["underflow_threshold"]
    underflow_patience: int = DEFAULTS["underflow_patience"]

    def __post_init__(self) -> None:
        kind = _checks.check_choice("kind", self.kind, LOSS_SCALE_KINDS)
        values = {k: check_knob(k, getattr(self, k)) for k in KNOBS}
        low, high, initial = values["min_scale"], values["max_scale"], values["initial_scale"]
        if low > high:
            raise ValueError(
                f"`min_scale` ({low:g}) is larger than `max_scale` ({high:g}): pass a min_scale "
                "<= max_scale."
            )
        if kind == "dynamic" and not low <= initial <= high:
            raise ValueError(
                f"`initial_scale` ({initial:g}) lies outside [min_scale, max_scale] = "
                f"[{low:g}, {high:g}]: pass an initial_scale in that range, or widen it."
            )
        for name, value in {"kind": kind, **values}.items():
            object.__setattr__(self, name, value)

    # ------------------------------------------------------------------ reading

    @property
    def scaling(self) -> bool:
        """True unless the kind is ``"none"``."""
        return self.kind != "none"

    @property
    def dynamic(self) -> bool:
        """True for a dynamic scale."""
        return self.kind == "dynamic"

    @property
    def measures_underflow(self) -> bool:
        """True for a dynamic scale that also grows on underflow (kmp's default)."""
        return self.dynamic and self.underflow_threshold is not None

    @property
    def start_scale(self) -> float:
        """The scale of the first step (1.0 when not scaling)."""
        return self.initial_scale if self.scaling else 1.0

    @property
    def setting(self) -> str | float | None:
        """The ``loss_scale=`` setting that, with :meth:`knobs`, gives this rule under any policy.

        ``"force_dynamic"`` for a dynamic rule, the scale for a static one, None for none.
        """
        if self.dynamic:
            return "force_dynamic"
        return self.initial_scale if self.scaling else None

    def knobs(self) -> dict[str, Any]:
        """Return the knobs (everything but ``kind``) as keyword arguments."""
        return {k: getattr(self, k) for k in KNOBS}

    def to_config(self) -> dict[str, Any]:
        """Return a JSON-ready dict that :meth:`from_config` turns back into this value."""
        return dataclasses.asdict(self)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> LossScale:
        """Rebuild from :meth:`to_config` output.

        A rule saved before kmp measured underflow comes back as it trained: overflow only.
        """
        return cls(**{"underflow_threshold": None, **config})

    def start_state(self) -> ScaleState:
        """The state before the first step, as Python numbers."""
        return ScaleState(scale=self.start_scale, good_steps=0, overflow_streak=0, skipped=0)


def check_knob(name: str, value: Any) -> Any:
    """Check one knob on its own (its type and range) and return it as its type.

    The checks that need two knobs (``min_scale <= max_scale``, a dynamic
    ``initial_scale`` within them) are :class:`LossScale`'s.

    Raises:
        TypeError: ``name`` is not a knob, or ``value`` has the wrong type.
        ValueError: ``value`` is out of range.
    """
    if name in ("initial_scale", "min_scale", "max_scale"):
        return _float32_scale(name, value)
    if name == "growth_interval":
        return _checks.check_int(name, value, minimum=1)
    if name == "growth_factor":
        return _checks.check_number(name, value, above=1, hint="2.0 doubles the scale.")
    if name == "backoff_factor":
        return _checks.check_number(name, value, above=0, below=1, hint="0.5 halves it.")
    if name == "hysteresis":
        return _checks.check_int(name, value, minimum=1, hint="1 backs off at every overflow.")
    if name == "underflow_threshold":
        if value is None:
            return None
        hint = "0.01 grows the scale while over 1 % of the gradient is subnormal; None: never."
        return _checks.check_number(name, value, above=0, below=1, hint=hint)
    if name == "underflow_patience":
        return _checks.check_int(name, value, minimum=1, hint="e.g. 100 finite steps.")
    raise TypeError(f"Unknown loss-scale knob {name!r}; the knobs are {', '.join(KNOBS)}.")


def _float32_scale(name: str, value: Any, hint: str = "") -> float:
    """A positive finite number that a float32 holds as a normal value (the scale's dtype)."""
    x = _checks.check_number(name, value, above=0, hint=hint)
    if not FLOAT32_TINY <= x <= FLOAT32_MAX:
        raise ValueError(
            f"`{name}` must lie within float32's normal range [{FLOAT32_TINY:g}, "
            f"{FLOAT32_MAX:g}], as the loss scale is a float32; got {value!r}."
        )
    return x


class ScaleState(NamedTuple):
    """What the rule carries from step to step.

    Attributes:
        scale: The current loss scale (float32).
        good_steps: Finite steps in a row since the scale last changed or overflowed.
        overflow_streak: Overflowing steps in a row.
        skipped: Steps skipped so far because their gradients were not finite.
    """

    scale: Any
    good_steps: Any
    overflow_streak: Any
    skipped: Any


class GradientStats(NamedTuple):
    """What the rule reads from one step's averaged gradients, in float16's terms.

    Attributes:
        underflow: The share of the gradient values (of every element) that are not zero
            and, scaled, lie below float16's smallest normal (a float32 scalar).
        peak: The largest scaled gradient magnitude (a float32 scalar).
    """

    underflow: Any
    peak: Any


def _namespace(xp: Any) -> tuple[Any, Any, Any, Any]:
    """``(sum, max, size, cast)`` of ``xp``, which keras.ops, tensorflow and numpy name apart."""
    if hasattr(xp, "reduce_sum"):  # tensorflow
        return xp.reduce_sum, xp.reduce_max, xp.size, xp.cast
    cast = getattr(xp, "cast", None) or (lambda x, dtype: xp.asarray(x, dtype=dtype))
    return xp.sum, xp.max, xp.size, cast


def gradient_stats(grads: list, scaled_by: Any = None, xp: Any = None) -> GradientStats:
    """Measure :class:`GradientStats` over ``grads`` (None entries are left out).

    A few reductions per gradient (a masked count and a maximum), fused with the
    finite check where the step is compiled (JAX, XLA), op by op in a plain TensorFlow
    graph; every rank measures the same averaged gradients, so every rank decides the
    same.

    Args:
        grads: Dense gradient values (a sparse gradient's values), still multiplied by
            the loss scale, or already divided by it when ``scaled_by`` is given.
        scaled_by: The scale ``grads`` were divided by (the TF1 path unscales before it
            checks); None: they are still scaled.
        xp: The array namespace: ``keras.ops`` (default), ``tensorflow`` or ``numpy``.

    Returns:
        The :class:`GradientStats` (an empty list: no underflow, peak 0).
    """
    if xp is None:
        from keras import ops as xp
    total, largest, size, cast = _namespace(xp)
    tiny, factor = FLOAT16_SMALLEST_NORMAL, 1.0
    if scaled_by is not None:
        factor = cast(scaled_by, "float32")
        tiny = FLOAT16_SMALLEST_NORMAL / factor
    count, elements, peak = 0.0, 0.0, 0.0
    for g in grads:
        if g is None:
            continue
        a = xp.abs(g if str(g.dtype).endswith("float32") else cast(g, "float32"))
        small = xp.logical_and(xp.greater(a, 0.0), xp.less(a, tiny))
        count = count + total(cast(small, "float32"))
        elements = elements + cast(size(a), "float32")
        peak = xp.maximum(peak, largest(a))
    if isinstance(elements, float):  # no gradient at all
        return GradientStats(cast(0.0, "float32"), cast(0.0, "float32"))
    return GradientStats(count / xp.maximum(elements, 1.0), peak * factor)


def normalize_setting(loss_scale: Any) -> Any:
    """The canonical form of a ``loss_scale=`` setting (mode names stripped, lower case)."""
    return loss_scale.strip().lower() if isinstance(loss_scale, str) else loss_scale


def from_setting(loss_scale: Any = "dynamic", *, compute_dtype: str, **knobs: Any) -> LossScale:
    """Resolve a ``loss_scale=`` setting into a :class:`LossScale` for a compute dtype.

    The decision, made once, when an optimizer is wrapped:

    * ``"dynamic"``: dynamic scaling when ``compute_dtype`` is float16, none
      otherwise (bfloat16 and float32 have float32's range);
    * ``"force_dynamic"``: dynamic scaling whatever the dtype;
    * a positive number: a static scale of that value;
    * None: no scaling.

    Args:
        loss_scale: The setting, as ``kmp.wrap_optimizer`` takes it.
        compute_dtype: The dtype layers compute in (the global policy's).
        **knobs: Any of ``initial_scale``, ``growth_interval``, ``growth_factor``,
            ``backoff_factor``, ``min_scale``, ``max_scale``, ``hysteresis``;
            missing ones (or :data:`kmp._checks.NOT_GIVEN`) take their defaults.

    Returns:
        The validated :class:`LossScale`.

    Raises:
        TypeError: ``loss_scale`` or a knob has the wrong type, or a knob is unknown.
        ValueError: An unknown mode, a static scale that is not positive and
            finite, or a knob out of range.
    """
    unknown = sorted(set(knobs) - set(KNOBS))
    if unknown:
        raise TypeError(f"Unknown loss-scale knob(s) {unknown}; the knobs are {', '.join(KNOBS)}.")
    values = {k: v for k, v in knobs.items() if _checks.given(v)}
    if isinstance(loss_scale, str):
        mode = normalize_setting(loss_scale)
        if mode not in LOSS_SCALE_MODES:
            raise ValueError(
                f"Unknown loss_scale {loss_scale!r}. Use 'dynamic' (float16 policies only), "
                "'force_dynamic' (any policy), a positive number (static scale) or None (off)."
            )
        dynamic = mode == "force_dynamic" or compute_dtype == "float16"
        return LossScale("dynamic" if dynamic else "none", **values)
    if loss_scale is None:
        return LossScale("none", **values)
    if not _checks.is_real(loss_scale):
        raise TypeError(
            f"loss_scale must be 'dynamic', 'force_dynamic', a positive number or None; "
            f"got {type(loss_scale).__name__} {loss_scale!r}."
        )
    static = _float32_scale(
        "loss_scale", loss_scale, hint="Use loss_scale=None to turn loss scaling off."
    )
    if values.get("initial_scale", static) != static:
        raise ValueError(
            f"loss_scale={loss_scale!r} is a static scale, and initial_scale="
            f"{values['initial_scale']!r} only applies to a dynamic one: pass one or the other."
        )
    values["initial_scale"] = static
    return LossScale("static", **values)


def update(
    rule: LossScale,
    state: ScaleState,
    finite: Any,
    stats: GradientStats | None = None,
    xp: Any = None,
) -> ScaleState:
    """Return the state after one step whose gradients were ``finite`` (or not).

    This is the whole loss-scale rule (see the module docstring); the caller
    applies or skips the step on ``finite`` and stores what this returns. It
    has no branches on tensors, so it runs unchanged eagerly, inside
    ``tf.function``, in a TF1 graph and under ``jax.jit``.

    Args:
        rule: The :class:`LossScale`.
        state: The current :class:`ScaleState` (tensors or numbers).
        finite: A boolean scalar: True when every gradient was finite.
        stats: The step's :func:`gradient_stats`; needed when
            ``rule.measures_underflow`` (None: only overflow moves the scale).
        xp: The array namespace: ``keras.ops`` (default), ``tensorflow`` or ``numpy``.

    Returns:
        The next :class:`ScaleState`, each entry of its input's dtype.
    """
    if xp is None:
        from keras import ops as xp
    scale, good, streak, skipped = state
    overflow = xp.logical_not(finite)
    skipped = xp.where(overflow, skipped + 1, skipped)
    if not rule.dynamic:
        return ScaleState(scale, good, streak, skipped)
    good = xp.where(finite, good + 1, xp.zeros_like(good))
    streak = xp.where(finite, xp.zeros_like(streak), streak + 1)
    grow = xp.logical_and(finite, xp.greater_equal(good, rule.growth_interval))
    if rule.measures_underflow and stats is not None:
        starved = xp.logical_and(
            xp.greater_equal(good, rule.underflow_patience),
            xp.greater(stats.underflow, rule.underflow_threshold),
        )
        room = xp.less_equal(stats.peak * (rule.growth_factor * SCALE_MARGIN), FLOAT16_MAX)
        grow = xp.logical_or(grow, xp.logical_and(finite, xp.logical_and(starved, room)))
    back = xp.logical_and(overflow, xp.greater_equal(streak, rule.hysteresis))
    grown = xp.minimum(scale * rule.growth_factor, rule.max_scale)
    backed = xp.maximum(scale * rule.backoff_factor, rule.min_scale)
    scale = xp.where(grow, grown, xp.where(back, backed, scale))
    good = xp.where(grow, xp.zeros_like(good), good)
    return ScaleState(scale, good, streak, skipped)
