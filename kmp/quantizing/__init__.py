"""Post-training quantization with each layer's error measured: ``kmp.quantize``.

Keras 3's ``model.quantize(mode)`` quantizes every layer it can, whatever that costs, and
raises on the first layer it cannot (an unbuilt layer, int8 under float16 compute).
:func:`quantize` measures first and quantizes only what passes:

1. one run of the model on the user's batch keeps every candidate layer's inputs and
   outputs (``kmp/quantizing/layer_errors.py``);
2. each candidate is copied, the copy quantized and fed the same inputs: its relative
   error is measured with the model untouched;
3. the layers whose error is at most the threshold are quantized in place, one
   ``model.quantize(mode, filters=...)`` each, so Keras's own bookkeeping runs (a KerasHub
   task's ``generate`` function is rebuilt); every other layer keeps its precision and the
   report says why (``kmp/quantizing/selection.py`` decides);
4. the model's output error and, with labels, its accuracy before and after are measured
   on the same batch.

docs/quantization.md is the guide.
"""

from __future__ import annotations

import contextlib
import gc
import math
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import keras
import numpy as np

from kmp._outputs import accuracy, has_classes
from kmp.layer_walk import walk
from kmp.quantizing import selection
from kmp.quantizing.layer_errors import (
    Measured,
    measure,
    outputs_of,
    record_calls,
    relative_error,
)
from kmp.quantizing.outcome import LayerOutcome, QuantizeReport

__all__ = ["LayerOutcome", "QuantizeReport", "quantize"]


def quantize(
    model: keras.Model,
    mode: str = "int8",
    data: Any = None,
    *,
    labels: Any = None,
    threshold: float | None = None,
    layers: Sequence[str] | None = None,
) -> QuantizeReport:
    """Quantize ``model``'s layers in place, each only if its measured error allows it.

    Args:
        model: A Keras model (Sequential, Functional, subclassed, a KerasHub task).
        mode: ``"int8"``, ``"int4"`` or ``"float8"`` (Keras's weight quantization modes).
        data: A batch as the model takes it: the inputs ``x``, or a tuple ``(x, y)`` (a
            third item, sample weights, is ignored) whose ``y`` serves as ``labels`` where
            it fits a classifier's outputs (else accuracy is not reported); a
            ``tf.data.Dataset`` gives its first batch. A list is the inputs of a
            multi-input model, not ``(x, y)``.
        labels: Class ids (shape of the outputs without their last axis) or one-hot
            labels (the outputs' shape): accuracy before and after is then reported.
        threshold: The largest relative RMS error, ``||q - f|| / ||f||``, a layer may show
            quantized on the batch; layers above it keep their precision. None: the mode's
            default (``kmp.quantizing.selection.DEFAULT_THRESHOLDS``: 0.05 for int8).
        layers: Paths, names or glob patterns of the layers to consider (None: every layer
            Keras can quantize).

    Returns:
        The :class:`QuantizeReport`: every layer holding weights with its status and
        measured error, the model's output error, and accuracy before and after.

    Raises:
        TypeError: ``model`` is not a Keras model, or ``data``, ``labels``, ``threshold``
            or ``layers`` has the wrong type.
        ValueError: ``mode`` is not one of ``"int8"``, ``"int4"``, ``"float8"``; ``data``
            is missing or empty; labels are given twice or do not fit the outputs; or a
            pattern in ``layers`` matches no layer.
    """
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"`model` must be a keras.Model; got {type(model).__name__}. Wrap a layer in a "
            "keras.Sequential to quantize it."
        )
    mode = selection.check_mode(mode)
    limit = _check_threshold(threshold, mode)
    patterns = _check_layers(layers)
    explicit = labels is not None
    x, labels = _split(data, labels)

    with _frozen_heap():
        return _quantize(model, mode, x, labels, limit, patterns, explicit)


def _quantize(
    model: keras.Model,
    mode: str,
    x: Any,
    labels: np.ndarray | None,
    limit: float,
    patterns: tuple[str, ...] | None,
    explicit: bool,
) -> QuantizeReport:
    if not all(getattr(v.layer, "built", True) for v in walk(model)):
        outputs_of(model, x)  # builds it: layers made in build (attention's) exist after
    leaves = [v for v in walk(model, inputs=False) if not v.children]
    candidates = [v.layer for v in leaves if selection.is_quantizable_class(type(v.layer))]
    _check_patterns_match(patterns, leaves)
    before, calls = record_calls(model, candidates, x)
    try:
        accuracy_before = _accuracy(before, labels)  # bad labels fail before any change
    except ValueError:
        if explicit:
            raise
        labels = accuracy_before = None  # a y from (x, y) that is no class labels
    facts = [_facts(v.path, v.layer, patterns) for v in leaves]

    measured: dict[str, Measured] = {}
    for visit, fact in zip(leaves, facts, strict=True):
        if not selection.reported(fact) or selection.screen(fact, mode) is not None:
            continue
        recorded = calls.get(id(visit.layer), [])
        if not recorded:
            measured[fact.path] = Measured(
                None, selection.NOT_REACHED, "the batch does not reach it"
            )
        else:
            measured[fact.path] = measure(visit.layer, mode, recorded)

    outcomes = []
    for visit, fact in zip(leaves, facts, strict=True):
        if selection.reported(fact):
            outcomes.append(
                _outcome(model, visit.layer, fact, mode, limit, measured.get(fact.path))
            )
    after = outputs_of(model, x) if any(o.quantized for o in outcomes) else before
    return QuantizeReport(
        mode=mode,
        threshold=limit,
        layers=tuple(outcomes),
        samples=_samples(x),
        output_error=relative_error(after, before),
        accuracy_before=accuracy_before,
        accuracy_after=_accuracy(after, labels),
    )


@contextlib.contextmanager
def _frozen_heap() -> Iterator[None]:
    """Objects that exist now are left out of garbage collection until the block ends.

    Keras runs ``gc.collect()`` every time a layer drops a variable (each ``quantize``
    drops its float kernel): over a large heap that took 0.23 s a layer (a 2-block GPT:
    10 s, 0.5 s frozen). Objects made inside the block are collected as usual; nothing
    is frozen when the caller froze objects already.
    """
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _outcome(
    model: keras.Model,
    layer: keras.layers.Layer,
    fact: selection.LayerFacts,
    mode: str,
    limit: float,
    measured: Measured | None,
) -> LayerOutcome:
    """Decide one weighted layer, quantize it in place if chosen, and say what happened."""
    kept = selection.screen(fact, mode)
    if kept is not None:
        return LayerOutcome(fact.path, fact.class_name, kept[0], None, kept[1])
    assert measured is not None  # every screened-in layer was measured
    if measured.status is not None:
        return LayerOutcome(fact.path, fact.class_name, measured.status, None, measured.detail)
    status = selection.decide(measured.error, limit)
    if status != selection.QUANTIZED:
        detail = f"error {measured.error:.3g} > threshold {limit:.3g}"
        return LayerOutcome(fact.path, fact.class_name, status, measured.error, detail)
    failure = _quantize_in_place(model, layer, mode)
    if failure:
        return LayerOutcome(
            fact.path, fact.class_name, selection.KERAS_REFUSED, measured.error, failure
        )
    return LayerOutcome(
        fact.path, fact.class_name, status, measured.error, f"now {layer.dtype_policy.name}"
    )


def _quantize_in_place(model: keras.Model, layer: keras.layers.Layer, mode: str) -> str:
    """Quantize ``layer`` through ``model.quantize`` (Keras's bookkeeping); "" or the failure."""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.quantize(mode, filters=lambda candidate: candidate is layer)
    except Exception as exc:  # measured fine on a copy, so unexpected: report, never crash
        return f"Keras failed to quantize it in place: {type(exc).__name__}: {exc}"
    if layer.quantization_mode != mode:
        said = "; ".join(str(w.message) for w in caught) or "no reason given"
        return f"Keras left it unquantized: {said}"
    return ""


def _facts(
    path: str, layer: keras.layers.Layer, patterns: tuple[str, ...] | None
) -> selection.LayerFacts:
    policy = getattr(layer, "dtype_policy", None)
    return selection.LayerFacts(
        path=path,
        class_name=type(layer).__name__,
        quantizable=selection.is_quantizable_class(type(layer)),
        built=bool(getattr(layer, "built", False)),
        has_weights=bool(getattr(layer, "weights", None)),
        quantization_mode=getattr(policy, "quantization_mode", None),
        selected=selection.matches(path, getattr(layer, "name", ""), patterns),
        compute_dtype=str(getattr(layer, "compute_dtype", "float32")),
    )


def _check_threshold(threshold: Any, mode: str) -> float:
    if threshold is None:
        return selection.DEFAULT_THRESHOLDS[mode]
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float, np.number)):
        raise TypeError(
            f"`threshold` must be a number >= 0 (or None: the mode's default); got {threshold!r}."
        )
    value = float(threshold)
    if not value >= 0 or math.isnan(value):
        raise ValueError(
            "`threshold` must be a number >= 0 (float('inf') quantizes every layer); "
            f"got {threshold!r}."
        )
    return value


def _check_layers(layers: Any) -> tuple[str, ...] | None:
    if layers is None:
        return None
    if isinstance(layers, str):
        layers = (layers,)
    if not isinstance(layers, (list, tuple)) or not all(isinstance(p, str) for p in layers):
        raise TypeError(
            f"`layers` must be a list of layer paths, names or glob patterns; got {layers!r}."
        )
    if not layers:
        raise ValueError("`layers` is empty: pass None to consider every layer, or name some.")
    return tuple(layers)


def _check_patterns_match(patterns: tuple[str, ...] | None, leaves: list) -> None:
    if patterns is None:
        return
    names = [(v.path, getattr(v.layer, "name", "")) for v in leaves]
    unmatched = [
        p for p in patterns if not any(selection.matches(path, name, (p,)) for path, name in names)
    ]
    if unmatched:
        raise ValueError(
            f"`layers` names no layer of the model: {unmatched}. "
            f"Its layers: {[path for path, _ in names]}"
        )


def _split(data: Any, labels: Any) -> tuple[Any, np.ndarray | None]:
    """The batch's inputs and labels (NumPy) from ``data`` and ``labels``."""
    if data is None:
        raise ValueError(
            "`data` is required: kmp.quantize measures each layer's error on a batch of your "
            "inputs. Pass one, e.g. kmp.quantize(model, 'int8', x_val[:256]) or (x, y)."
        )
    if hasattr(data, "element_spec"):  # a tf.data.Dataset: its first batch
        data = next(iter(data))
    if isinstance(data, tuple):
        if len(data) not in (2, 3):
            raise ValueError(
                f"`data` as a tuple must be (x, y) or (x, y, sample_weight); got {len(data)} "
                "items. Pass the inputs of a multi-input model as a list or dict."
            )
        if labels is not None:
            raise ValueError(
                "labels were given twice: in `data` as (x, y) and as `labels`; pass one."
            )
        data, labels = data[0], data[1]
    for leaf in keras.tree.flatten(data):
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            raise TypeError(
                "`data` must be the model's inputs (NumPy arrays or tensors, a list or dict "
                f"of them) or (x, y); it holds a {type(leaf).__name__}."
            )
    if not keras.tree.flatten(data):
        raise ValueError("`data` holds no arrays: pass a batch of the model's inputs.")
    if _samples(data) == 0:
        raise ValueError("`data` is an empty batch: pass at least one example.")
    if labels is not None:
        if not hasattr(labels, "shape") and not isinstance(labels, (list, tuple)):
            raise TypeError(
                "`labels` must be an array of class ids or one-hot rows; "
                f"got {type(labels).__name__}."
            )
        labels = np.asarray(
            keras.ops.convert_to_numpy(labels) if hasattr(labels, "shape") else labels
        )
    return data, labels


def _samples(x: Any) -> int:
    shape = keras.tree.flatten(x)[0].shape
    return int(shape[0]) if len(shape) else 1


def _accuracy(outputs: list[np.ndarray], labels: np.ndarray | None) -> float | None:
    """Top-1 accuracy of the model's single output against class ids or one-hot labels."""
    if labels is None:
        return None
    if len(outputs) != 1:
        raise ValueError(
            f"labels work for a model with one output; this one has {len(outputs)}. "
            "Leave `labels` out (and pass `data` as x only) to measure the output error alone."
        )
    if not has_classes(outputs[0]):
        raise ValueError(
            f"top-1 accuracy needs one output per class (last axis >= 2); the output's shape "
            f"is {outputs[0].shape}. Leave `labels` out to measure the output error alone."
        )
    return accuracy(outputs[0], labels)
