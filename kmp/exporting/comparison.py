"""How close an exported file's outputs are to the float32 Keras model's: :func:`compare`.

Pure NumPy over two arrays of outputs (and the caller's labels), so the measures are
defined once and testable on made-up numbers:

* **largest absolute difference**: ``max |exported - keras|``;
* **largest relative difference**: ``max |exported - keras| / max(|keras|, floor)``, the
  floor being 1e-3 of the largest ``|keras|``: outputs a thousand times smaller than the
  largest (a softmax's near-zero probabilities) count by their absolute difference against
  that floor, not by a ratio of two roundings;
* **top-1 agreement** (a float output with classes on its last axis, two or more): the
  share of rows (tokens, for a language model) whose highest class is the same;
* **identical values** (an integer or boolean output: token ids, masks): the share of
  values that are equal;
* with labels, a classifier's (rank 2) **accuracy** of both, and a language model's
  (rank 3, ``[batch, sequence, vocabulary]``) **perplexity** of the labels under both and
  its **relative difference** ``|exported - keras| / keras``. Outputs that are
  probabilities (in [0, 1], summing to 1) are read as such, any others as logits
  (:mod:`kmp._outputs` holds these rules, shared with ``kmp.quantize`` and the benchmark).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from kmp._outputs import accuracy, has_classes, perplexity

__all__ = ["Comparison", "compare"]

# A relative difference divides by at least this share of the largest |keras| output.
RELATIVE_FLOOR = 1e-3


@dataclasses.dataclass(frozen=True)
class Comparison:
    """The measured differences (None where a measure does not apply)."""

    samples: int
    max_abs_diff: float
    max_rel_diff: float
    top1_agreement: float | None = None
    identical: float | None = None
    accuracy: float | None = None
    float32_accuracy: float | None = None
    perplexity: float | None = None
    float32_perplexity: float | None = None
    perplexity_diff: float | None = None


def _labelled(ref: np.ndarray, got: np.ndarray, labels: Any) -> dict[str, float]:
    """Accuracy (rank 2) or perplexity (rank 3) of both outputs on ``labels``."""
    try:
        if ref.ndim != 3:
            return {"float32_accuracy": accuracy(ref, labels), "accuracy": accuracy(got, labels)}
        ppl_ref, ppl_got = perplexity(ref, labels), perplexity(got, labels)
    except ValueError as exc:
        raise ValueError(f"kmp.export: {exc}") from None
    return {
        "float32_perplexity": ppl_ref,
        "perplexity": ppl_got,
        "perplexity_diff": abs(ppl_got - ppl_ref) / ppl_ref,
    }


def compare(reference: Any, exported: Any, labels: Any = None) -> Comparison:
    """Measure how far ``exported`` is from ``reference`` (the float32 Keras outputs).

    Args:
        reference: The float32 Keras model's outputs.
        exported: The exported file's outputs on the same inputs, as its runtime gave them.
        labels: Optional class indices (or one-hot labels) for a classifier's rows or a
            language model's tokens; they add accuracy, or perplexity.

    Returns:
        The :class:`Comparison`.

    Raises:
        ValueError: The shapes differ, or ``labels`` do not fit the outputs.
    """
    exact = np.asarray(reference).dtype.kind in "biu"  # ids and masks: equal or not
    ref = np.asarray(reference, dtype=np.float64)
    got = np.asarray(exported, dtype=np.float64)
    if ref.shape != got.shape:
        raise ValueError(
            f"kmp.export: the exported file returned outputs of shape {got.shape}, the Keras "
            f"model {ref.shape}: the export is broken; please report it with the model."
        )
    diff = np.abs(got - ref)
    largest = float(np.abs(ref).max()) if ref.size else 0.0
    floor = max(largest * RELATIVE_FLOOR, np.finfo(np.float32).tiny)
    rel = diff / np.maximum(np.abs(ref), floor)
    fields: dict[str, Any] = {
        "samples": int(ref.shape[0]) if ref.ndim else 1,
        "max_abs_diff": float(diff.max()) if diff.size else 0.0,
        "max_rel_diff": float(rel.max()) if rel.size else 0.0,
    }
    if exact:
        fields["identical"] = float((ref == got).mean()) if ref.size else 1.0
    if has_classes(ref) and not exact:
        same = ref.argmax(axis=-1) == got.argmax(axis=-1)
        fields["top1_agreement"] = float(same.mean())
        if labels is not None:
            fields.update(_labelled(ref, got, labels))
    elif labels is not None:
        raise ValueError(
            f"kmp.export: labels were given, but the outputs (shape {ref.shape}, "
            f"{np.asarray(reference).dtype}) hold no classes on their last axis: labels "
            "measure a classifier's accuracy or a language model's perplexity. Leave "
            "labels out for other models."
        )
    return Comparison(**fields)
