"""The TF1 distributed optimizer and broadcast op (see :mod:`kmp.compat.v1`).

:func:`distributed_optimizer` replaces ``hvd.DistributedOptimizer(opt)`` and
TensorFlow's ``MixedPrecisionLossScaleOptimizer`` in graph code, so that the
Horovod allreduce and the loss-scale check run in one fixed order. The loss
scale follows :mod:`kmp.loss_scale`, the rule every kmp path shares.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from kmp import loss_scale as _ls
from kmp._names import normalize_compression
from kmp.distributed import sparse
from kmp.learning_rate import scaled_learning_rate
from kmp.optimizer_settings import OptimizerSettings

__all__ = ["DistributedOptimizer", "broadcast_global_variables", "distributed_optimizer"]

_v1 = tf.compat.v1


# ------------------------------------------------------------------ optimizer


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
    optimizer; average them over all ranks with grouped Horovod allreduces (in
    buckets of ``bucket_bytes``, last variable first);
    unscale; check that every gradient is finite (all ranks see the same
    averaged values, so they all decide alike); apply them, or skip the step;
    then move the scale by :func:`kmp.loss_scale.update`, the rule every kmp
    path shares (run here on ``tf`` graph ops).

    Args:
        optimizer: The wrapped ``tf.compat.v1.train`` optimizer.
        settings: The :class:`kmp.OptimizerSettings` (``compression``, ``bucket_bytes``
            and ``sparse_gradients`` act here), kept as :attr:`settings`.
        rule: The :class:`kmp.loss_scale.LossScale` to follow.
        name: Name of the wrapper.
    """

    def __init__(
        self,
        optimizer: Any,
        settings: OptimizerSettings,
        rule: _ls.LossScale,
        *,
        name: str | None = None,
    ) -> None:
        super().__init__(
            use_locking=optimizer._use_locking, name=name or f"Distributed{optimizer.get_name()}"
        )
        self._optimizer = optimizer
        self.settings = settings
        self._rule = rule
        self._state_vars: dict[Any, _ls.ScaleState] = {}  # graph -> the rule's variables
        self._track_trackable(optimizer, "base_optimizer")

    # ---- loss scale state
    @property
    def optimizer(self) -> Any:
        """The wrapped ``tf.compat.v1.train`` optimizer."""
        return self._optimizer

    @property
    def loss_scale_rule(self) -> _ls.LossScale:
        """The :class:`kmp.loss_scale.LossScale` this optimizer follows."""
        return self._rule

    @property
    def dynamic(self) -> bool:
        """True when the loss scale adapts (``loss_scale="dynamic"``)."""
        return self._rule.dynamic

    def _state(self) -> _ls.ScaleState:
        key = None if tf.executing_eagerly() else _v1.get_default_graph()
        if key not in self._state_vars:
            with tf.init_scope(), tf.name_scope(self.get_name()):

                def var(value: Any, dtype: Any, name: str) -> Any:
                    return _v1.Variable(value, trainable=False, dtype=dtype, name=name)

                self._state_vars[key] = _ls.ScaleState(
                    scale=var(self._rule.start_scale, tf.float32, "loss_scale"),
                    good_steps=var(0, tf.int64, "good_steps"),
                    overflow_streak=var(0, tf.int64, "overflow_streak"),
                    skipped=var(0, tf.int64, "skipped_steps"),
                )
        return self._state_vars[key]

    @property
    def loss_scale(self) -> Any:
        """The current loss scale: a variable (dynamic), a constant (fixed), or None."""
        if self._rule.dynamic:
            return self._state().scale
        if self._rule.scaling:
            return tf.constant(self._rule.initial_scale, tf.float32)
        return None

    @property
    def skipped_steps(self) -> Any:
        """The variable counting steps skipped for a non-finite gradient (None: no scaling)."""
        return self._state().skipped if self._rule.scaling else None

    def _current_scale(self) -> Any:
        if self._rule.dynamic:
            return tf.identity(self._state().scale)
        return tf.constant(self._rule.initial_scale, tf.float32)

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
        from kmp.distributed.collectives import gradients_need_allreduce

        scaling = self._rule.scaling
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
        if self.settings.sparse_gradients == "dense" and gradients_need_allreduce():
            grads = sparse.densify_like(grads, variables)
        averaged = distributed.grouped_allreduce(
            grads,
            op="average",
            compression=self.settings.compression,
            bucket_bytes=self.settings.bucket_bytes,
            sparse_gradients=self.settings.sparse_gradients,
        )
        if scaling:
            inverse = 1.0 / scale
            averaged = [_scale_grad(g, inverse) for g in averaged]
        return list(zip(averaged, variables, strict=True))

    def apply_gradients(
        self, grads_and_vars: Any, global_step: Any = None, name: str | None = None
    ) -> Any:
        """Apply the (already averaged) gradients, or skip the step if any is not finite.

        Without loss scaling this is the wrapped optimizer's ``apply_gradients``.
        With a static or dynamic scale a non-finite gradient skips the update
        (``global_step`` is not incremented) and is counted in
        :attr:`skipped_steps`; a dynamic scale then moves by kmp's loss-scale rule.

        Args:
            grads_and_vars: Pairs from :meth:`compute_gradients`.
            global_step: Optional variable to increment when the update is applied.
            name: Optional name for the returned op.

        Returns:
            The training op.
        """
        grads_and_vars = tuple(grads_and_vars)
        if not self._rule.scaling:
            return self._optimizer.apply_gradients(grads_and_vars, global_step, name)
        state = self._state()
        grads = [_grad_values(g) for g, _ in grads_and_vars if g is not None]
        finite = tf.reduce_all(
            tf.stack([tf.reduce_all(tf.math.is_finite(g)) for g in grads])
            if grads
            else tf.constant([True])
        )

        def apply_fn() -> Any:
            return self._optimizer.apply_gradients(grads_and_vars, global_step, name)

        apply_op = tf.cond(finite, apply_fn, tf.no_op)
        current = _ls.ScaleState(*(tf.identity(v) for v in state))
        stats = None
        if self._rule.measures_underflow:  # the gradients here are unscaled already
            stats = _ls.gradient_stats(grads, scaled_by=current.scale, xp=tf)
        new = _ls.update(self._rule, current, finite, stats, xp=tf)
        update_op = tf.group(*(v.assign(x) for v, x in zip(state, new, strict=True)))
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
        extra = list(self._state_vars.get(key, ()))
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
            setattr(opt, attr, scaled_learning_rate(getattr(opt, attr), factor))
            return
    raise ValueError(
        f"scale_lr=True, but kmp cannot find the learning rate of {type(opt).__name__}; pass "
        "scale_lr=False and multiply the learning rate by kmp.distributed.size() yourself."
    )


def distributed_optimizer(
    tf1_optimizer: Any,
    settings: OptimizerSettings | None = None,
    *,
    name: str | None = None,
    **overrides: Any,
) -> DistributedOptimizer:
    """Wrap a ``tf.compat.v1.train`` optimizer with Horovod averaging and loss scaling.

    Replaces ``hvd.DistributedOptimizer(opt)`` (and TensorFlow's
    ``MixedPrecisionLossScaleOptimizer``) in TF1 graph code. Gradients are
    averaged over all ranks (in buckets of ``bucket_bytes``) *before* they are
    unscaled and checked for inf/NaN, so every rank applies or skips a step
    together. In a single process the allreduce is skipped. The settings are one
    :class:`kmp.OptimizerSettings`, with keyword arguments overriding its fields, as for
    :func:`kmp.wrap_optimizer`::

        kmp.enable("mixed_float16")         # the graph computes in float16: dynamic scaling
        opt = kmp.compat.v1.distributed_optimizer(tf.compat.v1.train.AdamOptimizer(1e-3))

    Args:
        tf1_optimizer: A ``tf.compat.v1.train.Optimizer``, e.g. ``AdamOptimizer(1e-3)``.
        settings: A :class:`kmp.OptimizerSettings`; None: the defaults. On this path
            ``loss_scale="dynamic"`` (the default) follows the global dtype policy as
            everywhere (a TF1 graph has no layers to say it computes in float16: call
            ``kmp.enable("mixed_float16")``, or pass ``loss_scale="force_dynamic"``);
            ``compression`` may also be Horovod's ``hvd.Compression.none`` /
            ``.fp16``; ``scale_lr`` scales the wrapped optimizer's rate in place;
            ``backward_passes_per_step``, ``master_weights`` and ``rounding_seed`` can
            only be their defaults.
        name: Name of the wrapper (default ``"Distributed" + optimizer name``).
        **overrides: Fields of :class:`kmp.OptimizerSettings` that replace those of
            ``settings``.

    Returns:
        A :class:`DistributedOptimizer`; use ``minimize`` or
        ``compute_gradients``/``apply_gradients`` as with any TF1 optimizer.

    Raises:
        TypeError: ``tf1_optimizer`` is not a ``tf.compat.v1.train`` optimizer,
            ``settings`` is not an ``OptimizerSettings``, an override is not a setting,
            or a value has the wrong type.
        ValueError: An already wrapped optimizer, a bad value, or one this path can only
            have at its default.
    """
    chosen, _ = OptimizerSettings.from_arguments(settings, overrides)
    chosen.refuse(
        ("backward_passes_per_step", "master_weights", "rounding_seed"),
        path="kmp.compat.v1.distributed_optimizer",
        instead="Accumulation and master-weight modes are kmp.wrap_optimizer's (Keras 3).",
    )
    _check_tf1_optimizer(tf1_optimizer)
    normalize_compression(chosen.compression)  # names only: a custom compressor is refused
    rule = chosen.loss_scale_rule(keras.config.dtype_policy().compute_dtype)
    if chosen.scale_lr:
        from kmp import distributed

        _scale_learning_rate(tf1_optimizer, distributed.size())
    return DistributedOptimizer(tf1_optimizer, chosen, rule, name=name)


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
