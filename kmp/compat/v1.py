"""Helpers for TF1 (``tf.compat.v1``) graph-mode Horovod scripts.

The canonical Horovod TF1 script builds a ``ConfigProto`` by hand, a session
from it, and wraps its optimizer in ``hvd.DistributedOptimizer``. With kmp::

    import tensorflow as tf
    import kmp
    from kmp.compat import v1 as kv1

    tf.compat.v1.disable_eager_execution()
    world = kmp.distributed.init()
    ...  # build the graph: loss = ...
    opt = kv1.distributed_optimizer(
        tf.compat.v1.train.AdamOptimizer(1e-3), loss_scale="dynamic", scale_lr=True
    )
    train_op = opt.minimize(loss, global_step=tf.compat.v1.train.get_or_create_global_step())
    bcast = kv1.broadcast_global_variables(root=0)
    with kv1.session(mixed_precision="float16") as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(bcast)
        ...

Mixed precision for graphs: TensorFlow 2.21 still ships Grappler's automatic
mixed precision rewrite, switched on per session in the ``ConfigProto``
(``session_config(mixed_precision="float16")`` on NVIDIA GPUs,
``"bfloat16"`` on CPUs with oneDNN). The global
``tf.compat.v1.mixed_precision.enable_mixed_precision_graph_rewrite`` still
exists but is deprecated; it wraps the optimizer in TensorFlow's own
``MixedPrecisionLossScaleOptimizer``, which kmp replaces with ``loss_scale=`` here
so that the Horovod allreduce and the loss-scale check run in one fixed order.
"""

from __future__ import annotations

import warnings
from typing import Any

import tensorflow as tf
from tensorflow.core.protobuf import rewriter_config_pb2

from kmp import gpu as _gpu

__all__ = [
    "MIXED_PRECISION_REWRITES",
    "DistributedOptimizer",
    "broadcast_global_variables",
    "build_session_config",
    "distributed_optimizer",
    "session",
    "session_config",
]

_v1 = tf.compat.v1

# session_config(mixed_precision=...) -> the RewriterConfig field it switches on.
MIXED_PRECISION_REWRITES: dict[str, str] = {
    "float16": "auto_mixed_precision",  # NVIDIA GPUs (compute capability >= 7.0)
    "bfloat16": "auto_mixed_precision_onednn_bfloat16",  # CPUs, needs oneDNN
}


# ------------------------------------------------------------------ ConfigProto


def _check_threads(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(
            f"{name} must be a non-negative int (0 lets TensorFlow choose) or None, not {value!r}."
        )
    return value


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, not {value!r}.")
    return value


def _check_mixed_precision(value: Any) -> str | None:
    if value is None:
        return None
    name = value.strip().lower() if isinstance(value, str) else value
    name = {"mixed_float16": "float16", "mixed_bfloat16": "bfloat16"}.get(name, name)
    if name not in MIXED_PRECISION_REWRITES:
        raise ValueError(
            f"mixed_precision={value!r} is not understood; use None, 'float16' (NVIDIA GPUs) or "
            "'bfloat16' (CPUs with oneDNN)."
        )
    return name


def build_session_config(
    allow_growth: bool = True,
    memory_fraction: float | None = None,
    visible_devices: _gpu.Visible | None = "local_rank",
    allow_soft_placement: bool = True,
    log_device_placement: bool = False,
    intra_op_threads: int | None = None,
    inter_op_threads: int | None = None,
    *,
    mixed_precision: str | None = None,
    n_gpus: int,
    local_rank: int | None,
) -> Any:
    """Build the ``ConfigProto`` of :func:`session_config` for a described machine.

    The pure part of :func:`session_config`: the GPU count and local rank are
    given instead of detected, so every decision can be checked without a GPU.

    Args:
        allow_growth: As for :func:`session_config`.
        memory_fraction: As for :func:`session_config`.
        visible_devices: As for :func:`session_config`.
        allow_soft_placement: As for :func:`session_config`.
        log_device_placement: As for :func:`session_config`.
        intra_op_threads: As for :func:`session_config`.
        inter_op_threads: As for :func:`session_config`.
        mixed_precision: As for :func:`session_config`.
        n_gpus: How many GPUs the process sees.
        local_rank: The Horovod local rank, or None in a single process.

    Returns:
        A ``tf.compat.v1.ConfigProto``.
    """
    allow_growth = _check_bool("allow_growth", allow_growth)
    allow_soft_placement = _check_bool("allow_soft_placement", allow_soft_placement)
    log_device_placement = _check_bool("log_device_placement", log_device_placement)
    if memory_fraction is not None and (
        not isinstance(memory_fraction, int | float)
        or isinstance(memory_fraction, bool)
        or not 0.0 < memory_fraction <= 1.0
    ):
        raise ValueError(
            f"memory_fraction must be a fraction of each GPU's memory in (0, 1], e.g. 0.9, not "
            f"{memory_fraction!r}; pass None to let allow_growth decide."
        )
    intra = _check_threads("intra_op_threads", intra_op_threads)
    inter = _check_threads("inter_op_threads", inter_op_threads)
    mp = _check_mixed_precision(mixed_precision)
    if visible_devices is None:
        indices: tuple[int, ...] = ()
    else:
        indices, _ = _gpu.resolve_visible(
            visible_devices, n_gpus, local_rank, what="visible_devices"
        )

    config = _v1.ConfigProto()
    config.allow_soft_placement = allow_soft_placement
    config.log_device_placement = log_device_placement
    config.gpu_options.allow_growth = allow_growth
    if memory_fraction is not None:
        config.gpu_options.per_process_gpu_memory_fraction = float(memory_fraction)
    # All GPUs are TF1's default: only a real subset is written down.
    if indices and len(indices) < n_gpus:
        config.gpu_options.visible_device_list = ",".join(str(i) for i in indices)
    if intra is not None:
        config.intra_op_parallelism_threads = intra
    if inter is not None:
        config.inter_op_parallelism_threads = inter
    if mp is not None:
        setattr(
            config.graph_options.rewrite_options,
            MIXED_PRECISION_REWRITES[mp],
            rewriter_config_pb2.RewriterConfig.ON,
        )
    return config


def _onednn_enabled() -> bool | None:
    try:
        from tensorflow.python.util import _pywrap_util_port
    except ImportError:  # pragma: no cover - private module moved
        return None
    return bool(_pywrap_util_port.IsMklEnabled())


def session_config(
    allow_growth: bool = True,
    memory_fraction: float | None = None,
    visible_devices: _gpu.Visible | None = "local_rank",
    allow_soft_placement: bool = True,
    log_device_placement: bool = False,
    intra_op_threads: int | None = None,
    inter_op_threads: int | None = None,
    *,
    mixed_precision: str | None = None,
) -> Any:
    """Return the ``tf.compat.v1.ConfigProto`` a Horovod TF1 script needs.

    Replaces the hand-written ``config.gpu_options.allow_growth = True``,
    ``per_process_gpu_memory_fraction`` and
    ``visible_device_list = str(hvd.local_rank())`` lines.

    Args:
        allow_growth: ``gpu_options.allow_growth``: take GPU memory as needed.
        memory_fraction: ``gpu_options.per_process_gpu_memory_fraction``, in
            (0, 1]; None leaves TensorFlow's default.
        visible_devices: ``"local_rank"`` (default): under a launcher, the GPU
            whose index is this process's local rank; in a single process, all.
            ``"all"``, an index or a list of indices select GPUs explicitly;
            None leaves ``visible_device_list`` empty. Written to
            ``gpu_options.visible_device_list`` only when it picks a subset.
        allow_soft_placement: Fall back to the CPU for ops with no GPU kernel.
        log_device_placement: Log where each op runs.
        intra_op_threads: ``intra_op_parallelism_threads`` (None: TF's default).
        inter_op_threads: ``inter_op_parallelism_threads`` (None: TF's default).
        mixed_precision: None, ``"float16"`` (Grappler's automatic mixed precision
            rewrite for NVIDIA GPUs, ``rewrite_options.auto_mixed_precision``; use
            it with ``distributed_optimizer(..., loss_scale="dynamic")``) or
            ``"bfloat16"`` (``auto_mixed_precision_onednn_bfloat16``, CPUs with
            oneDNN: set ``TF_ENABLE_ONEDNN_OPTS=1`` before importing TensorFlow).

    Returns:
        A ``tf.compat.v1.ConfigProto``.

    Raises:
        ValueError: ``memory_fraction`` outside (0, 1], a GPU index beyond the GPUs
            present, a local rank with no GPU of its own, negative thread counts,
            or an unknown ``mixed_precision``.
        RuntimeError: ``mixed_precision="bfloat16"`` while TensorFlow runs without
            oneDNN (the rewrite would silently do nothing).

    Warns:
        UserWarning: ``mixed_precision="float16"`` with no GPU: the rewrite only
            converts GPU ops, so the graph stays float32.
    """
    physical = tf.config.list_physical_devices("GPU")
    needs_rank = (
        isinstance(visible_devices, str) and visible_devices.strip().lower() == "local_rank"
    )
    local_rank = _gpu._current_local_rank() if needs_rank and physical else None
    config = build_session_config(
        allow_growth,
        memory_fraction,
        visible_devices,
        allow_soft_placement,
        log_device_placement,
        intra_op_threads,
        inter_op_threads,
        mixed_precision=mixed_precision,
        n_gpus=len(physical),
        local_rank=local_rank,
    )
    mp = _check_mixed_precision(mixed_precision)
    if mp == "bfloat16" and _onednn_enabled() is False:
        raise RuntimeError(
            "mixed_precision='bfloat16' uses Grappler's oneDNN bfloat16 rewrite, but this "
            "TensorFlow runs without oneDNN, so the graph would silently stay float32. Set "
            "TF_ENABLE_ONEDNN_OPTS=1 in the environment before TensorFlow is imported, or use "
            "mixed_precision=None."
        )
    if mp == "float16" and not physical:
        warnings.warn(
            "mixed_precision='float16' turns on Grappler's float16 rewrite, which only converts "
            "ops placed on NVIDIA GPUs (compute capability >= 7.0); this process sees no GPU, so "
            "the graph stays float32 here (loss scaling still runs).",
            UserWarning,
            stacklevel=2,
        )
    return config


def session(
    config: Any | None = None,
    *,
    graph: Any | None = None,
    target: str = "",
    **config_kwargs: Any,
) -> Any:
    """Return a ``tf.compat.v1.Session`` built from kmp's config.

    Args:
        config: A ``ConfigProto``; None builds one with :func:`session_config`.
        graph: The graph to run (default: the default graph).
        target: The execution engine to connect to (``""``: in-process).
        **config_kwargs: Arguments for :func:`session_config` when ``config`` is None.

    Returns:
        A ``tf.compat.v1.Session`` (use it in a ``with`` block).

    Raises:
        TypeError: Both ``config`` and ``session_config`` arguments were given,
            or ``config`` is not a ``ConfigProto``.
    """
    if config is None:
        config = session_config(**config_kwargs)
    elif config_kwargs:
        raise TypeError(
            f"Pass either config= or session_config arguments ({', '.join(config_kwargs)}), "
            "not both: build the config with kmp.compat.v1.session_config(...) and pass it."
        )
    elif not isinstance(config, _v1.ConfigProto):
        raise TypeError(
            f"config must be a tf.compat.v1.ConfigProto (see kmp.compat.v1.session_config), "
            f"not {type(config).__name__}."
        )
    return _v1.Session(target=target, graph=graph, config=config)


# ------------------------------------------------------------------ optimizer


def _normalize_compression(compression: Any) -> str | None:
    """Accept kmp's names and Horovod's ``hvd.Compression.none``/``fp16`` classes."""
    from kmp import distributed

    if compression is not None and not isinstance(compression, str):
        horovod_names = {"NoneCompressor": None, "FP16Compressor": "fp16"}
        cls_name = getattr(compression, "__name__", type(compression).__name__)
        if cls_name in horovod_names:
            return horovod_names[cls_name]
    return distributed.normalize_compression(compression)


def _grad_values(g: Any) -> Any:
    return g.values if isinstance(g, tf.IndexedSlices) else g


def _scale_grad(g: Any, factor: Any) -> Any:
    if g is None:
        return None
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(
            g.values * tf.cast(factor, g.values.dtype), g.indices, g.dense_shape
        )
    return g * tf.cast(factor, g.dtype)


class DistributedOptimizer(_v1.train.Optimizer):
    """A ``tf.compat.v1.train`` optimizer with Horovod averaging and loss scaling.

    Create it with :func:`distributed_optimizer`. One training step runs, in
    this order: scale the loss; compute the gradients with the wrapped
    optimizer; average them over all ranks with one grouped Horovod allreduce;
    unscale; check that every gradient is finite (all ranks see the same
    averaged values, so they all decide alike); apply them, or skip the step
    and halve the loss scale (dynamic scaling only).
    """

    def __init__(
        self,
        optimizer: Any,
        *,
        loss_scale: str | float | None,
        initial_scale: float,
        growth_interval: int,
        compression: str | None,
        name: str | None = None,
    ) -> None:
        super().__init__(
            use_locking=optimizer._use_locking, name=name or f"Distributed{optimizer.get_name()}"
        )
        self._optimizer = optimizer
        self._compression = compression
        self._dynamic = loss_scale == "dynamic"
        self._fixed_scale = None if loss_scale in (None, "dynamic") else float(loss_scale)
        self._initial_scale = float(initial_scale)
        self._growth_interval = int(growth_interval)
        self._scale_vars: dict[Any, tuple[Any, Any]] = {}  # graph -> (scale, good_steps)
        self._track_trackable(optimizer, "base_optimizer")

    # ---- loss scale state
    @property
    def optimizer(self) -> Any:
        """The wrapped ``tf.compat.v1.train`` optimizer."""
        return self._optimizer

    @property
    def dynamic(self) -> bool:
        """True when the loss scale adapts (``loss_scale="dynamic"``)."""
        return self._dynamic

    def _state(self) -> tuple[Any, Any]:
        key = None if tf.executing_eagerly() else _v1.get_default_graph()
        if key not in self._scale_vars:
            with tf.init_scope(), tf.name_scope(self.get_name()):
                scale = _v1.Variable(
                    self._initial_scale, trainable=False, dtype=tf.float32, name="loss_scale"
                )
                good = _v1.Variable(0, trainable=False, dtype=tf.int64, name="good_steps")
            self._scale_vars[key] = (scale, good)
        return self._scale_vars[key]

    @property
    def loss_scale(self) -> Any:
        """The current loss scale: a variable (dynamic), a constant (fixed), or None."""
        if self._dynamic:
            return self._state()[0]
        if self._fixed_scale is not None:
            return tf.constant(self._fixed_scale, tf.float32)
        return None

    def _current_scale(self) -> Any:
        if self._dynamic:
            return tf.identity(self._state()[0])
        return tf.constant(self._fixed_scale, tf.float32)

    # ---- the step
    def compute_gradients(self, loss: Any, var_list: Any = None, **kwargs: Any) -> list:
        """Scale ``loss``, compute gradients, average them over ranks, and unscale them.

        Args:
            loss: The loss tensor (or, eagerly, a callable returning it).
            var_list: Variables to differentiate (default: trainable variables).
            **kwargs: Passed to the wrapped optimizer's ``compute_gradients``.

        Returns:
            A list of ``(gradient, variable)`` pairs, identical on every rank.
        """
        from kmp import distributed

        scaling = self._dynamic or self._fixed_scale is not None
        scale = self._current_scale() if scaling else None
        if scaling:
            if callable(loss):
                user_loss = loss

                def loss() -> Any:
                    value = user_loss()
                    return value * tf.cast(scale, value.dtype)

            else:
                loss = loss * tf.cast(scale, loss.dtype)
        grads_and_vars = self._optimizer.compute_gradients(loss, var_list=var_list, **kwargs)
        grads = [g for g, _ in grads_and_vars]
        variables = [v for _, v in grads_and_vars]
        averaged = distributed.grouped_allreduce(grads, op="average", compression=self._compression)
        if scaling:
            inverse = 1.0 / scale
            averaged = [_scale_grad(g, inverse) for g in averaged]
        return list(zip(averaged, variables, strict=True))

    def apply_gradients(
        self, grads_and_vars: Any, global_step: Any = None, name: str | None = None
    ) -> Any:
        """Apply the (already averaged) gradients, or skip the step if any is not finite.

        With a fixed or no loss scale this is the wrapped optimizer's
        ``apply_gradients``. With dynamic scaling a non-finite gradient skips the
        update (``global_step`` is not incremented) and halves the scale; after
        ``growth_interval`` finite steps in a row the scale doubles.

        Args:
            grads_and_vars: Pairs from :meth:`compute_gradients`.
            global_step: Optional variable to increment when the update is applied.
            name: Optional name for the returned op.

        Returns:
            The training op.
        """
        grads_and_vars = tuple(grads_and_vars)
        if not self._dynamic:
            return self._optimizer.apply_gradients(grads_and_vars, global_step, name)
        scale, good = self._state()
        grads = [_grad_values(g) for g, _ in grads_and_vars if g is not None]
        finite = tf.reduce_all(
            tf.stack([tf.reduce_all(tf.math.is_finite(g)) for g in grads])
            if grads
            else tf.constant([True])
        )

        def apply_fn() -> Any:
            return self._optimizer.apply_gradients(grads_and_vars, global_step, name)

        def grow() -> Any:
            steps = good + 1
            should_grow = steps >= self._growth_interval
            doubled = scale * 2.0
            new_scale = tf.where(should_grow & tf.math.is_finite(doubled), doubled, scale)
            return tf.group(
                scale.assign(new_scale),
                good.assign(tf.where(should_grow, tf.constant(0, tf.int64), steps)),
            )

        def shrink() -> Any:
            return tf.group(
                scale.assign(tf.maximum(scale / 2.0, 1.0)), good.assign(tf.constant(0, tf.int64))
            )

        apply_op = tf.cond(finite, apply_fn, tf.no_op)
        update_op = tf.cond(finite, grow, shrink)
        return tf.group(apply_op, update_op, name=name or self.get_name())

    # ---- delegation
    def get_slot(self, var: Any, name: str) -> Any:
        """Return the wrapped optimizer's slot ``name`` for ``var``."""
        return self._optimizer.get_slot(var, name)

    def get_slot_names(self) -> list[str]:
        """Return the wrapped optimizer's slot names."""
        return self._optimizer.get_slot_names()

    def variables(self) -> list:
        """Return the wrapped optimizer's variables and the loss-scale state."""
        key = None if tf.executing_eagerly() else _v1.get_default_graph()
        extra = list(self._scale_vars.get(key, ()))
        return [*self._optimizer.variables(), *extra]

    def _apply_dense(self, grad: Any, var: Any) -> Any:  # pragma: no cover - delegated
        raise RuntimeError("kmp's DistributedOptimizer delegates apply_gradients.")

    _resource_apply_dense = _apply_dense

    def _apply_sparse(self, grad: Any, var: Any) -> Any:  # pragma: no cover - delegated
        raise RuntimeError("kmp's DistributedOptimizer delegates apply_gradients.")

    def _resource_apply_sparse(
        self, grad: Any, handle: Any, indices: Any
    ) -> Any:  # pragma: no cover - delegated
        raise RuntimeError("kmp's DistributedOptimizer delegates apply_gradients.")


def _check_tf1_optimizer(opt: Any) -> None:
    if isinstance(opt, DistributedOptimizer):
        raise ValueError(
            "This optimizer is already wrapped by kmp.compat.v1.distributed_optimizer; wrap the "
            "plain tf.compat.v1.train optimizer once."
        )
    mplso = getattr(getattr(_v1, "mixed_precision", None), "MixedPrecisionLossScaleOptimizer", None)
    if mplso is not None and isinstance(opt, mplso):
        raise ValueError(
            "The optimizer is a MixedPrecisionLossScaleOptimizer (e.g. from "
            "enable_mixed_precision_graph_rewrite): pass the plain tf.compat.v1.train optimizer "
            "and loss_scale='dynamic' instead, so kmp can average gradients before the finite "
            "check (and use session_config(mixed_precision='float16') for the graph rewrite)."
        )
    if type(opt).__module__.startswith("horovod."):
        raise ValueError(
            f"The optimizer is already a Horovod {type(opt).__name__}: pass the plain "
            "tf.compat.v1.train optimizer; kmp does the averaging."
        )
    if not isinstance(opt, _v1.train.Optimizer):
        raise TypeError(
            f"distributed_optimizer takes a tf.compat.v1.train optimizer (e.g. "
            f"tf.compat.v1.train.AdamOptimizer), not {type(opt).__module__}.{type(opt).__name__}. "
            "For a Keras optimizer use kmp.wrap_optimizer."
        )


def _scale_learning_rate(opt: Any, factor: int) -> None:
    for attr in ("_learning_rate", "_lr"):
        if hasattr(opt, attr):
            lr = getattr(opt, attr)
            if callable(lr):
                setattr(opt, attr, lambda user_lr=lr: user_lr() * factor)
            else:
                setattr(opt, attr, lr * factor)
            return
    raise ValueError(
        f"scale_lr=True, but kmp cannot find the learning rate of {type(opt).__name__}; pass "
        "scale_lr=False and multiply the learning rate by kmp.distributed.size() yourself."
    )


def distributed_optimizer(
    tf1_optimizer: Any,
    *,
    loss_scale: str | float | None = None,
    compression: Any = None,
    scale_lr: bool = False,
    initial_scale: float = 2.0**15,
    growth_interval: int = 2000,
    name: str | None = None,
) -> DistributedOptimizer:
    """Wrap a ``tf.compat.v1.train`` optimizer with Horovod averaging and loss scaling.

    Replaces ``hvd.DistributedOptimizer(opt)`` (and TensorFlow's
    ``MixedPrecisionLossScaleOptimizer``) in TF1 graph code. Gradients are
    averaged over all ranks with one grouped allreduce *before* they are
    unscaled and checked for inf/NaN, so every rank applies or skips a step
    together. In a single process the allreduce is skipped.

    Args:
        tf1_optimizer: A ``tf.compat.v1.train.Optimizer``, e.g. ``AdamOptimizer(1e-3)``.
        loss_scale: None (no loss scaling: float32 or bfloat16 graphs),
            ``"dynamic"`` (for float16: start at ``initial_scale``, halve on a
            non-finite gradient and skip the step, double after
            ``growth_interval`` finite steps), or a positive number (a fixed scale).
        compression: None, ``"fp16"``/``"bf16"``, or Horovod's
            ``hvd.Compression.none``/``hvd.Compression.fp16``: the dtype the
            gradients travel in.
        scale_lr: Multiply the wrapped optimizer's learning rate by the number
            of ranks (in place), as Horovod's examples do by hand.
        initial_scale: The first dynamic loss scale.
        growth_interval: Finite steps in a row before the dynamic scale doubles.
        name: Name of the wrapper (default ``"Distributed" + optimizer name``).

    Returns:
        A :class:`DistributedOptimizer`; use ``minimize`` or
        ``compute_gradients``/``apply_gradients`` as with any TF1 optimizer.

    Raises:
        TypeError: ``tf1_optimizer`` is not a ``tf.compat.v1.train`` optimizer.
        ValueError: An already wrapped optimizer, a bad ``loss_scale``,
            ``initial_scale``, ``growth_interval`` or ``compression``.
    """
    _check_tf1_optimizer(tf1_optimizer)
    if (
        loss_scale is not None
        and loss_scale != "dynamic"
        and (
            not isinstance(loss_scale, int | float)
            or isinstance(loss_scale, bool)
            or not 0 < loss_scale < float("inf")
        )
    ):
        raise ValueError(
            f"loss_scale must be None, 'dynamic' or a positive finite number, not {loss_scale!r}."
        )
    if not isinstance(initial_scale, int | float) or not 1.0 <= initial_scale < float("inf"):
        raise ValueError(f"initial_scale must be a finite number >= 1, not {initial_scale!r}.")
    if (
        not isinstance(growth_interval, int)
        or isinstance(growth_interval, bool)
        or (growth_interval < 1)
    ):
        raise ValueError(f"growth_interval must be a positive int, not {growth_interval!r}.")
    comp = _normalize_compression(compression)
    if not isinstance(scale_lr, bool):
        raise TypeError(f"scale_lr must be True or False, not {scale_lr!r}.")
    if scale_lr:
        from kmp import distributed

        _scale_learning_rate(tf1_optimizer, distributed.size())
    return DistributedOptimizer(
        tf1_optimizer,
        loss_scale=loss_scale,
        initial_scale=initial_scale,
        growth_interval=growth_interval,
        compression=comp,
        name=name,
    )


def broadcast_global_variables(root: int = 0) -> Any:
    """Return the op that copies every global variable from rank ``root`` to all ranks.

    The TF1 form of ``hvd.broadcast_global_variables(root)``: run it once in the
    session after the variables are initialised (in a single process it is a no-op).

    Args:
        root: The rank whose values win.

    Returns:
        An op to ``sess.run`` (a no-op when there is one process).
    """
    from kmp import distributed

    if tf.executing_eagerly():
        raise RuntimeError(
            "broadcast_global_variables() builds a graph op for TF1 sessions, but eager "
            "execution is on. Call tf.compat.v1.disable_eager_execution() first, or use "
            "kmp.distributed.broadcast_variables(variables) in TF2 code."
        )
    op = distributed.broadcast_variables(_v1.global_variables(), root=root)
    return tf.no_op(name="kmp_broadcast_noop") if op is None else op
