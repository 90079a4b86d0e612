"""``kmp.wrap_optimizer``: loss scaling and Horovod gradient averaging in one fixed order.

One training step with a wrapped optimizer, on every rank::

    loss -> scale_loss (when scaling) -> gradients -> [accumulate N micro-batches]
         -> allreduces of the still-scaled gradients in buckets of ``bucket_bytes``
            (default 4 MiB), last layer first, overlapping the backward pass; one
            grouped allreduce with ``bucket_bytes=None``; optionally sent as fp16/bf16;
            sparse ones (Embedding) densified or allgathered (``sparse_gradients``)
         -> finite check (the same answer on every rank)
         -> unscale and apply, or skip the step and back the scale off (every rank alike)

The wrapped optimizer (:class:`DistributedLossScaleOptimizer`, in
:mod:`kmp.scaling_optimizer`) is a :class:`keras.optimizers.LossScaleOptimizer`,
so ``model.compile(auto_scale_loss=True)`` under ``mixed_float16`` does not
wrap it a second time. It works in ``model.fit`` and in a custom loop::

    opt = kmp.wrap_optimizer(keras.optimizers.Adam(1e-3))
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
        scaled = opt.scale_loss(loss)          # identity when not scaling
    grads = tape.gradient(scaled, model.trainable_variables)
    opt.apply(grads, model.trainable_variables)  # allreduce, check, unscale, apply

The settings are one :class:`kmp.OptimizerSettings` (:mod:`kmp.optimizer_settings`,
which holds their defaults and checks); keyword arguments override its fields.

Who averages depends on the engine (:mod:`kmp.distributed`). Horovod ranks: this
optimizer allreduces, which needs the TensorFlow backend (Horovod's collectives are
TensorFlow ops) and ``jit_compile=False`` (this Horovod build has no XLA kernels). The
JAX engine: Keras's data-parallel distribution averages the gradients inside the
compiled step (``jit_compile=True``), and this optimizer checks, unscales and applies
them (``stateless_apply``). :func:`kmp.xla.step_jit_compile` gives the right
``jit_compile`` for either. On PyTorch a single process gets the loss scaling.
"""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

from kmp import _checks, distributed
from kmp import loss_scale as _ls
from kmp import master_weights as _mw
from kmp._legacy_keras import is_tf_keras_object
from kmp._names import normalize_compression
from kmp.distributed.collectives import check_averaging_runtime
from kmp.learning_rate import ScaledLearningRate, scaled_learning_rate
from kmp.optimizer_settings import OptimizerSettings
from kmp.scaling_optimizer import DistributedLossScaleOptimizer

__all__ = ["DistributedLossScaleOptimizer", "wrap_optimizer"]


def _is_horovod_optimizer(optimizer: Any) -> bool:
    return any(
        (c.__module__ or "").startswith("horovod") or c.__name__ == "_DistributedOptimizer"
        for c in type(optimizer).__mro__
    )


def _check_optimizer(optimizer: Any) -> None:
    if is_tf_keras_object(optimizer):
        raise TypeError(
            f"{type(optimizer).__name__} is a tf-keras (Keras 2) optimizer: wrap it with "
            "kmp.wrap_optimizer (which hands it to kmp.compat.keras2) or "
            "kmp.compat.keras2.wrap_optimizer."
        )
    if _is_horovod_optimizer(optimizer):
        raise ValueError(
            f"{type(optimizer).__name__} is Horovod's DistributedOptimizer, which does not "
            "average gradients under Keras 3. Pass the plain Keras optimizer (for example "
            "keras.optimizers.Adam(1e-3)) to kmp.wrap_optimizer, which averages them itself."
        )
    if isinstance(optimizer, type) and issubclass(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            f"wrap_optimizer needs an optimizer instance, got the class {optimizer.__name__}; "
            f"call it first: kmp.wrap_optimizer({optimizer.__name__}(...))."
        )
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            f"wrap_optimizer needs a Keras 3 optimizer instance such as "
            f"keras.optimizers.Adam(1e-3); got {type(optimizer).__name__} {optimizer!r}."
        )


def resolve_rule(settings: OptimizerSettings) -> _ls.LossScale:
    """The loss-scale rule ``settings`` give under the global policy in force now.

    Raises:
        TypeError: ``compression`` is a custom compressor (the tf-keras path's only).
        ValueError: The policy's weights cannot take ``master_weights``.
    """
    normalize_compression(settings.compression)  # names only: a custom compressor is refused
    policy = keras.config.dtype_policy()
    # The global policy's weights must allow the mode (its layers' weights are checked at build).
    _mw.update_mode(settings.master_weights, policy.variable_dtype)
    return settings.loss_scale_rule(policy.compute_dtype)


def _rewrap_clashes(optimizer: DistributedLossScaleOptimizer, asked: dict[str, Any]) -> list[str]:
    """The asked settings that differ from those ``optimizer`` was made with."""
    have = optimizer.settings.values()
    return [f"{k}={v!r} (it has {have[k]!r})" for k, v in asked.items() if v != have[k]]


def wrap_optimizer(
    optimizer: keras.optimizers.Optimizer,
    settings: OptimizerSettings | None = None,
    **overrides: Any,
) -> keras.optimizers.Optimizer:
    """Return one Keras optimizer that scales the loss and averages gradients over ranks.

    The loss-scale mode is decided here, from the global dtype policy in force
    now: call :func:`kmp.enable` first. The rule is :mod:`kmp.loss_scale`'s. The
    settings are one :class:`kmp.OptimizerSettings` (every field, its default and its
    meaning are described there); keyword arguments override its fields.

    Args:
        optimizer: A Keras 3 optimizer instance, e.g. ``keras.optimizers.Adam(1e-3)``.
            A Keras ``LossScaleOptimizer`` is unwrapped and rewrapped (its scale and
            growth interval are kept unless asked otherwise); an optimizer already
            returned by this function is returned as it is, and asking it for a setting
            that differs is an error. (``kmp.wrap_optimizer`` hands a ``tf_keras``
            optimizer to :func:`kmp.compat.keras2.wrap_optimizer`.)
        settings: A :class:`kmp.OptimizerSettings`; None: the defaults.
        **overrides: Fields of :class:`kmp.OptimizerSettings` that replace those of
            ``settings`` (``loss_scale="force_dynamic"``, ``compression="fp16"``, ...).

    Returns:
        A :class:`DistributedLossScaleOptimizer` (a Keras ``LossScaleOptimizer``) that
        keeps the settings as ``opt.settings``.

    Raises:
        TypeError: ``optimizer`` is not a Keras 3 optimizer instance, ``settings`` is
            not an ``OptimizerSettings``, an override is not a setting, or a value has
            the wrong type.
        ValueError: A value is out of range or unknown, the optimizer is Horovod's own
            ``DistributedOptimizer``, or it is already wrapped with other settings.
        RuntimeError: More than one rank is running on a backend other than TensorFlow.
    """
    chosen, asked = OptimizerSettings.from_arguments(settings, overrides)
    _check_optimizer(optimizer)
    if isinstance(optimizer, DistributedLossScaleOptimizer):
        clashes = _rewrap_clashes(optimizer, asked)
        if clashes:
            raise ValueError(
                "This optimizer is already wrapped by kmp with other settings: "
                f"{', '.join(clashes)}. Wrap its inner optimizer instead: "
                "kmp.wrap_optimizer(opt.inner_optimizer, ...)."
            )
        return optimizer

    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        # Keras's own loss scaling: keep its scale and interval unless asked otherwise. Its
        # scale has no bounds, so it is brought into kmp's [min_scale, max_scale].
        current = min(max(_current_keras_scale(optimizer), chosen.min_scale), chosen.max_scale)
        kept: dict[str, Any] = {}
        if not isinstance(chosen.loss_scale, _ls.LossScale):  # a rule holds its knobs
            kept["growth_interval"] = int(optimizer.dynamic_growth_steps)
            if not _checks.is_real(chosen.loss_scale):  # a static scale needs no start
                kept["initial_scale"] = current
        kept = {k: v for k, v in kept.items() if k not in asked}
        return wrap_optimizer(optimizer.inner_optimizer, chosen.with_overrides(**kept))
    rule = resolve_rule(chosen)
    if getattr(optimizer, "loss_scale_factor", None) is not None:
        raise ValueError(
            f"The optimizer has loss_scale_factor={optimizer.loss_scale_factor}; kmp scales "
            f"the loss itself. Create it without loss_scale_factor and pass "
            f"loss_scale={optimizer.loss_scale_factor} to kmp.wrap_optimizer for a static scale."
        )

    world_size = distributed.size()
    check_averaging_runtime(world_size)
    lr_scale = float(world_size) if chosen.scale_lr else 1.0
    if lr_scale != 1.0:
        optimizer.learning_rate = scaled_learning_rate(
            optimizer._learning_rate,
            lr_scale,
            schedule_type=keras.optimizers.schedules.LearningRateSchedule,
            wrap_schedule=ScaledLearningRate,
        )
    return DistributedLossScaleOptimizer(optimizer, chosen, loss_scale_rule=rule, lr_scale=lr_scale)


def _current_keras_scale(lso: keras.optimizers.LossScaleOptimizer) -> float:
    """The current scale of a Keras LossScaleOptimizer (its initial scale if unbuilt)."""
    if lso.built:
        return float(ops.convert_to_numpy(lso.dynamic_scale))
    return float(lso.initial_scale)
