"""``kmp.probe``: measure where float16 and bfloat16 lose a model's numbers on a real batch.

:func:`kmp.audit` reads a model's structure; the probe measures its numbers. One forward and
backward pass on the given batch, computed in float32 with the model's own weights, records
for every layer (nested ones included) the magnitudes of its outputs and of the gradient
reaching them, and every trainable variable's gradient. The :class:`ProbeReport` then says
which layers overflow float16, which gradients underflow without loss scaling, the initial
loss scale that fits, and which layers to keep in float32, each with its measured reason::

    report = kmp.probe(model, x_batch, y_batch)
    print(report)
    kmp.keep_float32(model, *report.keep_float32)
    optimizer = kmp.wrap_optimizer(keras.optimizers.Adam(),
                                   initial_scale=report.recommended_loss_scale)

The model's policy, weights and state are as before afterwards. The probe is local: it runs
no collective. In a distributed job, probe on the chief and send the scale to every rank,
``scale = kmp.distributed.broadcast_object(report.recommended_loss_scale if
kmp.distributed.is_chief() else None)``, or probe on every rank (each on its own batch).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import keras

from kmp.probing.float32_pass import BACKENDS, Pass, float32_pass
from kmp.probing.report import LayerNumbers, ProbeReport, VariableNumbers
from kmp.probing.stats import ValueStats, recommend_loss_scale

__all__ = ["ProbeReport", "probe"]


def _loss_function(model: keras.Model, loss: Any, y: Any) -> Callable:
    """``fn(y, y_pred, sample_weight) -> scalar`` from ``loss``, or the model's compiled loss."""
    if loss is None:
        loss = getattr(model, "loss", None)
        if loss is None:
            raise ValueError(
                "kmp.probe needs a loss: pass loss= (a Keras loss, its name, or a callable "
                "fn(y_true, y_pred)), or compile the model with one."
            )
        if isinstance(loss, dict | list | tuple):
            raise ValueError(
                "The model was compiled with one loss per output; kmp.probe takes a single "
                "loss: pass loss=fn(y_true, y_pred) that combines them."
            )
    if y is None and not callable(loss):
        raise ValueError("y is None: pass the batch's targets, or loss=fn(y_true, y_pred).")
    if isinstance(loss, str):
        loss = keras.losses.get(loss)
    if not callable(loss):
        raise TypeError(f"loss must be a Keras loss, a loss name or a callable, got {loss!r}.")
    if isinstance(loss, keras.losses.Loss):
        return lambda y_true, y_pred, sw: loss(y_true, y_pred, sample_weight=sw)

    def mean_loss(y_true, y_pred, sw):
        values = loss(y_true, y_pred)
        if sw is not None:
            values = values * keras.ops.cast(sw, values.dtype)
        return keras.ops.mean(values)

    return mean_loss


def _check_model(model: Any) -> None:
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"kmp.probe takes a Keras 3 model (keras.Model), got {type(model).__name__}."
        )
    if not model.built:
        raise ValueError(
            f"Model {model.name!r} is not built: call it on a batch (or model.build(shape)) "
            "before probing it."
        )
    backend = keras.backend.backend()
    if backend not in BACKENDS:
        raise ValueError(
            f"kmp.probe runs on the {' and '.join(BACKENDS)} backends, not {backend!r}: set "
            "KERAS_BACKEND to one of them."
        )


def probe(
    model: keras.Model,
    x: Any,
    y: Any = None,
    *,
    loss: Any = None,
    sample_weight: Any = None,
    min_scale: float = 1.0,
    max_scale: float = 2.0**24,
) -> ProbeReport:
    """Measure, in one float32 pass on ``(x, y)``, where 16-bit training loses numbers.

    Args:
        model: A built Keras 3 model (Sequential, Functional, subclassed, KerasHub).
        x: One batch of inputs, as the model takes them.
        y: The batch's targets (None when ``loss`` is a callable that ignores them).
        loss: A Keras loss, its name or ``fn(y_true, y_pred)``; default: the loss the model
            was compiled with.
        sample_weight: Optional per-example weights for the loss.
        min_scale: The recommended loss scale is not below this (kmp's default 1).
        max_scale: ... nor above this (kmp's default ``2**24``).

    Returns:
        The :class:`ProbeReport`: ``print`` it, ``.keep_float32``,
        ``.recommended_loss_scale``, ``.to_dict()``, ``.plot()``.

    Raises:
        TypeError: ``model`` is not a Keras model, or ``loss`` is not a loss.
        ValueError: The model is not built, no loss is known, the backend is not TensorFlow
            or JAX, the scale bounds are not ``0 < min_scale <= max_scale``, or the batch
            does not fit the model (the message has the model's error).
    """
    _check_model(model)
    if not 0 < min_scale <= max_scale:
        raise ValueError(f"Need 0 < min_scale <= max_scale, got {min_scale} and {max_scale}.")
    loss_fn = _loss_function(model, loss, y)
    start = time.perf_counter()
    try:
        measured = float32_pass(model, x, y, loss_fn, sample_weight)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"kmp.probe: the batch does not fit model {model.name!r} (or its loss): "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    report = _report(model, measured, min_scale, max_scale)
    report.seconds = time.perf_counter() - start
    return report


def _report(model: keras.Model, measured: Pass, min_scale: float, max_scale: float) -> ProbeReport:
    layers = []
    for layer, name in measured.layers:
        outs = measured.outputs.get(id(layer))
        if not outs:
            continue
        grads = measured.output_grads.get(id(layer), [])
        in_stats, out_stats, grad_stats = ValueStats(), ValueStats(), ValueStats()
        for value in measured.inputs.get(id(layer), []):
            in_stats.add(value, detail=False)
        for value in outs:
            out_stats.add(value)
        for value in grads:
            if value is not None:
                grad_stats.add(value)
        layers.append(
            LayerNumbers(
                name,
                type(layer).__name__,
                str(layer.compute_dtype),
                len(outs),
                in_stats,
                out_stats,
                grad_stats,
            )
        )
    owners = {}  # variable -> the innermost layer holding it (the walk goes parents first)
    for layer, name in measured.layers:
        owners.update((id(v), name) for v in layer.trainable_weights)
    variables = []
    for var, grad in zip(model.trainable_variables, measured.variable_grads, strict=True):
        stats = ValueStats()
        if grad is not None:
            stats.add(grad)
        variables.append(VariableNumbers(var.path, owners.get(id(var), "?"), stats))
    maxima = [n.output_grads.max_abs for n in layers] + [v.gradient.max_abs for v in variables]
    scale = recommend_loss_scale(maxima, min_scale=min_scale, max_scale=max_scale)
    return ProbeReport(
        model_name=model.name,
        backend=keras.backend.backend(),
        loss=measured.loss,
        layers=layers,
        variables=variables,
        recommended_loss_scale=scale,
        min_scale=min_scale,
        max_scale=max_scale,
        seconds=0.0,
    )
