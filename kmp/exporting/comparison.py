"""How close an exported file's outputs are to the float32 Keras model's: :func:`compare`.

Pure NumPy over two arrays of outputs (and the caller's labels), so the measures are
defined once and testable on made-up numbers:

* **largest absolute difference**: ``max |exported - keras|``;
* **largest relative difference**: ``max |exported - keras| / max(|keras|, floor)``, the
  floor being 1e-3 of the largest ``|keras|``: outputs a thousand times smaller than the
  largest (a softmax's near-zero probabilities) count by their absolute difference against
  that floor, not by a ratio of two roundings;
* **top-1 agreement** (an output with classes on its last axis, two or more): the share of
  rows (tokens, for a language model) whose highest class is the same;
* with labels, a classifier's (rank 2) **accuracy** of both, and a language model's
  (rank 3, ``[batch, sequence, vocabulary]``) **perplexity** of the labels under both and
  its **relative difference** ``|exported - keras| / keras``. Outputs that are
  probabilities (in [0, 1], summing to 1) are read as such, any others as logits.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

__all__ = ["Comparison", "compare", "log_probabilities"]

# A relative difference divides by at least this share of the largest |keras| output.
RELATIVE_FLOOR = 1e-3


@dataclasses.dataclass(frozen=True)
class Comparison:
    """The measured differences (None where a measure does not apply)."""

    samples: int
    max_abs_diff: float
    max_rel_diff: float
    top1_agreement: float | None = None
    accuracy: float | None = None
    float32_accuracy: float | None = None
    perplexity: float | None = None
    float32_perplexity: float | None = None
    perplexity_diff: float | None = None


def log_probabilities(outputs: np.ndarray) -> np.ndarray:
    """Log-probabilities over the last axis: of probabilities as given, or of logits.

    Args:
        outputs: Probabilities (every value in [0, 1], each row summing to 1 within 1e-3)
            or logits.

    Returns:
        float64 log-probabilities of the same shape.
    """
    x = np.asarray(outputs, dtype=np.float64)
    sums = x.sum(axis=-1)
    if x.min() >= 0.0 and x.max() <= 1.0 and np.allclose(sums, 1.0, atol=1e-3):
        return np.log(np.clip(x, 1e-30, None))
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _class_labels(labels: Any, outputs: np.ndarray) -> np.ndarray:
    y = np.asarray(labels)
    if y.shape == outputs.shape:  # one-hot (or soft) targets
        y = y.argmax(axis=-1)
    if y.shape != outputs.shape[:-1]:
        raise ValueError(
            f"kmp.export: labels of shape {y.shape} do not fit outputs of shape "
            f"{outputs.shape}: pass one class index per "
            f"{'row' if outputs.ndim == 2 else 'token'} (shape {outputs.shape[:-1]}), or "
            "one-hot labels of the outputs' shape."
        )
    if not np.issubdtype(y.dtype, np.integer):
        if not np.all(np.equal(np.mod(y, 1), 0)):
            raise ValueError("kmp.export: labels must be class indices (whole numbers).")
        y = y.astype(np.int64)
    return y


def _perplexity(outputs: np.ndarray, labels: np.ndarray) -> float:
    logp = np.take_along_axis(log_probabilities(outputs), labels[..., None], axis=-1)
    return float(np.exp(-logp.mean()))


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
    if ref.ndim >= 2 and ref.shape[-1] >= 2:
        same = ref.argmax(axis=-1) == got.argmax(axis=-1)
        fields["top1_agreement"] = float(same.mean())
        if labels is not None:
            y = _class_labels(labels, ref)
            if ref.ndim == 3:
                ppl_ref, ppl_got = _perplexity(ref, y), _perplexity(got, y)
                fields["float32_perplexity"] = ppl_ref
                fields["perplexity"] = ppl_got
                fields["perplexity_diff"] = abs(ppl_got - ppl_ref) / ppl_ref
            else:
                fields["float32_accuracy"] = float((ref.argmax(axis=-1) == y).mean())
                fields["accuracy"] = float((got.argmax(axis=-1) == y).mean())
    elif labels is not None:
        raise ValueError(
            f"kmp.export: labels were given, but the outputs (shape {ref.shape}) have no "
            "classes on their last axis: labels measure a classifier's accuracy or a "
            "language model's perplexity. Leave labels out for other models."
        )
    return Comparison(**fields)
