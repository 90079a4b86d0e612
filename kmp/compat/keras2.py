"""The tf-keras (Keras 2) path: ``TF_USE_LEGACY_KERAS=1`` with the ``tf-keras`` package.

Horovod's own Keras layer (``horovod.tensorflow.keras``) works with Keras 2, so
this path uses it as Horovod documents, with loss scaling outermost::

    LossScaleOptimizer(hvd.DistributedOptimizer(opt))

The loss is scaled first, Horovod averages the (scaled) gradients inside the
wrapped optimizer, and the loss-scale optimizer unscales and checks the
*averaged* gradients, so every rank skips a non-finite step together.

The two Keras versions agree on ``mixed_precision.set_global_policy``,
``mixed_precision.global_policy`` and ``mixed_precision.LossScaleOptimizer(inner,
initial_scale=..., dynamic_growth_steps=...)``: the functions here take the Keras
module (``tf_keras`` or ``keras``) as an argument and call those, rather than
keeping a copy of each path. Keras 3 optimizers are not wrapped here (Horovod's
Keras layer silently fails to average them): use :func:`kmp.wrap_optimizer`.

Example (set ``TF_USE_LEGACY_KERAS=1`` before TensorFlow is imported)::

    import tf_keras
    import kmp
    from kmp.compat import keras2

    kmp.distributed.init()
    keras2.set_global_policy("mixed_float16")
    model = build_model()                       # with tf_keras layers
    model.compile(optimizer=keras2.wrap_optimizer(tf_keras.optimizers.Adam(1e-3)), loss=...)
    model.fit(..., callbacks=[keras2.broadcast_callback(0)])
"""

from __future__ import annotations

import dataclasses
import importlib
from types import ModuleType
from typing import Any

from kmp import _checks
from kmp import loss_scale as _ls
from kmp._imports import optional_import
from kmp._legacy_keras import (
    is_legacy_keras,
    is_tf_keras_object,
    set_legacy_global_policy,
)
from kmp.learning_rate import scaled_learning_rate
from kmp.optimizer_settings import OptimizerSettings

__all__ = ["broadcast_callback", "is_legacy_keras", "set_global_policy", "wrap_optimizer"]

# The loss-scale knobs tf-keras's LossScaleOptimizer has fixed: its scale doubles, halves,
# never drops below 1 and has no upper bound but float32's; it backs off at every overflow.
TF_KERAS_RULE: dict[str, float | None] = {
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "min_scale": 1.0,
    "hysteresis": 1,
    "underflow_threshold": None,  # tf-keras's rule looks at overflow only
}


def _is_tf_keras(module: ModuleType) -> bool:
    return module.__name__.split(".", 1)[0] == "tf_keras"


def _default_module() -> ModuleType:
    if is_legacy_keras():
        return optional_import("tf_keras", feature="the tf-keras (Keras 2) path")
    return importlib.import_module("keras")


def keras_module_for(obj: Any = None) -> ModuleType:
    """Return the Keras module ``obj`` belongs to (``tf_keras`` or ``keras``).

    Args:
        obj: A Keras object (optimizer, layer, model); None asks the environment
            (``tf_keras`` when :func:`is_legacy_keras`, else ``keras``).

    Returns:
        The top-level Keras module.
    """
    if obj is not None:
        if is_tf_keras_object(obj):  # its class or a base class comes from tf_keras
            return importlib.import_module("tf_keras")
        if type(obj).__module__.split(".", 1)[0] == "keras":
            return importlib.import_module("keras")
    return _default_module()


def set_global_policy(name: str, keras_module: ModuleType | None = None) -> Any:
    """Set the global dtype policy of a Keras module (tf-keras by default under legacy Keras).

    ``kmp.enable`` calls this when :func:`is_legacy_keras` is true, so that
    tf-keras layers follow the policy kmp chose.

    Args:
        name: A policy name: ``"float32"``, ``"mixed_float16"``,
            ``"mixed_bfloat16"`` (or the pure ``"float16"``/``"bfloat16"``).
            Resolve ``"auto"`` with :func:`kmp.enable` first.
        keras_module: ``tf_keras`` or ``keras``; None means ``tf_keras`` when
            :func:`is_legacy_keras`, else ``keras``.

    Returns:
        The module's global policy after the change.

    Raises:
        TypeError: ``name`` is not a string.
        ValueError: ``name`` is not a known policy name.
    """
    km = keras_module if keras_module is not None else _default_module()
    return set_legacy_global_policy(name, km)


def _check_compression(compression: Any) -> Any:
    """Return None, "fp16", or a custom Horovod Compression class passed through.

    ``compression`` is an :class:`~kmp.optimizer_settings.OptimizerSettings` field: a
    canonical name, or a custom compressor it let through.
    """
    if compression is not None and not isinstance(compression, str):
        return compression  # a custom Horovod Compression class: only Horovod's layer knows it
    if compression == "bf16":
        raise ValueError(
            "compression='bf16' is not available on the tf-keras path: Horovod's Keras layer "
            "only offers fp16 compression. Use compression='fp16' or None."
        )
    return compression


def _check_optimizer(optimizer: Any, km: ModuleType) -> None:
    if not _is_tf_keras(km):
        raise TypeError(
            f"kmp.compat.keras2.wrap_optimizer is the tf-keras (Keras 2) path, but "
            f"{type(optimizer).__name__} is a Keras {km.__version__} optimizer. Horovod's Keras "
            "layer does not average Keras 3 gradients: use kmp.wrap_optimizer(optimizer) instead."
        )
    bases = [km.optimizers.Optimizer]
    legacy = getattr(km.optimizers, "legacy", None)
    if legacy is not None:
        bases.append(legacy.Optimizer)
    if not isinstance(optimizer, tuple(bases)):
        raise TypeError(
            f"wrap_optimizer takes a tf_keras optimizer (e.g. tf_keras.optimizers.Adam()), not "
            f"{type(optimizer).__module__}.{type(optimizer).__name__}."
        )
    if type(optimizer).__module__.startswith("horovod.") or hasattr(optimizer, "_allreduce_grads"):
        raise ValueError(
            "The optimizer is already a Horovod DistributedOptimizer: pass the plain optimizer."
        )


def _tf_keras_rule(
    chosen: OptimizerSettings, asked: dict[str, Any], km: ModuleType
) -> _ls.LossScale:
    """Resolve the loss-scale setting with kmp's rule; refuse knobs tf-keras cannot honour.

    tf-keras's scale has no upper bound but float32's, so that is the range checked here
    when ``max_scale`` is not given. A ``LossScale`` states every knob: a dynamic one must
    leave its scale unbounded (``max_scale=kmp.loss_scale.FLOAT32_MAX``) and not measure
    underflow (``underflow_threshold=None``). The rule returned is what tf-keras does:
    overflow alone moves its scale.
    """
    compute = km.mixed_precision.global_policy().compute_dtype
    rule = chosen.loss_scale_rule(compute, max_scale=_ls.FLOAT32_MAX)
    if isinstance(chosen.loss_scale, _ls.LossScale):
        asked = rule.knobs()
        if not rule.dynamic or rule.max_scale >= _ls.FLOAT32_MAX:
            asked.pop("max_scale")
    else:
        asked = {k: v for k, v in asked.items() if k in _ls.KNOBS}
    fixed = [
        f"{k}={asked[k]!r} (tf-keras uses {v!r})"
        for k, v in TF_KERAS_RULE.items()
        if k in asked and getattr(rule, k) != v
    ]
    if "max_scale" in asked:
        fixed.append(f"max_scale={asked['max_scale']!r} (tf-keras's scale has no upper bound)")
    if fixed:
        raise ValueError(
            "tf-keras's LossScaleOptimizer, which this path uses with Horovod's Keras layer, "
            f"cannot do {', '.join(fixed)}. Leave these at their defaults, or move the model "
            "to Keras 3 and use kmp.wrap_optimizer, which has every knob."
        )
    return dataclasses.replace(rule, underflow_threshold=None)  # what tf-keras will do


def wrap_optimizer(
    optimizer: Any,
    settings: OptimizerSettings | None = None,
    *,
    keras_module: ModuleType | None = None,
    **overrides: Any,
) -> Any:
    """Wrap a tf-keras optimizer as ``LossScaleOptimizer(hvd.DistributedOptimizer(opt))``.

    Call it after the dtype policy is set (:func:`set_global_policy` or
    ``kmp.enable``) and after ``kmp.distributed.init()``. In a single process
    (no launcher) Horovod is not used and only loss scaling is added. The
    arguments are checked by the same rule as :func:`kmp.wrap_optimizer`
    (:mod:`kmp.loss_scale`); tf-keras's own ``LossScaleOptimizer`` does the
    scaling, so the knobs it has fixed (:data:`TF_KERAS_RULE`) cannot be changed
    here, and its scale has no ``max_scale``. The settings are one
    :class:`kmp.OptimizerSettings`, with keyword arguments overriding its fields, as for
    :func:`kmp.wrap_optimizer`.

    Args:
        optimizer: A ``tf_keras.optimizers`` optimizer (new or legacy). A
            ``LossScaleOptimizer`` is unwrapped and a fresh copy of its inner
            optimizer re-wrapped.
        settings: A :class:`kmp.OptimizerSettings`; None: the defaults. On this path:
            ``loss_scale`` follows the module's global policy (read when this is called);
            a static scale makes tf-keras apply non-finite steps too, unlike
            :func:`kmp.wrap_optimizer`; a ``LossScale`` must have the knobs tf-keras has
            (a dynamic one with ``max_scale=kmp.loss_scale.FLOAT32_MAX`` and
            ``underflow_threshold=None``). ``initial_scale`` must be >= 1 and
            ``growth_interval`` is tf-keras's ``dynamic_growth_steps``;
            ``growth_factor``, ``backoff_factor``, ``min_scale`` and ``hysteresis`` can
            only be tf-keras's (:data:`TF_KERAS_RULE`), and ``underflow_threshold`` only
            None (tf-keras's scale follows overflow alone; left at its default, it is
            turned off here); ``max_scale`` cannot be set (the scale has no upper
            bound). ``compression`` may also be a Horovod ``Compression`` class.
            ``scale_lr`` scales the rate in place (a schedule cannot be scaled here).
            ``bucket_bytes`` can only be None or its default: Horovod's Keras layer
            reduces the gradients itself. ``sparse_gradients="gather"`` lets Horovod
            allgather sparse gradients, uncompressed; ``"dense"`` is its
            ``sparse_as_dense=True`` (always so with ``backward_passes_per_step > 1``).
            ``master_weights`` and ``rounding_seed`` can only be their defaults
            (tf-keras updates weights in their own dtype).
        **overrides: Fields of :class:`kmp.OptimizerSettings` that replace those of
            ``settings``.
        keras_module: ``tf_keras``; None takes the optimizer's own module.

    Returns:
        The optimizer to pass to ``model.compile``.

    Raises:
        TypeError: ``optimizer`` is a Keras 3 optimizer (use ``kmp.wrap_optimizer``)
            or not an optimizer, ``settings`` is not an ``OptimizerSettings``, an
            override is not a setting, or a value has the wrong type.
        ValueError: An already wrapped optimizer, a bad value, or a setting tf-keras
            does not have.
        ImportError: Several processes were launched but Horovod is missing.
    """
    chosen, asked = OptimizerSettings.from_arguments(settings, overrides)
    chosen.refuse(
        ("master_weights", "rounding_seed"),
        path="The tf-keras path (kmp.compat.keras2)",
        instead="kmp's master-weight modes are Keras 3 only: leave these out.",
    )
    km = keras_module if keras_module is not None else keras_module_for(optimizer)
    lso = getattr(getattr(km, "mixed_precision", None), "LossScaleOptimizer", None)
    if lso is not None and isinstance(optimizer, lso):
        # tf-keras lets an optimizer be wrapped by one LossScaleOptimizer only: re-wrap a
        # copy of the inner one (as Horovod's DistributedOptimizer does anyway), keeping its
        # current scale (within tf-keras's floor of 1) and growth interval unless given.
        setting = chosen.loss_scale
        if getattr(optimizer, "dynamic", False) and not (
            _checks.is_real(setting) or isinstance(setting, _ls.LossScale)
        ):
            kept = {
                "initial_scale": max(1.0, float(optimizer.loss_scale)),
                "growth_interval": int(optimizer.dynamic_growth_steps),
            }
            chosen = chosen.with_overrides(**{k: v for k, v in kept.items() if k not in asked})
        inner_opt = optimizer.inner_optimizer
        optimizer = type(inner_opt).from_config(inner_opt.get_config())
    _check_optimizer(optimizer, km)
    rule = _tf_keras_rule(chosen, asked, km)
    passes = chosen.backward_passes_per_step
    as_dense = chosen.sparse_gradients == "dense" or passes > 1
    buckets = asked.get("bucket_bytes")
    if buckets is not None:
        raise ValueError(
            f"bucket_bytes={buckets} is not available on the tf-keras path: Horovod's "
            "Keras layer reduces the gradients itself. Leave bucket_bytes out (or pass None)."
        )
    from kmp import distributed

    comp = _check_compression(chosen.compression)
    distributed.engine()  # a launched job must have called kmp.distributed.init(): says so
    world = distributed.world()
    hvd_keras = None
    if world.horovod:
        hvd_keras = optional_import("horovod.tensorflow.keras", feature="the tf-keras path")
        if comp is None or isinstance(comp, str):
            comp = hvd_keras.Compression.fp16 if comp == "fp16" else hvd_keras.Compression.none
    if chosen.scale_lr:
        raw = getattr(optimizer, "_learning_rate", None)
        optimizer.learning_rate = scaled_learning_rate(
            raw if raw is not None else optimizer.learning_rate,
            world.size,
            schedule_type=km.optimizers.schedules.LearningRateSchedule,
        )
    inner = optimizer
    if hvd_keras is not None:
        inner = hvd_keras.DistributedOptimizer(
            optimizer,
            compression=comp,
            backward_passes_per_step=passes,
            average_aggregated_gradients=True,
            sparse_as_dense=as_dense,
        )
    elif passes > 1:
        raise ValueError(
            "backward_passes_per_step > 1 needs Horovod's gradient aggregation, which runs only "
            "under horovodrun; use 1 in a single process."
        )
    if rule.kind == "none":
        return inner
    if rule.dynamic:
        return km.mixed_precision.LossScaleOptimizer(
            inner, initial_scale=rule.initial_scale, dynamic_growth_steps=rule.growth_interval
        )
    return km.mixed_precision.LossScaleOptimizer(
        inner, dynamic=False, initial_scale=rule.initial_scale
    )


def broadcast_callback(root_rank: int = 0) -> Any:
    """Return Horovod's tf-keras callback that broadcasts rank ``root_rank``'s variables.

    It copies the model's (and optimizer's) variables from ``root_rank`` to all
    ranks after the first batch, so every rank starts from the same weights.

    Args:
        root_rank: The rank whose variables win.

    Returns:
        ``horovod.tensorflow.keras.callbacks.BroadcastGlobalVariablesCallback``; in a
        single process (no launcher), a callback that does nothing.
    """
    from kmp import distributed

    if distributed.engine().name != "horovod":  # refuses a launched job before init()
        return optional_import("tf_keras", feature="the tf-keras path").callbacks.Callback()
    hvd_keras = optional_import("horovod.tensorflow.keras", feature="the tf-keras path")
    return hvd_keras.callbacks.BroadcastGlobalVariablesCallback(root_rank)
