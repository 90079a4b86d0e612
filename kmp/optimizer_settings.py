"""The optimizer wrappers' settings: one frozen, validated object and the one set of defaults.

:class:`OptimizerSettings` is what :func:`kmp.wrap_optimizer`,
:func:`kmp.compat.keras2.wrap_optimizer` and :func:`kmp.compat.v1.distributed_optimizer`
take as ``settings=``; their keyword arguments are the same fields, spelled out for
convenience. :data:`DEFAULTS` is the one answer to "what does a field mean when it is not
given", for all three paths.

The object remembers which fields were given: a field left out takes its default where
the optimizer is wrapped, which lets a path do what its default means there (tf-keras's
scale has no ``max_scale``; a TF1 graph has no policy saying it computes in float16), and
lets a re-wrap judge only what was asked for. The rule for a settings object together
with keyword arguments (:meth:`OptimizerSettings.combine`): they combine field by field,
and a field given in both must agree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from kmp import _checks
from kmp import loss_scale as _ls
from kmp import master_weights as _mw
from kmp._names import LOSS_SCALE_MODES, normalize_compression
from kmp.distributed.buckets import DEFAULT_BUCKET_BYTES, check_bucket_bytes
from kmp.distributed.sparse import DEFAULT_SPARSE_GRADIENTS, check_sparse_gradients

__all__ = ["DEFAULTS", "FIELDS", "OptimizerSettings"]

NOT_GIVEN = _checks.NOT_GIVEN
# What each field means when it is not given: one set, for every wrapper.
DEFAULTS: dict[str, Any] = {
    "loss_scale": "dynamic",
    **_ls.DEFAULTS,
    "compression": None,
    "backward_passes_per_step": 1,
    "scale_lr": False,
    "bucket_bytes": DEFAULT_BUCKET_BYTES,
    "sparse_gradients": DEFAULT_SPARSE_GRADIENTS,
    "master_weights": _mw.DEFAULT_MASTER_WEIGHTS,
    "rounding_seed": _mw.DEFAULT_ROUNDING_SEED,
}
FIELDS: tuple[str, ...] = tuple(DEFAULTS)


def _check_loss_scale(value: Any) -> Any:
    """A setting (canonical form) or a :class:`~kmp.loss_scale.LossScale`, checked alone."""
    if isinstance(value, _ls.LossScale) or value is None:
        return value
    if isinstance(value, str):
        mode = _ls.normalize_setting(value)
        if mode not in LOSS_SCALE_MODES:
            _ls.from_setting(value, compute_dtype="float32")  # raises its ValueError
        return mode
    _ls.from_setting(value, compute_dtype="float32")  # a static scale: type and range
    return value


def _check_compression(value: Any) -> Any:
    """A compression name (canonical), or a custom Horovod compressor for the tf-keras path."""
    try:
        return normalize_compression(value)
    except TypeError:
        if hasattr(value, "compress") and hasattr(value, "decompress"):
            return value  # only Horovod's Keras layer knows it; Keras 3 and TF1 refuse it
        raise


_CHECKS = {
    "loss_scale": _check_loss_scale,
    **{k: (lambda v, k=k: _ls.check_knob(k, v)) for k in _ls.KNOBS},
    "compression": _check_compression,
    "backward_passes_per_step": lambda v: _checks.check_int(
        "backward_passes_per_step", v, minimum=1
    ),
    "scale_lr": lambda v: _checks.check_bool("scale_lr", v),
    "bucket_bytes": check_bucket_bytes,
    "sparse_gradients": check_sparse_gradients,
    "master_weights": _mw.check_master_weights,
    "rounding_seed": lambda v: _checks.check_int("rounding_seed", v, minimum=0),
}


@dataclasses.dataclass(frozen=True, repr=False)
class OptimizerSettings:
    """The settings of kmp's optimizer wrappers, checked once, when made.

    Every field may be left out: it then takes its default (:data:`DEFAULTS`) when the
    optimizer is wrapped. :meth:`given` returns what was set, :meth:`resolved` every
    field with the defaults filled in. Pass it as ``settings=`` to
    :func:`kmp.wrap_optimizer` (either Keras), :func:`kmp.compat.keras2.wrap_optimizer`
    or :func:`kmp.compat.v1.distributed_optimizer`; keyword arguments given there combine
    with it (:meth:`combine`)::

        settings = kmp.OptimizerSettings(compression="fp16", growth_interval=500)
        opt = kmp.wrap_optimizer(keras.optimizers.Adam(1e-3), settings=settings)

    What a path cannot do is refused where the optimizer is wrapped: tf-keras's
    ``LossScaleOptimizer`` has fixed knobs (``kmp.compat.keras2.TF_KERAS_RULE``) and no
    ``max_scale``, and neither tf-keras nor TF1 takes ``bucket_bytes`` (tf-keras) or
    ``master_weights`` (both: Keras 3 only).

    Attributes:
        loss_scale: ``"dynamic"`` (default): dynamic scaling when the global dtype policy
            computes in float16 when the optimizer is wrapped, none otherwise (in a TF1
            graph, which has no policy, the default is no scaling and a given
            ``"dynamic"`` means float16's). ``"force_dynamic"``: dynamic scaling under any
            policy. A positive number: a static scale. None: no scaling. Or a
            :class:`kmp.loss_scale.LossScale`, the rule itself (then the knobs below, if
            given, must agree with it).
        initial_scale: The first dynamic scale (default ``2**15``).
        growth_interval: Finite steps in a row after which a dynamic scale grows (2000).
        growth_factor: What the scale is multiplied by when it grows (2.0, > 1).
        backoff_factor: What it is multiplied by on an overflow (0.5, in (0, 1)).
        min_scale: The lowest dynamic scale (1.0).
        max_scale: The highest dynamic scale (``2**24``; tf-keras: no bound).
        hysteresis: Overflowing steps in a row skipped before the scale backs off (1).
        compression: None (default), ``"fp16"`` or ``"bf16"``: the dtype gradients travel
            in (Horovod's ``hvd.Compression`` classes are read as these; a custom one
            reaches the tf-keras path only).
        backward_passes_per_step: Micro-batches accumulated locally per update (1).
        scale_lr: Multiply the learning rate by the number of ranks (False).
        bucket_bytes: Reduce gradients in buckets of about this many bytes, last layer
            first (:data:`kmp.distributed.buckets.DEFAULT_BUCKET_BYTES`); None: one
            grouped allreduce.
        sparse_gradients: ``"gather"`` (default) or ``"dense"``: how sparse gradients
            travel (:mod:`kmp.distributed.sparse`).
        master_weights: How 16-bit weights take their updates (``"auto"``, default;
            :mod:`kmp.master_weights`). Keras 3 only.
        rounding_seed: The seed of stochastic rounding (0). Keras 3 only.

    Raises:
        TypeError: A field of the wrong type.
        ValueError: A field out of range or unknown, or knobs that disagree with a
            ``LossScale`` given as ``loss_scale``.
    """

    DEFAULTS: ClassVar[Mapping[str, Any]] = DEFAULTS

    loss_scale: str | float | _ls.LossScale | None = NOT_GIVEN
    initial_scale: float = NOT_GIVEN
    growth_interval: int = NOT_GIVEN
    growth_factor: float = NOT_GIVEN
    backoff_factor: float = NOT_GIVEN
    min_scale: float = NOT_GIVEN
    max_scale: float = NOT_GIVEN
    hysteresis: int = NOT_GIVEN
    compression: Any = NOT_GIVEN
    backward_passes_per_step: int = NOT_GIVEN
    scale_lr: bool = NOT_GIVEN
    bucket_bytes: int | None = NOT_GIVEN
    sparse_gradients: str = NOT_GIVEN
    master_weights: str = NOT_GIVEN
    rounding_seed: int = NOT_GIVEN

    def __post_init__(self) -> None:
        for name in FIELDS:
            value = getattr(self, name)
            if _checks.given(value):
                object.__setattr__(self, name, _CHECKS[name](value))
        rule = self.loss_scale
        if isinstance(rule, _ls.LossScale):
            differ = [
                f"{k}={v!r} (the LossScale has {getattr(rule, k)!r})"
                for k, v in self.given().items()
                if k in _ls.KNOBS and v != getattr(rule, k)
            ]
            if differ:
                raise ValueError(
                    f"loss_scale is a LossScale, which holds the knobs, but {', '.join(differ)} "
                    "was given too: put the knobs in the LossScale, or pass a setting string."
                )

    def __repr__(self) -> str:
        given = ", ".join(f"{k}={v!r}" for k, v in self.given().items())
        return f"{type(self).__name__}({given})"

    def given(self) -> dict[str, Any]:
        """Return the fields that were set, checked and in canonical form."""
        return {k: getattr(self, k) for k in FIELDS if _checks.given(getattr(self, k))}

    def resolved(self) -> dict[str, Any]:
        """Return every field: the given ones, and :data:`DEFAULTS` for the rest."""
        return {**DEFAULTS, **self.given()}

    def loss_scale_rule(self, compute_dtype: str, **knob_defaults: Any) -> _ls.LossScale:
        """Resolve the loss scale for ``compute_dtype`` (:func:`kmp.loss_scale.from_setting`).

        Args:
            compute_dtype: The dtype layers compute in, which decides ``"dynamic"``.
            **knob_defaults: A path's own defaults for knobs that were not given
                (tf-keras: ``max_scale``); the rest take :data:`DEFAULTS`.

        Returns:
            The validated :class:`~kmp.loss_scale.LossScale`.
        """
        if isinstance(self.loss_scale, _ls.LossScale):
            return self.loss_scale
        given = self.given()
        knobs = {**knob_defaults, **{k: v for k, v in given.items() if k in _ls.KNOBS}}
        setting = given.get("loss_scale", DEFAULTS["loss_scale"])
        return _ls.from_setting(setting, compute_dtype=compute_dtype, **knobs)

    def refuse(self, names: tuple[str, ...], *, path: str, instead: str) -> None:
        """Refuse the fields in ``names`` given other than their default, on ``path``.

        Args:
            names: The fields ``path`` cannot do (it does their default).
            path: What cannot do them, for the message (``"The tf-keras path"``).
            instead: What to do, for the message.

        Raises:
            ValueError: One of them is given with another value than its default.
        """
        asked = [f"{k}={v!r}" for k, v in self.given().items() if k in names and v != DEFAULTS[k]]
        if asked:
            raise ValueError(f"{path} cannot do {', '.join(asked)}. {instead}")

    @classmethod
    def combine(
        cls, settings: OptimizerSettings | None, keywords: Mapping[str, Any]
    ) -> OptimizerSettings:
        """Combine a settings object with a wrapper's keyword arguments.

        The rule: every field given in either is given in the result, and a field
        given in both must have the same value (after the checks: ``" FP16"`` and
        ``"fp16"`` agree). Fields not given in either keep their defaults.

        Args:
            settings: An :class:`OptimizerSettings`, or None.
            keywords: The wrapper's keyword arguments by name; names that are not
                fields are ignored, and :data:`~kmp._checks.NOT_GIVEN` values are not given.

        Returns:
            The combined settings (``settings`` itself when no keyword was given).

        Raises:
            TypeError: ``settings`` is not an :class:`OptimizerSettings`, or a field has
                the wrong type.
            ValueError: A field is given both ways with different values, or is out of range.
        """
        if settings is not None and not isinstance(settings, cls):
            raise TypeError(
                f"settings must be a kmp.{cls.__name__} (or None), not "
                f"{type(settings).__name__} {settings!r}; pass the values as keyword "
                f"arguments, or build one: kmp.{cls.__name__}(compression='fp16', ...)."
            )
        extra = cls(**{k: v for k, v in keywords.items() if k in FIELDS})
        if settings is None:
            return extra
        if not extra.given():
            return settings
        ours, theirs = settings.given(), extra.given()
        clashes = [
            f"{k}={ours[k]!r} in settings and {k}={v!r} as a keyword"
            for k, v in theirs.items()
            if k in ours and ours[k] != v
        ]
        if clashes:
            raise ValueError(
                f"Conflicting optimizer settings: {'; '.join(clashes)}. Give each field once, "
                "or the same value both ways."
            )
        return dataclasses.replace(settings, **theirs)
