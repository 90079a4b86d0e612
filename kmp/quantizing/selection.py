"""Which layers :func:`kmp.quantize` measures and which it quantizes: pure decisions.

A layer is a candidate when it computes (no sublayers), holds weights and its class
implements Keras's ``quantize`` (in Keras 3.15: ``Dense``, ``EinsumDense``, ``Embedding``,
``ReversibleEmbedding``). :func:`screen` gives every other layer its reason to stay as it
is; :func:`decide` turns a candidate's measured error into "quantize" or "keep", against
the threshold. Nothing here runs a layer or changes a model: ``kmp/quantizing/__init__.py``
acts on these answers.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from collections.abc import Sequence
from typing import Any

import keras

__all__ = [
    "ABOVE_THRESHOLD",
    "ALREADY_QUANTIZED",
    "DEFAULT_THRESHOLDS",
    "KERAS_REFUSED",
    "MODES",
    "NOT_MEASURABLE",
    "NOT_QUANTIZABLE",
    "NOT_REACHED",
    "NOT_SELECTED",
    "QUANTIZED",
    "STATUSES",
    "LayerFacts",
    "check_mode",
    "decide",
    "is_quantizable_class",
    "matches",
    "reported",
    "screen",
]

# The modes Keras's ``quantize`` takes from a name alone ("gptq" and "awq" need a calibration
# config and a dataset of their own: call ``model.quantize(config=...)`` for those).
MODES: tuple[str, ...] = ("int8", "int4", "float8")

# The largest relative RMS error (||quantized - float|| / ||float||, on the user's batch) a
# layer may show and still be quantized, by mode. Measured (docs/quantization.md) on MLPs
# trained on digits and MNIST-1D, the MNIST-1D CNN's head and a 2-block GPT: int8 layers
# showed 0.2 % to 1.5 %, int4 ones 2 % to 19 %, Keras's float8 (its scales start at 1: it is
# made for float8 training) 1.2 % to 4.5 %. A default sits a few times above what a sound
# layer shows, so it catches a layer quantization breaks (outliers), not ordinary noise.
DEFAULT_THRESHOLDS: dict[str, float] = {"int8": 0.05, "int4": 0.25, "float8": 0.1}

# A layer's status in the report: quantized, or why it was left as it was.
QUANTIZED = "quantized"
ABOVE_THRESHOLD = "error-above-threshold"
KERAS_REFUSED = "keras-cannot-quantize"
NOT_QUANTIZABLE = "not-a-quantizable-class"
NOT_REACHED = "not-reached-by-batch"
NOT_MEASURABLE = "not-measurable"
ALREADY_QUANTIZED = "already-quantized"
NOT_SELECTED = "not-selected"
STATUSES: tuple[str, ...] = (
    QUANTIZED,
    ABOVE_THRESHOLD,
    KERAS_REFUSED,
    NOT_QUANTIZABLE,
    NOT_REACHED,
    NOT_MEASURABLE,
    ALREADY_QUANTIZED,
    NOT_SELECTED,
)


@dataclasses.dataclass(frozen=True)
class LayerFacts:
    """What the decisions read about one layer that computes (it has no sublayers).

    Attributes:
        path: Its path (``kmp.layer_walk``), the name the report gives it.
        class_name: Its class's name.
        quantizable: Its class implements Keras's ``quantize`` (:func:`is_quantizable_class`).
        built: It is built (its weights exist).
        has_weights: It holds weights (layers without any are not reported).
        quantization_mode: The mode it is already quantized in, or None.
        selected: The ``layers=`` selection names it (always True without one).
        compute_dtype: The dtype it computes in.
    """

    path: str
    class_name: str
    quantizable: bool
    built: bool
    has_weights: bool
    quantization_mode: str | None = None
    selected: bool = True
    compute_dtype: str = "float32"


def check_mode(mode: Any) -> str:
    """Return ``mode`` (lower-cased) if ``kmp.quantize`` takes it.

    Args:
        mode: The quantization mode asked for.

    Returns:
        One of :data:`MODES`.

    Raises:
        TypeError: ``mode`` is not a string.
        ValueError: ``mode`` is not one of :data:`MODES`; the message lists them, and says
            how to run the calibrated modes ("gptq", "awq") with Keras itself.
    """
    if not isinstance(mode, str):
        raise TypeError(f"`mode` must be one of {', '.join(map(repr, MODES))}; got {mode!r}.")
    key = mode.strip().lower()
    if key in ("gptq", "awq"):
        raise ValueError(
            f"`mode` {mode!r} needs a calibration config and dataset of its own, which "
            f"kmp.quantize does not build: call `model.quantize(config=...)` with Keras's "
            f"{key.upper()}Config. kmp.quantize takes {', '.join(map(repr, MODES))}."
        )
    if key not in MODES:
        raise ValueError(
            f"`mode` must be one of {', '.join(map(repr, MODES))} (the modes Keras "
            f"{keras.__version__} quantizes from a name); got {mode!r}."
        )
    return key


def is_quantizable_class(cls: type) -> bool:
    """True when ``cls`` implements Keras's ``quantize`` (a ``Layer`` only raises).

    Keras quantizes exactly its own classes: a subclass of ``Dense`` inherits the method but
    Keras refuses it (``type_check``), which the measurement finds out and reports.

    Args:
        cls: A layer class (anything else gives False, and so does a model's class).
    """
    if not (isinstance(cls, type) and issubclass(cls, keras.layers.Layer)):
        return False
    if issubclass(cls, keras.Model):
        return False  # a model's quantize walks its layers: its layers are the candidates
    return getattr(cls, "quantize", None) is not keras.layers.Layer.quantize


def matches(path: str, name: str, patterns: Sequence[str] | None) -> bool:
    """True when ``patterns`` is None or one pattern matches the path or the name.

    Args:
        path: The layer's path (``kmp.layer_walk``).
        name: The layer's name.
        patterns: Layer paths, names or glob patterns (``block*_mlp_*``, ``gpt/*``), each
            matched against both; None selects every layer.
    """
    if patterns is None:
        return True
    return any(
        pattern in (path, name)
        or fnmatch.fnmatchcase(path, pattern)
        or fnmatch.fnmatchcase(name, pattern)
        for pattern in patterns
    )


def reported(facts: LayerFacts) -> bool:
    """Whether the report lists the layer: it holds weights, or is an unbuilt candidate.

    Keras's ``model.quantize`` raises on an unbuilt layer of a quantizable class; the
    report lists it with that reason instead.

    Args:
        facts: The layer's facts.
    """
    return facts.has_weights or (facts.quantizable and not facts.built)


def screen(facts: LayerFacts, mode: str) -> tuple[str, str] | None:
    """Why ``facts``'s layer is left as it is before any measurement, or None to measure it.

    Args:
        facts: The layer's facts.
        mode: The quantization mode (one of :data:`MODES`).

    Returns:
        ``(status, detail)``: the status (one of :data:`STATUSES`) and a sentence for the
        report; None when the layer is a candidate to measure.
    """
    if not facts.quantizable:
        return NOT_QUANTIZABLE, f"Keras has no quantized {facts.class_name}"
    if facts.quantization_mode is not None:
        return ALREADY_QUANTIZED, f"already quantized ({facts.quantization_mode})"
    if not facts.selected:
        return NOT_SELECTED, "not named by `layers=`"
    if not facts.built:
        return (
            KERAS_REFUSED,
            "not built (the model never called it): Keras quantizes built layers only",
        )
    if mode == "int8" and facts.compute_dtype == "float16":
        return KERAS_REFUSED, (
            "Keras refuses int8 for float16 compute: load the model in float32 or "
            "bfloat16 first (kmp.load_model(path, policy='float32'))"
        )
    return None


def decide(error: float, threshold: float) -> str:
    """Quantize a layer whose ``error`` is finite and at most ``threshold``, keep the rest.

    Args:
        error: The layer's measured relative error.
        threshold: The largest error a quantized layer may show.

    Returns:
        :data:`QUANTIZED`, or :data:`ABOVE_THRESHOLD`.
    """
    return QUANTIZED if math.isfinite(error) and error <= threshold else ABOVE_THRESHOLD
