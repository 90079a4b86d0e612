"""Sparse gradients (``tf.IndexedSlices``): what every step does with them, once.

On the TensorFlow backend an ``Embedding`` (any ``gather`` on a variable) gives its
variable a sparse gradient: the rows one batch used (``values``), which rows they
are (``indices``) and the variable's shape (``dense_shape``). How many rows there
are is usually unknown while the step is traced. kmp's paths treat it alike:

* the finite check and unscaling look at and scale its ``values`` only;
* accumulation (``backward_passes_per_step > 1``) scatter-adds it into the dense
  accumulator, so an accumulated window is dense and is allreduced dense;
* between ranks, ``sparse_gradients`` (:data:`kmp._names.SPARSE_GRADIENTS`) decides:
  ``"dense"`` scatters it into a tensor of its variable's shape that travels with
  the dense gradients (buckets, compression, fused allreduces); ``"gather"``
  allgathers its values (compressed too) and indices and divides the values by
  the number of ranks for an average, as Horovod's ``DistributedOptimizer`` does
  without ``sparse_as_dense``. Every rank gets the same rows in rank order, so
  both keep the ranks bit-identical.

JAX gradients are dense arrays: nothing here changes them. The default was chosen
by ``bench/sparse.py`` (``docs/performance.md``).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

from kmp._checks import check_choice
from kmp._names import SPARSE_GRADIENTS

__all__ = [
    "DEFAULT_SPARSE_GRADIENTS",
    "check_sparse_gradients",
    "count",
    "densify",
    "densify_like",
    "is_sparse",
    "map_values",
    "parts_sent",
    "values_of",
]

# What kmp.wrap_optimizer and the compat paths use unless told otherwise, measured by
# bench/sparse.py (bench/results/sparse.md): a 16384 x 128 Embedding, 512 tokens per rank and
# step, 2 ranks on one host: "gather" sent 0.29 MiB per rank and step against 8 MiB and ran
# 2.15x the steps/s of "dense" (55 against 26; a shared 2-core machine, so noisy). Dense wins
# only when a batch touches a large share of the rows (a small vocabulary, long batches).
DEFAULT_SPARSE_GRADIENTS = "gather"


def check_sparse_gradients(value: Any) -> str:
    """Check a ``sparse_gradients`` setting; return its canonical name.

    Raises:
        TypeError: ``value`` is not a string.
        ValueError: ``value`` is not one of :data:`kmp._names.SPARSE_GRADIENTS`.
    """
    return check_choice(
        "sparse_gradients",
        value,
        SPARSE_GRADIENTS,
        hint="Pass 'dense' (scatter sparse gradients into dense tensors and allreduce them) "
        "or 'gather' (allgather their rows and indices).",
    )


def is_sparse(x: Any) -> bool:
    """True for a ``tf.IndexedSlices`` (never imports TensorFlow to answer)."""
    tf = sys.modules.get("tensorflow")
    return tf is not None and isinstance(x, tf.IndexedSlices)


def values_of(x: Any) -> Any:
    """The ``values`` of a sparse gradient; anything else as it is."""
    return x.values if is_sparse(x) else x


def map_values(x: Any, fn: Callable[[Any], Any]) -> Any:
    """``fn(x)``; for a sparse gradient, the same rows with ``fn`` applied to its values."""
    if not is_sparse(x):
        return fn(x)
    tf = sys.modules["tensorflow"]
    return tf.IndexedSlices(fn(x.values), x.indices, x.dense_shape)


def _static_shape(x: Any) -> tuple[int, ...] | None:
    tf = sys.modules["tensorflow"]
    shape = tf.get_static_value(x.dense_shape)
    return None if shape is None else tuple(int(d) for d in shape)


def densify(x: Any, shape: Sequence[int] | None = None) -> Any:
    """Scatter a sparse gradient into a dense tensor (repeated rows add up).

    Args:
        x: A ``tf.IndexedSlices``.
        shape: Its variable's shape; None: its ``dense_shape`` when known while
            tracing (else TensorFlow's conversion, of unknown static shape).

    Returns:
        A dense ``tf.Tensor`` of the values' dtype.
    """
    import tensorflow as tf

    shape = _static_shape(x) if shape is None else tuple(int(d) for d in shape)
    if shape is None:
        return tf.convert_to_tensor(x)
    rows = tf.math.unsorted_segment_sum(x.values, x.indices, shape[0])
    return tf.reshape(rows, shape)


def densify_like(grads: Sequence[Any], variables: Sequence[Any]) -> list[Any]:
    """``grads`` with each sparse gradient scattered into its variable's shape."""
    return [
        densify(g, tuple(v.shape)) if is_sparse(g) else g
        for g, v in zip(grads, variables, strict=True)
    ]


def parts_sent(x: Any, strategy: str) -> list[tuple[tuple[int | None, ...], Any]]:
    """What a sparse gradient hands to the collective: ``(shape, dtype)`` per part.

    ``"dense"`` sends one tensor of ``dense_shape``; ``"gather"`` sends the values
    and the indices. A dimension unknown while tracing (the rows, usually) is None.
    """
    if strategy == "dense":
        shape = _static_shape(x)
        return [(shape or (None, *x.values.shape[1:]), x.values.dtype)]
    return [(tuple(x.values.shape), x.values.dtype), (tuple(x.indices.shape), x.indices.dtype)]


def count(shape: Sequence[int | None]) -> int:
    """Elements of ``shape``; a dimension unknown while tracing counts as 0."""
    return math.prod(0 if d is None else int(d) for d in shape)
