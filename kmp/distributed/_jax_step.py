"""The JAX engine's train step: gradients per process, reduced in one flat all-reduce.

Under Keras's ``DataParallel`` on JAX, XLA partitions the step over the devices and
reduces every gradient where it is computed: one tuple all-reduce whose operands
XLA's CPU runtime hands Gloo one by one (10 round trips a step on the digits CNN,
9.4 ms where the same floats in one array take 2.4 ms; docs/performance.md). kmp
owns the step instead, for every model whose class keeps Keras's ``train_step``::

    shard_map over the batch axis, on each device:
        forward + loss + scale_loss + backward on the local batch
        metrics updated on the local batch
        one float32 vector: every gradient and the non-trainable and metric
        variables that must be combined (the loss rides in the loss tracker's
        metric variables)  ->  ONE psum over the devices  ->  split
    outside it (replicated, identical on every process):
        kmp's (or any) optimizer: finite check, unscale, apply or skip
        the logs: each metric's result on the combined variables

How each variable's per-device values combine is :func:`combine_rule`'s decision
(pure), from the variable's dtype and Keras ``aggregation``: gradients and
non-trainable floats (BatchNormalization's moving statistics) are averaged, metric
accumulators (``aggregation="sum"``) add their per-device increments, integer state
(seed generators, counters) is the same everywhere and stays. A model evaluated in
training mode sees its local batch, as under Horovod (BatchNormalization normalises
with the local batch's statistics).

:func:`install` wraps Keras's ``JAXTrainer.train_step`` (:data:`HOOK_POINT`) while
the JAX engine runs; the wrapper takes the step only under kmp's distribution over
more than one device (:func:`owns_step`), and :func:`remove` puts Keras's back.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Sequence
from typing import Any

from kmp._keras_internals import JAX_TRAIN_STEP
from kmp.versions import supported

__all__ = ["HOOK_POINT", "combine_rule", "install", "owns_step", "remove"]

# Keras's JAX trainer step (kmp._keras_internals.JAX_TRAIN_STEP).
HOOK_POINT = JAX_TRAIN_STEP


def combine_rule(dtype: str, aggregation: str) -> str:
    """How one variable's new per-device values become its one value (pure).

    Args:
        dtype: The variable's dtype name (``"float32"``, ``"int64"``, ...).
        aggregation: Its Keras ``aggregation``: ``"none"``, ``"mean"``, ``"sum"`` or
            ``"only_first_replica"``.

    Returns:
        ``"mean"`` (average the values: weights-like floats, Keras's ``"none"`` and
        ``"mean"``), ``"sum"`` (add each device's increment to the old value: metric
        accumulators), ``"first"`` (device 0's value) or ``"local"`` (not floating
        point: seed states and counters, equal on every device).

    Raises:
        ValueError: ``aggregation`` is not one of Keras's.
    """
    if aggregation not in ("none", "mean", "sum", "only_first_replica"):
        raise ValueError(
            f"aggregation must be 'none', 'mean', 'sum' or 'only_first_replica', "
            f"got {aggregation!r}."
        )
    if not (dtype.startswith("float") or dtype.startswith("bfloat")):
        return "local"
    return {"sum": "sum", "only_first_replica": "first"}.get(aggregation, "mean")


def owns_step(model: Any, distribution_class: type) -> bool:
    """True when kmp's step replaces Keras's for ``model`` now.

    Keras's distribution is a ``distribution_class`` (kmp's ``DataParallel``) over
    more than one device, and the model's class does not define its own
    ``train_step`` (a custom step stays the user's, partitioned by XLA as Keras does).
    """
    import keras

    distribution = keras.distribution.distribution()
    if not isinstance(distribution, distribution_class):
        return False
    if distribution.device_mesh.devices.size < 2:
        return False
    return getattr(type(model), "train_step", None) is _hook_class().train_step


def _hook_class() -> type:
    module, name, _ = HOOK_POINT
    return getattr(importlib.import_module(module), name)


def install(distribution_class: type) -> None:
    """Wrap Keras's JAX ``train_step`` so that :func:`owns_step` models take kmp's. Idempotent.

    Args:
        distribution_class: kmp's ``DataParallel`` class, under which the step is kmp's.

    Raises:
        RuntimeError: This Keras has no such method; the message says what to install.
    """
    cls = _hook_class()
    method = cls.__dict__.get(HOOK_POINT[2])
    if method is None:
        raise RuntimeError(
            f"This Keras has no {'.'.join(HOOK_POINT)}, which kmp's JAX engine takes over; "
            f"install a Keras kmp supports (pip install '{supported('keras').requirement}')."
        )
    if getattr(method, "_kmp_original", None) is not None:
        return

    @functools.wraps(method)
    def train_step(model: Any, state: tuple, data: Any) -> tuple[dict, tuple]:
        if owns_step(model, distribution_class):
            return flat_train_step(model, state, data)
        return method(model, state, data)

    train_step._kmp_original = method  # type: ignore[attr-defined]
    cls.train_step = train_step


def remove() -> None:
    """Put Keras's own ``train_step`` back (nothing to do if not installed)."""
    cls = _hook_class()
    original = getattr(cls.__dict__.get(HOOK_POINT[2]), "_kmp_original", None)
    if original is not None:
        cls.train_step = original


def _combine(rules: Sequence[str], old: Sequence[Any], new: Sequence[Any], axis: str) -> list:
    """The summand each variable sends to the psum (float32, flat), by its rule."""
    import jax
    import jax.numpy as jnp

    first = jax.lax.axis_index(axis) == 0
    parts = []
    for rule, before, after in zip(rules, old, new, strict=True):
        if rule == "local":
            continue
        after = jnp.asarray(after, jnp.float32)
        if rule == "sum":
            after = after - jnp.asarray(before, jnp.float32)
        elif rule == "first":
            after = jnp.where(first, after, 0.0)
        parts.append(after.ravel())
    return parts


def _split(rules: Sequence[str], old: Sequence[Any], new: Sequence[Any], total: Any, n: int):
    """The combined values from the reduced vector ``total`` (the inverse of :func:`_combine`)."""
    import jax.numpy as jnp

    out, at = [], 0
    for rule, before, after in zip(rules, old, new, strict=True):
        if rule == "local":
            out.append(after)
            continue
        size = int(jnp.size(after))
        value = total[at : at + size].reshape(jnp.shape(after))
        at += size
        if rule == "mean":
            value = value / n
        elif rule == "sum":
            value = jnp.asarray(before, jnp.float32) + value
        out.append(value.astype(jnp.asarray(after).dtype))
    return out, at


def flat_train_step(model: Any, state: tuple, data: Any) -> tuple[dict, tuple]:
    """Keras's JAX ``train_step``, with the gradients and state reduced in one psum.

    Args:
        model: A compiled Keras model under kmp's distribution.
        state: ``(trainable, non_trainable, optimizer, metrics)`` variable values.
        data: The batch, laid out over the devices along its first axis.

    Returns:
        ``(logs, state)`` as Keras's step returns them.
    """
    import jax
    import jax.numpy as jnp
    import keras
    from jax.sharding import PartitionSpec

    trainable, non_trainable, optimizer_values, metrics = state
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    distribution = keras.distribution.distribution()
    mesh, axis = distribution.device_mesh.backend_mesh, distribution.batch_dim_name
    n = mesh.devices.size
    nt_rules = [combine_rule(v.dtype, v.aggregation) for v in model.non_trainable_variables]
    m_rules = [combine_rule(v.dtype, v.aggregation) for v in model.metrics_variables]

    def local(trainable, non_trainable, optimizer_values, metrics, x, y, sample_weight):
        grad_fn = jax.value_and_grad(model.compute_loss_and_updates, has_aux=True)
        (_, aux), grads = grad_fn(
            trainable,
            non_trainable,
            metrics,
            x,
            y,
            sample_weight,
            training=True,
            optimizer_variables=optimizer_values,
        )
        unscaled_loss, y_pred, new_nt, new_m = aux
        _, new_m = model._update_metrics_variables(
            new_m, unscaled_loss, x, y, y_pred, sample_weight
        )
        g_rules = ["mean"] * len(grads)
        parts = _combine(g_rules, grads, grads, axis)
        parts += _combine(nt_rules, non_trainable, new_nt, axis)
        parts += _combine(m_rules, metrics, new_m, axis)
        total = jax.lax.psum(jnp.concatenate(parts), axis)
        grads, at = _split(g_rules, grads, grads, total, n)
        new_nt, at_nt = _split(nt_rules, non_trainable, new_nt, total[at:], n)
        new_m, _ = _split(m_rules, metrics, new_m, total[at + at_nt :], n)
        return grads, new_nt, new_m

    data_spec = PartitionSpec(axis)
    grads, non_trainable, metrics = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(PartitionSpec(),) * 4 + (data_spec,) * 3,
        out_specs=PartitionSpec(),
        check_vma=False,
    )(trainable, non_trainable, optimizer_values, metrics, x, y, sample_weight)
    trainable, optimizer_values = model.optimizer.stateless_apply(
        optimizer_values, grads, trainable
    )
    with keras.StatelessScope(
        state_mapping=list(zip(model.metrics_variables, metrics, strict=True))
    ):
        logs = model.get_metrics_result()
    return logs, (trainable, non_trainable, optimizer_values, metrics)
