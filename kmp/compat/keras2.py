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

import importlib
import importlib.util
import os
from types import ModuleType
from typing import Any

from kmp._imports import optional_import

__all__ = [
    "LEGACY_KERAS_ENV_VAR",
    "POLICY_NAMES",
    "broadcast_callback",
    "is_legacy_keras",
    "keras_module_for",
    "set_global_policy",
    "wrap_optimizer",
]

LEGACY_KERAS_ENV_VAR = "TF_USE_LEGACY_KERAS"
# The values TensorFlow itself accepts (tensorflow/__init__.py routes tf.keras on these).
_TRUTHY = ("true", "True", "1")
POLICY_NAMES = ("float32", "mixed_float16", "mixed_bfloat16", "float16", "bfloat16")


def is_legacy_keras() -> bool:
    """Return True when ``tf.keras`` is tf-keras (Keras 2) in this process.

    That is: ``TF_USE_LEGACY_KERAS`` is set to a value TensorFlow accepts
    (``1``, ``true``, ``True``) and the ``tf_keras`` package is installed.
    Neither TensorFlow nor tf-keras is imported to find out.
    """
    if os.environ.get(LEGACY_KERAS_ENV_VAR) not in _TRUTHY:
        return False
    try:
        return importlib.util.find_spec("tf_keras") is not None
    except (ImportError, ValueError):
        return False


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
        top = type(obj).__module__.split(".", 1)[0]
        if top == "tf_keras":
            return importlib.import_module("tf_keras")
        if top == "keras":
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
        ValueError: ``name`` is not a known policy name.
    """
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in POLICY_NAMES:
        raise ValueError(
            f"Unknown dtype policy {name!r}; use one of {', '.join(POLICY_NAMES)} (resolve "
            "'auto' with kmp.enable())."
        )
    km = keras_module if keras_module is not None else _default_module()
    km.mixed_precision.set_global_policy(key)
    return km.mixed_precision.global_policy()


def _check_compression(compression: Any) -> Any:
    """Return None, "fp16", or a Horovod Compression class given as such."""
    from kmp import distributed

    if compression is not None and not isinstance(compression, str):
        if hasattr(compression, "compress") and hasattr(compression, "decompress"):
            return compression  # a Horovod Compression class, passed through
        raise TypeError(
            f"compression must be None, 'fp16' or a Horovod Compression class, not {compression!r}."
        )
    name = distributed.normalize_compression(compression)
    if name == "bf16":
        raise ValueError(
            "compression='bf16' is not available on the tf-keras path: Horovod's Keras layer "
            "only offers fp16 compression. Use compression='fp16' or None."
        )
    return name


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


def _check_loss_scale(loss_scale: Any, initial_scale: Any, growth_interval: Any) -> None:
    if loss_scale not in (None, "dynamic", "force_dynamic") and (
        not isinstance(loss_scale, int | float)
        or isinstance(loss_scale, bool)
        or not 0 < loss_scale < float("inf")
    ):
        raise ValueError(
            f"loss_scale must be 'dynamic', 'force_dynamic', None or a positive finite number, "
            f"not {loss_scale!r}."
        )
    if not isinstance(initial_scale, int | float) or not 1 <= initial_scale < float("inf"):
        raise ValueError(f"initial_scale must be a finite number >= 1, not {initial_scale!r}.")
    if (
        not isinstance(growth_interval, int)
        or isinstance(growth_interval, bool)
        or growth_interval < 1
    ):
        raise ValueError(f"growth_interval must be a positive int, not {growth_interval!r}.")


def _scale_learning_rate(optimizer: Any, factor: int, km: ModuleType) -> None:
    schedule = km.optimizers.schedules.LearningRateSchedule
    raw = getattr(optimizer, "_learning_rate", None)
    lr = optimizer.learning_rate
    if isinstance(raw, schedule) or isinstance(lr, schedule):
        raise ValueError(
            "scale_lr=True cannot scale a learning-rate schedule; pass scale_lr=False and build "
            "the schedule with the learning rate multiplied by kmp.distributed.size()."
        )
    value = float(lr.numpy()) if hasattr(lr, "numpy") else float(lr)
    optimizer.learning_rate = value * factor


def wrap_optimizer(
    optimizer: Any,
    *,
    loss_scale: str | float | None = "dynamic",
    initial_scale: float = 2.0**15,
    growth_interval: int = 2000,
    compression: Any = None,
    backward_passes_per_step: int = 1,
    scale_lr: bool = False,
    keras_module: ModuleType | None = None,
) -> Any:
    """Wrap a tf-keras optimizer as ``LossScaleOptimizer(hvd.DistributedOptimizer(opt))``.

    Call it after the dtype policy is set (:func:`set_global_policy` or
    ``kmp.enable``) and after ``kmp.distributed.init()``. In a single process
    (no launcher) Horovod is not used and only loss scaling is added.

    Args:
        optimizer: A ``tf_keras.optimizers`` optimizer (new or legacy). A
            ``LossScaleOptimizer`` is unwrapped and a fresh copy of its inner
            optimizer re-wrapped.
        loss_scale: ``"dynamic"`` (default): dynamic loss scaling when the
            module's global policy computes in float16 (read when this is
            called), none otherwise; ``"force_dynamic"``: dynamic scaling under
            any policy; a positive number: a fixed loss scale (tf-keras then
            applies non-finite steps too, unlike :func:`kmp.wrap_optimizer`);
            None: no loss scaling.
        initial_scale: The first dynamic loss scale.
        growth_interval: Finite steps in a row before the dynamic scale doubles
            (``dynamic_growth_steps``).
        compression: None, ``"fp16"``, or a Horovod ``Compression`` class.
        backward_passes_per_step: Batches whose gradients are accumulated locally
            (and averaged) before one allreduce and update.
        scale_lr: Multiply the learning rate by the number of ranks (in place,
            before wrapping).
        keras_module: ``tf_keras``; None takes the optimizer's own module.

    Returns:
        The optimizer to pass to ``model.compile``.

    Raises:
        TypeError: ``optimizer`` is a Keras 3 optimizer (use ``kmp.wrap_optimizer``)
            or not an optimizer.
        ValueError: An already wrapped optimizer or a bad argument.
        ImportError: Several processes were launched but Horovod is missing.
    """
    km = keras_module if keras_module is not None else keras_module_for(optimizer)
    lso = getattr(getattr(km, "mixed_precision", None), "LossScaleOptimizer", None)
    if lso is not None and isinstance(optimizer, lso):
        # tf-keras lets an optimizer be wrapped by one LossScaleOptimizer only: re-wrap a
        # copy of the inner one (as Horovod's DistributedOptimizer does anyway).
        inner_opt = optimizer.inner_optimizer
        optimizer = type(inner_opt).from_config(inner_opt.get_config())
    _check_optimizer(optimizer, km)
    _check_loss_scale(loss_scale, initial_scale, growth_interval)
    if (
        not isinstance(backward_passes_per_step, int)
        or isinstance(backward_passes_per_step, bool)
        or backward_passes_per_step < 1
    ):
        raise ValueError(
            f"backward_passes_per_step must be a positive int, not {backward_passes_per_step!r}."
        )
    if not isinstance(scale_lr, bool):
        raise TypeError(f"scale_lr must be True or False, not {scale_lr!r}.")
    from kmp import distributed

    comp = _check_compression(compression)
    world = distributed.init()
    hvd_keras = None
    if world.horovod:
        hvd_keras = optional_import("horovod.tensorflow.keras", feature="the tf-keras path")
        if comp is None or isinstance(comp, str):
            comp = hvd_keras.Compression.fp16 if comp == "fp16" else hvd_keras.Compression.none
    if scale_lr:
        _scale_learning_rate(optimizer, world.size, km)
    inner = optimizer
    if hvd_keras is not None:
        inner = hvd_keras.DistributedOptimizer(
            optimizer,
            compression=comp,
            backward_passes_per_step=backward_passes_per_step,
            average_aggregated_gradients=True,
        )
    elif backward_passes_per_step > 1:
        raise ValueError(
            "backward_passes_per_step > 1 needs Horovod's gradient aggregation, which runs only "
            "under horovodrun; use 1 in a single process."
        )
    policy = km.mixed_precision.global_policy()
    if loss_scale is None or (loss_scale == "dynamic" and policy.compute_dtype != "float16"):
        return inner
    if loss_scale in ("dynamic", "force_dynamic"):
        return km.mixed_precision.LossScaleOptimizer(
            inner, initial_scale=float(initial_scale), dynamic_growth_steps=growth_interval
        )
    return km.mixed_precision.LossScaleOptimizer(
        inner, dynamic=False, initial_scale=float(loss_scale)
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

    if not distributed.init().horovod:
        return optional_import("tf_keras", feature="the tf-keras path").callbacks.Callback()
    hvd_keras = optional_import("horovod.tensorflow.keras", feature="the tf-keras path")
    return hvd_keras.callbacks.BroadcastGlobalVariablesCallback(root_rank)
