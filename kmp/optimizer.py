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
which holds their defaults); the keyword arguments are its fields.

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
from kmp._names import LOSS_SCALE_MODES, normalize_compression
from kmp.learning_rate import ScaledLearningRate, scaled_learning_rate
from kmp.optimizer_settings import DEFAULTS, OptimizerSettings
from kmp.scaling_optimizer import DistributedLossScaleOptimizer

__all__ = [
    "DEFAULTS",
    "LOSS_SCALE_MODES",
    "DistributedLossScaleOptimizer",
    "OptimizerSettings",
    "ScaledLearningRate",
    "wrap_optimizer",
]

NOT_GIVEN = _checks.NOT_GIVEN
# The settings DistributedLossScaleOptimizer takes as they are (the knobs are in the rule).
_CONSTRUCTOR_FIELDS = (
    "compression",
    "backward_passes_per_step",
    "scale_lr",
    "bucket_bytes",
    "sparse_gradients",
    "master_weights",
    "rounding_seed",
)


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


def _requested(chosen: OptimizerSettings) -> tuple[_ls.LossScale, dict[str, Any]]:
    """The rule and every setting (defaults filled in) for the Keras 3 path, checked."""
    settings = chosen.resolved()
    settings["compression"] = normalize_compression(settings["compression"])  # names only
    # The global policy's weights must allow the mode (its layers' weights are checked at build).
    _mw.update_mode(settings["master_weights"], keras.config.dtype_policy().variable_dtype)
    rule = chosen.loss_scale_rule(keras.config.dtype_policy().compute_dtype)
    if isinstance(settings["loss_scale"], _ls.LossScale):
        settings["loss_scale"] = rule.setting  # what the config saves
    settings.update(rule.knobs())
    return rule, settings


def _rewrap_clashes(optimizer: DistributedLossScaleOptimizer, given: dict[str, Any]) -> list[str]:
    """The explicitly given settings that differ from those ``optimizer`` was made with.

    What is not given is taken from ``optimizer`` itself, so only the given
    values are judged (and checked). A ``LossScale`` is compared with its rule whole.
    """
    rule = given.get("loss_scale")
    if isinstance(rule, _ls.LossScale):
        have_rule = optimizer.loss_scale_rule
        rest = {k: v for k, v in given.items() if k != "loss_scale" and k not in _ls.KNOBS}
        clash = [] if rule == have_rule else [f"loss_scale={rule!r} (it has {have_rule!r})"]
        return clash + _rewrap_clashes(optimizer, rest)
    have = optimizer.settings()
    _, wanted = _requested(OptimizerSettings(**{**have, **given}))
    return [f"{k}={wanted[k]!r} (it has {have[k]!r})" for k in given if wanted[k] != have[k]]


def wrap_optimizer(
    optimizer: keras.optimizers.Optimizer,
    *,
    settings: OptimizerSettings | None = None,
    loss_scale: str | float | _ls.LossScale | None = NOT_GIVEN,
    initial_scale: float = NOT_GIVEN,
    growth_interval: int = NOT_GIVEN,
    growth_factor: float = NOT_GIVEN,
    backoff_factor: float = NOT_GIVEN,
    min_scale: float = NOT_GIVEN,
    max_scale: float = NOT_GIVEN,
    hysteresis: int = NOT_GIVEN,
    compression: str | None = NOT_GIVEN,
    backward_passes_per_step: int = NOT_GIVEN,
    scale_lr: bool = NOT_GIVEN,
    bucket_bytes: int | None = NOT_GIVEN,
    sparse_gradients: str = NOT_GIVEN,
    master_weights: str = NOT_GIVEN,
    rounding_seed: int = NOT_GIVEN,
) -> keras.optimizers.Optimizer:
    """Return one Keras optimizer that scales the loss and averages gradients over ranks.

    The loss-scale mode is decided here, from the global dtype policy in force
    now: call :func:`kmp.enable` first. The rule is :mod:`kmp.loss_scale`'s. The
    settings are a :class:`kmp.OptimizerSettings` (``settings=``), the keyword
    arguments below, or both: they combine, and a field given both ways must agree
    (:meth:`OptimizerSettings.combine`). A field given neither way takes its default,
    :data:`kmp.optimizer_settings.DEFAULTS`.

    Args:
        optimizer: A Keras 3 optimizer instance, e.g. ``keras.optimizers.Adam(1e-3)``.
            A Keras ``LossScaleOptimizer`` is unwrapped and rewrapped (its scale and
            growth interval are kept unless given); an optimizer already returned
            by this function is returned as it is, and giving it a setting that
            differs is an error. (``kmp.wrap_optimizer`` hands a ``tf_keras``
            optimizer to :func:`kmp.compat.keras2.wrap_optimizer`.)
        settings: An :class:`kmp.OptimizerSettings` holding any of the fields below.
        loss_scale: ``"dynamic"`` (default): dynamic loss scaling when the global
            dtype policy computes in float16, none for bfloat16 and float32.
            ``"force_dynamic"``: dynamic scaling under any policy. A positive
            number: a static scale (non-finite steps are still skipped). None:
            no loss scaling. A :class:`kmp.loss_scale.LossScale`: that rule, as it
            is (knobs given too must agree with it).
        initial_scale: Starting dynamic scale (default ``2**15``), within
            ``[min_scale, max_scale]``.
        growth_interval: Finite steps in a row after which a dynamic scale grows
            (default 2000).
        growth_factor: What the scale is multiplied by when it grows (default 2.0, > 1).
        backoff_factor: What it is multiplied by on an overflow (default 0.5, in (0, 1)).
        min_scale: The scale never goes below this (default 1.0).
        max_scale: The scale never goes above this (default ``2**24``).
        hysteresis: Overflowing steps in a row that are skipped before the scale
            backs off (default 1: back off at every overflow). Every overflowing
            step is skipped and counted either way.
        compression: None (default), ``"fp16"`` or ``"bf16"``: the dtype gradients
            travel in through the allreduce (half the bytes of float32).
        backward_passes_per_step: Accumulate this many micro-batches locally, then
            average them, allreduce once and update (default 1). A window with a
            non-finite micro-batch is skipped as a whole.
        scale_lr: Multiply the learning rate by the number of ranks (default False).
        bucket_bytes: Reduce the gradients in buckets of about this many bytes, last
            layer first, so that communication overlaps the backward pass (default
            :data:`kmp.distributed.buckets.DEFAULT_BUCKET_BYTES`); None: one grouped
            allreduce after all gradients exist.
        sparse_gradients: How sparse gradients (``tf.IndexedSlices``, from
            ``Embedding`` and ``gather`` on the TensorFlow backend) travel between
            ranks. ``"gather"`` (default, the faster one measured in
            ``docs/performance.md``): every rank's rows and their indices are
            allgathered (the values compressed too) and the values divided by the
            number of ranks, as Horovod's ``DistributedOptimizer`` does; the bytes grow
            with the tokens per batch and the number of ranks. ``"dense"``: they are
            scattered into tensors of their variable's shape and allreduced with the
            other gradients (in buckets, compressed); the bytes are the whole
            embedding's, whatever the batch. Both keep the ranks bit-identical (Adam-like
            updates differ slightly where rows repeat: Keras's sparse update treats each
            gathered row on its own, the dense one their sum). With
            ``backward_passes_per_step > 1`` the accumulated window is dense and
            travels dense. JAX gradients are dense: the setting changes nothing there.
        master_weights: How updates reach 16-bit (bfloat16 or float16) weights, such as
            those of ``kmp.enable("bfloat16")`` or a KerasHub model loaded with
            ``dtype="bfloat16"`` (:mod:`kmp.master_weights`). ``"auto"`` (default):
            ``"kahan"`` for 16-bit weights; float32 weights (every mixed policy) are
            updated exactly as always. ``"kahan"``: a 16-bit compensation buffer per
            weight carries what each rounding lost into the next update (2 bytes more
            per weight). ``"stochastic"``: bfloat16 weights rounded up or down at random
            without bias (no extra memory; the same bits on every rank). ``"none"``:
            round to nearest (updates below half a bfloat16 step, about ``2**-9`` of the
            weight, are lost). ``"float32"``: require float32 weights (an error for
            16-bit ones). The optimizer's slots take the weights' dtype; under "kahan"
            and "stochastic" their updates are rounded stochastically too.
        rounding_seed: The seed of the stochastic rounding (default 0): the same seed
            and data give the same run.

    Returns:
        A :class:`DistributedLossScaleOptimizer` (a Keras ``LossScaleOptimizer``).

    Raises:
        TypeError: ``optimizer`` is not a Keras 3 optimizer instance, ``settings`` is
            not an ``OptimizerSettings``, or an argument has the wrong type.
        ValueError: An argument is out of range or unknown, a field is given in
            ``settings`` and as a keyword with different values, the optimizer is
            Horovod's own ``DistributedOptimizer``, or it is already wrapped with
            different settings.
        RuntimeError: More than one rank is running on a backend other than TensorFlow.
    """
    chosen = OptimizerSettings.combine(settings, locals())  # the fields among the arguments
    given = chosen.given()
    _check_optimizer(optimizer)
    if isinstance(optimizer, DistributedLossScaleOptimizer):
        clashes = _rewrap_clashes(optimizer, given)
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
        low = given.get("min_scale", DEFAULTS["min_scale"])
        high = given.get("max_scale", DEFAULTS["max_scale"])
        current = min(max(_current_keras_scale(optimizer), low), high)
        if not isinstance(given.get("loss_scale"), _ls.LossScale):  # a rule holds its knobs
            if not _checks.is_real(given.get("loss_scale")):  # a static scale needs no start
                given.setdefault("initial_scale", current)
            given.setdefault("growth_interval", int(optimizer.dynamic_growth_steps))
        return wrap_optimizer(optimizer.inner_optimizer, settings=OptimizerSettings(**given))
    rule, full = _requested(chosen)
    if getattr(optimizer, "loss_scale_factor", None) is not None:
        raise ValueError(
            f"The optimizer has loss_scale_factor={optimizer.loss_scale_factor}; kmp scales "
            f"the loss itself. Create it without loss_scale_factor and pass "
            f"loss_scale={optimizer.loss_scale_factor} to kmp.wrap_optimizer for a static scale."
        )

    world_size = distributed.size()
    distributed.check_averaging_runtime(world_size)
    lr_scale = float(world_size) if full["scale_lr"] else 1.0
    if lr_scale != 1.0:
        optimizer.learning_rate = scaled_learning_rate(
            optimizer._learning_rate,
            lr_scale,
            schedule_type=keras.optimizers.schedules.LearningRateSchedule,
            wrap_schedule=ScaledLearningRate,
        )
    return DistributedLossScaleOptimizer(
        optimizer,
        rule,
        loss_scale=full["loss_scale"],
        lr_scale=lr_scale,
        **{k: full[k] for k in _CONSTRUCTOR_FIELDS},
    )


def _current_keras_scale(lso: keras.optimizers.LossScaleOptimizer) -> float:
    """The current scale of a Keras LossScaleOptimizer (its initial scale if unbuilt)."""
    if lso.built:
        return float(ops.convert_to_numpy(lso.dynamic_scale))
    return float(lso.initial_scale)
