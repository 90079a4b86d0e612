"""A model's outputs against labels, once: class labels, accuracy, log-probabilities, perplexity.

Pure NumPy over outputs whose last axis holds the classes (a classifier's
``[batch, classes]``, a language model's ``[batch, sequence, vocabulary]``). Labels are
class indices (one per row or token; the same number in another shape, e.g.
``[batch, 1]``, is accepted) or one-hot labels of the outputs' shape. Outputs are read as
probabilities where they are (every value in [0, 1], each row summing to 1 within 1e-3),
as logits otherwise. ``kmp.export``'s comparison, ``kmp.quantize``'s accuracy and the
inference benchmark (bench/inference.py) all measure with these.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["accuracy", "class_labels", "has_classes", "log_probabilities", "perplexity"]


def has_classes(outputs: np.ndarray) -> bool:
    """Whether ``outputs`` hold two or more classes on a last axis after the batch's."""
    return outputs.ndim >= 2 and outputs.shape[-1] >= 2


def class_labels(labels: Any, outputs: np.ndarray) -> np.ndarray:
    """The labels as integer class indices of shape ``outputs.shape[:-1]``.

    Args:
        labels: Class indices (integers, or whole numbers of a float dtype), one per row
            or token, or one-hot labels of the outputs' shape.
        outputs: The outputs they label, classes on the last axis.

    Returns:
        The class indices, one per row (token).

    Raises:
        ValueError: The labels do not fit the outputs, or are not whole numbers.
    """
    y = np.asarray(labels)
    if y.shape == outputs.shape:  # one-hot (or soft) targets
        y = y.argmax(axis=-1)
    rows = outputs.shape[:-1]
    if y.shape != rows and y.size == math.prod(rows):  # e.g. [batch, 1] ids
        y = y.reshape(rows)
    if y.shape != rows:
        raise ValueError(
            f"labels of shape {y.shape} do not fit outputs of shape {outputs.shape}: pass "
            f"one class index per {'row' if outputs.ndim == 2 else 'token'} (shape {rows}), "
            "or one-hot labels of the outputs' shape."
        )
    if not np.issubdtype(y.dtype, np.integer):
        if not np.all(np.equal(np.mod(y, 1), 0)):
            raise ValueError("labels must be class indices (whole numbers).")
        y = y.astype(np.int64)
    return y


def accuracy(outputs: Any, labels: Any) -> float:
    """The share of rows (tokens) whose highest output is the labelled class.

    Args:
        outputs: The outputs, classes on the last axis.
        labels: Their labels (see :func:`class_labels`).

    Returns:
        The top-1 accuracy, in [0, 1].

    Raises:
        ValueError: The labels do not fit the outputs.
    """
    x = np.asarray(outputs)
    return float((x.argmax(axis=-1) == class_labels(labels, x)).mean())


def log_probabilities(outputs: Any) -> np.ndarray:
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


def perplexity(outputs: Any, labels: Any) -> float:
    """The labels' perplexity under ``outputs``: ``exp`` of their mean negative log-probability.

    Args:
        outputs: Probabilities or logits, classes (the vocabulary) on the last axis.
        labels: Their labels (see :func:`class_labels`).

    Returns:
        The perplexity (1 for certainty, the vocabulary's size for uniform outputs).

    Raises:
        ValueError: The labels do not fit the outputs.
    """
    x = np.asarray(outputs)
    y = class_labels(labels, x)
    logp = np.take_along_axis(log_probabilities(x), y[..., None], axis=-1)
    return float(np.exp(-logp.mean()))
