"""The optimizer wrappers' settings: one frozen dataclass, its defaults and checks once.

:class:`OptimizerSettings` is what :func:`kmp.wrap_optimizer`,
:func:`kmp.compat.keras2.wrap_optimizer` and :func:`kmp.compat.v1.distributed_optimizer`
take as ``settings=``; their keyword arguments are overrides of its fields, applied once
(:meth:`OptimizerSettings.with_overrides`). Each field is declared once, with its real
default and its check (in the field's metadata); the object checks every value when it is made,
so nothing downstream checks again. The wrapped optimizer keeps the object and saves it
(:meth:`OptimizerSettings.to_config`).

Adding a setting means three things: the field (default and check), its line in the
class docstring, and the code that acts on it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

from kmp import _checks
from kmp import loss_scale as _ls
from kmp import master_weights as _mw
from kmp._names import LOSS_SCALE_MODES, normalize_compression
from kmp.distributed.buckets import DEFAULT_BUCKET_BYTES, check_bucket_bytes
from kmp.distributed.sparse import DEFAULT_SPARSE_GRADIENTS, check_sparse_gradients

__all__ = ["OptimizerSettings"]


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
    return float(value)


def _check_compression(value: Any) -> Any:
    """A compression name (canonical), or a custom Horovod compressor for the tf-keras path."""
    try:
        return normalize_compression(value)
    except TypeError:
        if hasattr(value, "compress") and hasattr(value, "decompress"):
            return value  # only Horovod's Keras layer knows it; Keras 3 and TF1 refuse it
        raise


def _check(check: Callable[[Any], Any]) -> dict[str, Any]:
    """A field's metadata: the check its value passes when the object is made."""
    return {"check": check}


def _knob(name: str) -> dict[str, Any]:
    """A loss-scale knob's check (its default is :data:`kmp.loss_scale.DEFAULTS`'s)."""
    return _check(functools.partial(_ls.check_knob, name))


@dataclasses.dataclass(frozen=True)
class OptimizerSettings:
    """The settings of kmp's optimizer wrappers, with their defaults, checked once.

    Pass it as ``settings=`` to :func:`kmp.wrap_optimizer` (either Keras),
    :func:`kmp.compat.keras2.wrap_optimizer` or
    :func:`kmp.compat.v1.distributed_optimizer`; keyword arguments given there override
    its fields::

        settings = kmp.OptimizerSettings(compression="fp16", growth_interval=500)
        opt = kmp.wrap_optimizer(keras.optimizers.Adam(1e-3), settings=settings)
        opt.settings.compression              # "fp16": the optimizer keeps the object

    What a path cannot do is refused where the optimizer is wrapped: tf-keras's
    ``LossScaleOptimizer`` has fixed knobs (``kmp.compat.keras2.TF_KERAS_RULE``) and no
    ``max_scale`` (its default there means tf-keras's unbounded scale), tf-keras takes no
    ``bucket_bytes``, and ``master_weights`` / ``rounding_seed`` are Keras 3's only.

    Attributes:
        loss_scale: ``"dynamic"`` (default): dynamic scaling when the global dtype policy
            computes in float16 when the optimizer is wrapped, none otherwise (also in a
            TF1 graph: call ``kmp.enable("mixed_float16")`` there, or pass
            ``"force_dynamic"``). ``"force_dynamic"``: dynamic scaling under any policy.
            A positive number: a static scale. None: no scaling. Or a
            :class:`kmp.loss_scale.LossScale`, the rule itself (then the knobs below, if
            set, must agree with it).
        initial_scale: The first dynamic scale (``2**15``).
        growth_interval: Finite steps in a row after which a dynamic scale grows (2000).
        growth_factor: What the scale is multiplied by when it grows (2.0, > 1).
        backoff_factor: What it is multiplied by on an overflow (0.5, in (0, 1)).
        min_scale: The lowest dynamic scale (1.0).
        max_scale: The highest dynamic scale (``2**24``; tf-keras: no bound).
        hysteresis: Overflowing steps in a row skipped before the scale backs off (1).
            Every overflowing step is skipped and counted either way.
        underflow_threshold: A dynamic scale also grows early when more than this share
            of the averaged gradient values are float16 subnormals once scaled, and the
            grown scale keeps :func:`kmp.probe`'s headroom (0.01; None: overflow alone
            moves the scale, Keras's and PyTorch's rule). tf-keras: None only.
        underflow_patience: Finite steps since the scale last moved before underflow may
            grow it (100).
        compression: None (default), ``"fp16"`` or ``"bf16"``: the dtype gradients travel
            in (Horovod's ``hvd.Compression`` classes are read as these; a custom one
            reaches the tf-keras path only).
        backward_passes_per_step: Micro-batches accumulated locally per update (1). A
            window with a non-finite micro-batch is skipped as a whole.
        scale_lr: Multiply the learning rate by the number of ranks (False).
        bucket_bytes: Reduce gradients in buckets of about this many bytes, last layer
            first, overlapping the backward pass
            (:data:`kmp.distributed.buckets.DEFAULT_BUCKET_BYTES`); None: one grouped
            allreduce.
        sparse_gradients: How sparse gradients (``Embedding``'s on TensorFlow) travel:
            ``"gather"`` (default) allgathers rows and indices, ``"dense"`` scatters them
            into their variable's shape (:mod:`kmp.distributed.sparse`).
        master_weights: How updates reach 16-bit weights (:mod:`kmp.master_weights`):
            ``"auto"`` (default; ``"kahan"`` for 16-bit weights, exact for float32 ones),
            ``"kahan"``, ``"stochastic"``, ``"none"`` or ``"float32"``. Keras 3 only.
        rounding_seed: The seed of stochastic rounding (0). Keras 3 only.

    Raises:
        TypeError: A field of the wrong type.
        ValueError: A field out of range or unknown, or knobs that disagree with a
            ``LossScale`` given as ``loss_scale``.
    """

    loss_scale: str | float | _ls.LossScale | None = dataclasses.field(
        default="dynamic", metadata=_check(_check_loss_scale)
    )
    initial_scale: float = dataclasses.field(
        default=_ls.DEFAULTS["initial_scale"], metadata=_knob("initial_scale")
    )
    growth_interval: int = dataclasses.field(
        default=_ls.DEFAULTS["growth_interval"], metadata=_knob("growth_interval")
    )
    growth_factor: float = dataclasses.field(
        default=_ls.DEFAULTS["growth_factor"], metadata=_knob("growth_factor")
    )
    backoff_factor: float = dataclasses.field(
        default=_ls.DEFAULTS["backoff_factor"], metadata=_knob("backoff_factor")
    )
    min_scale: float = dataclasses.field(
        default=_ls.DEFAULTS["min_scale"], metadata=_knob("min_scale")
    )
    max_scale: float = dataclasses.field(
        default=_ls.DEFAULTS["max_scale"], metadata=_knob("max_scale")
    )
    hysteresis: int = dataclasses.field(
        default=_ls.DEFAULTS["hysteresis"], metadata=_knob("hysteresis")
    )
    underflow_threshold: float | None = dataclasses.field(
        default=_ls.DEFAULTS["underflow_threshold"], metadata=_knob("underflow_threshold")
    )
    underflow_patience: int = dataclasses.field(
        default=_ls.DEFAULTS["underflow_patience"], metadata=_knob("underflow_patience")
    )
    compression: Any = dataclasses.field(default=None, metadata=_check(_check_compression))
    backward_passes_per_step: int = dataclasses.field(
        default=1,
        metadata=_check(
            functools.partial(_checks.check_int, "backward_passes_per_step", minimum=1)
        ),
    )
    scale_lr: bool = dataclasses.field(
        default=False, metadata=_check(functools.partial(_checks.check_bool, "scale_lr"))
    )
    bucket_bytes: int | None = dataclasses.field(
        default=DEFAULT_BUCKET_BYTES, metadata=_check(check_bucket_bytes)
    )
    sparse_gradients: str = dataclasses.field(
        default=DEFAULT_SPARSE_GRADIENTS, metadata=_check(check_sparse_gradients)
    )
    master_weights: str = dataclasses.field(
        default=_mw.DEFAULT_MASTER_WEIGHTS, metadata=_check(_mw.check_master_weights)
    )
    rounding_seed: int = dataclasses.field(
        default=_mw.DEFAULT_ROUNDING_SEED,
        metadata=_check(functools.partial(_checks.check_int, "rounding_seed", minimum=0)),
    )

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = field.metadata["check"](getattr(self, field.name))
            object.__setattr__(self, field.name, value)
        rule = self.loss_scale
        if isinstance(rule, _ls.LossScale):
            differ = [
                f"{k}={v!r} (the LossScale has {getattr(rule, k)!r})"
                for k, v in self.changed().items()
                if k in _ls.KNOBS and v != getattr(rule, k)
            ]
            if differ:
                raise ValueError(
                    f"loss_scale is a LossScale, which holds the knobs, but {', '.join(differ)} "
                    "was given too: put the knobs in the LossScale, or pass a setting string."
                )

    @staticmethod
    def field_names() -> tuple[str, ...]:
        """Return the names of the settings, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(OptimizerSettings))

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Return every field's default."""
        return {f.name: f.default for f in dataclasses.fields(cls)}

    def values(self) -> dict[str, Any]:
        """Return every field by name (a ``LossScale`` stays one)."""
        return {k: getattr(self, k) for k in self.field_names()}

    def changed(self) -> dict[str, Any]:
        """Return the fields whose value differs from their default."""
        defaults = self.defaults()
        return {k: v for k, v in self.values().items() if v != defaults[k]}

    def with_overrides(self, **overrides: Any) -> OptimizerSettings:
        """Return a copy with ``overrides`` replacing fields (each checked once, here).

        Raises:
            TypeError: A name that is not a field (the message lists the fields), or a
                value of the wrong type.
            ValueError: A value out of range.
        """
        unknown = sorted(set(overrides) - set(self.field_names()))
        if unknown:
            raise TypeError(
                f"Unknown optimizer setting(s) {', '.join(unknown)}; the settings are "
                f"{', '.join(self.field_names())} (kmp.OptimizerSettings)."
            )
        return dataclasses.replace(self, **overrides) if overrides else self

    @classmethod
    def from_arguments(
        cls, settings: OptimizerSettings | None, overrides: Mapping[str, Any]
    ) -> tuple[OptimizerSettings, dict[str, Any]]:
        """The one rule for a wrapper's ``settings=`` and keyword arguments.

        Args:
            settings: An :class:`OptimizerSettings`, or None (all defaults).
            overrides: The wrapper's keyword arguments: fields that replace the
                object's.

        Returns:
            ``(settings, asked)``: the settings to use, and the fields the caller asked
            for (set in ``settings`` other than their default, or overridden), which a
            wrapper honours over what an optimizer it unwraps already has.

        Raises:
            TypeError: ``settings`` is not an :class:`OptimizerSettings`, an override is
                not a field, or a value has the wrong type.
            ValueError: A value out of range.
        """
        if settings is not None and not isinstance(settings, cls):
            raise TypeError(
                f"settings must be a kmp.{cls.__name__} (or None), not "
                f"{type(settings).__name__} {settings!r}; pass the values as keyword "
                f"arguments, or build one: kmp.{cls.__name__}(compression='fp16', ...)."
            )
        chosen = (settings or cls()).with_overrides(**overrides)
        asked = {**chosen.changed(), **{k: getattr(chosen, k) for k in overrides}}
        return chosen, asked

    def loss_scale_rule(self, compute_dtype: str, *, max_scale: float | None = None) -> Any:
        """Resolve the loss scale for ``compute_dtype`` (:func:`kmp.loss_scale.from_setting`).

        Args:
            compute_dtype: The dtype layers compute in, which decides ``"dynamic"``.
            max_scale: A path's own upper bound when ``max_scale`` is at its default
                (tf-keras: float32's largest).

        Returns:
            The validated :class:`~kmp.loss_scale.LossScale`.
        """
        if isinstance(self.loss_scale, _ls.LossScale):
            return self.loss_scale
        knobs = {k: v for k, v in self.changed().items() if k in _ls.KNOBS}  # the rest: defaults
        if max_scale is not None:
            knobs.setdefault("max_scale", max_scale)
        return _ls.from_setting(self.loss_scale, compute_dtype=compute_dtype, **knobs)

    def refuse(self, names: tuple[str, ...], *, path: str, instead: str) -> None:
        """Refuse the fields in ``names`` set to other than their default, on ``path``.

        Args:
            names: The fields ``path`` cannot do (it does their default).
            path: What cannot do them, for the message (``"The tf-keras path"``).
            instead: What to do, for the message.

        Raises:
            ValueError: One of them is set to another value than its default.
        """
        asked = [f"{k}={v!r}" for k, v in self.changed().items() if k in names]
        if asked:
            raise ValueError(f"{path} cannot do {', '.join(asked)}. {instead}")

    def to_config(self) -> dict[str, Any]:
        """Return a JSON-ready dict of the fields that :meth:`from_config` reads back.

        Raises:
            ValueError: ``compression`` is a custom compressor (only the tf-keras path,
                which saves no settings, takes one).
        """
        config = self.values()
        if isinstance(self.loss_scale, _ls.LossScale):
            config["loss_scale"] = {"LossScale": self.loss_scale.to_config()}
        if not (self.compression is None or isinstance(self.compression, str)):
            raise ValueError(
                f"compression={self.compression!r} is a custom compressor, which cannot be "
                "saved; use None, 'fp16' or 'bf16'."
            )
        return config

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> OptimizerSettings:
        """Rebuild from :meth:`to_config` output."""
        config = dict(config)
        rule = config.get("loss_scale")
        if isinstance(rule, Mapping) and "LossScale" in rule:
            config["loss_scale"] = _ls.LossScale.from_config(rule["LossScale"])
        return cls(**config)
