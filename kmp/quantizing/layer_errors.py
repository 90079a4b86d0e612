"""Each candidate layer's error quantized, measured on the user's batch without touching it.

:func:`record_calls` runs the model once on the batch, as it computes (its own policies,
``training=False``), with the candidate layers' ``call`` wrapped to keep what each call got
and gave; the wrappers are removed afterwards, also when the run fails. :func:`measure`
then builds a copy of each layer (``from_config``, the same build, the same weights),
quantizes the copy with Keras's ``quantize`` and feeds it the recorded inputs: the layer's
error is :func:`relative_error` of the copy's outputs against the recorded ones. The
model's own layers are never changed here.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from kmp.layer_walk import calls_replaced
from kmp.quantizing.selection import KERAS_REFUSED, NOT_MEASURABLE

__all__ = ["Call", "Measured", "measure", "outputs_of", "record_calls", "relative_error"]


@dataclasses.dataclass(frozen=True)
class Call:
    """One call of a layer during the recorded run.

    Attributes:
        args: The positional arguments ``call`` got (tensors as they were).
        kwargs: Its keyword arguments.
        outputs: Its floating-point outputs, as float32 NumPy arrays.
    """

    args: tuple
    kwargs: dict
    outputs: tuple[np.ndarray, ...]


@dataclasses.dataclass(frozen=True)
class Measured:
    """A candidate's measurement: its error, or why it could not be measured.

    Attributes:
        error: The relative error of the quantized copy (None: not measured).
        status: None when measured, else the status that keeps the layer as it is.
        detail: The reason, for the report (Keras's message when Keras refused).
    """

    error: float | None
    status: str | None = None
    detail: str = ""


def _float_leaves(value: Any) -> list[np.ndarray]:
    leaves = []
    for leaf in keras.tree.flatten(value):
        dtype = getattr(leaf, "dtype", None)
        if dtype is None or not hasattr(leaf, "shape"):
            continue
        try:
            is_float = keras.backend.is_float_dtype(keras.backend.standardize_dtype(dtype))
        except Exception:  # a dtype Keras does not know (strings, resources)
            is_float = False
        if is_float:
            leaves.append(np.asarray(keras.ops.convert_to_numpy(leaf), dtype=np.float32))
    return leaves


def outputs_of(model: keras.Model, x: Any) -> list[np.ndarray]:
    """The model's floating-point outputs on ``x`` (``training=False``), as float32 arrays.

    Args:
        model: The model.
        x: Its inputs.
    """
    return _float_leaves(model(x, training=False))


def record_calls(
    model: keras.Model, layers: list[keras.layers.Layer], x: Any
) -> tuple[list[np.ndarray], dict[int, list[Call]]]:
    """Run ``model`` once on ``x`` and keep every call of ``layers``.

    Args:
        model: The model, as it computes.
        layers: The layers whose calls to keep.
        x: The batch's inputs, as ``model`` takes them.

    Returns:
        The model's floating-point outputs (float32 arrays), and per layer (by ``id``) its
        calls in order; a layer the batch did not reach has none.
    """
    calls: dict[int, list[Call]] = {id(layer): [] for layer in layers}

    def wrap(layer: keras.layers.Layer) -> Callable:
        original = layer.call

        @functools.wraps(original)
        def call(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            calls[id(layer)].append(Call(args, dict(kwargs), tuple(_float_leaves(result))))
            return result

        return call

    with calls_replaced(layers, wrap):
        outputs = outputs_of(model, x)
    return outputs, calls


def relative_error(actual: list[np.ndarray], reference: list[np.ndarray]) -> float:
    """``||actual - reference|| / ||reference||`` over all arrays (relative RMS error).

    A zero reference gives 0.0 when ``actual`` is zero too, else infinity; a non-finite
    ``actual`` gives infinity.

    Args:
        actual: The arrays measured (the quantized outputs).
        reference: The arrays they are compared with, in the same order and shapes.

    Raises:
        ValueError: The arrays differ in number or shape.
    """
    if len(actual) != len(reference):
        raise ValueError(f"{len(actual)} outputs against {len(reference)} reference outputs.")
    squared_error = squared_norm = 0.0
    for a, r in zip(actual, reference, strict=True):
        if a.shape != r.shape:
            raise ValueError(f"an output of shape {a.shape} against one of shape {r.shape}.")
        a64, r64 = a.astype(np.float64), r.astype(np.float64)
        squared_error += float(np.sum((a64 - r64) ** 2))
        squared_norm += float(np.sum(r64**2))
    if not np.isfinite(squared_error):
        return float("inf")
    if squared_norm == 0.0:
        return 0.0 if squared_error == 0.0 else float("inf")
    return float(np.sqrt(squared_error / squared_norm))


def _copy(layer: keras.layers.Layer) -> keras.layers.Layer:
    """A new layer of the same class, config, build and weights (never the same variables)."""
    copy = type(layer).from_config(layer.get_config())
    copy.build_from_config(layer.get_build_config())
    if not copy.built:
        raise ValueError(f"{type(layer).__name__}.build_from_config did not build the copy")
    copy.set_weights(layer.get_weights())
    return copy


def _reason(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__


def measure(layer: keras.layers.Layer, mode: str, calls: list[Call]) -> Measured:
    """Quantize a copy of ``layer`` and measure its error on the recorded ``calls``.

    Args:
        layer: A built candidate layer (left unchanged).
        mode: The quantization mode.
        calls: The layer's recorded calls (at least one).

    Returns:
        The :class:`Measured` error, or the status and Keras's reason when the layer could
        not be copied (``"not-measurable"``) or Keras could not quantize or run the copy
        (``"keras-cannot-quantize"``).
    """
    try:
        copy = _copy(layer)
    except Exception as exc:
        return Measured(None, NOT_MEASURABLE, f"could not copy it to measure: {_reason(exc)}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Keras warns on float8's delayed scaling
            copy.quantize(mode)
    except Exception as exc:
        return Measured(None, KERAS_REFUSED, _reason(exc))
    quantized, reference = [], []
    try:
        for call in calls:
            quantized.extend(_float_leaves(copy(*call.args, **call.kwargs)))
            reference.extend(call.outputs)
        return Measured(relative_error(quantized, reference))
    except Exception as exc:
        return Measured(
            None, KERAS_REFUSED, f"the quantized layer fails on the batch: {_reason(exc)}"
        )
