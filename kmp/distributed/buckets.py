"""Which gradients travel together, and how many bytes they are: the bucket plan.

A backward pass produces the gradients of the last layers first. Reducing them
in buckets, in reverse variable order, each bucket its own grouped collective,
lets the first buckets travel while the backward pass still computes the rest;
one bucket (:func:`plan_buckets` without a size) waits for all of them.
:func:`plan_buckets` is the pure decision, on the sizes :func:`payload_bytes`
measures; the Horovod engine (:mod:`kmp.distributed._horovod`) acts on it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from kmp._checks import check_int
from kmp._names import normalize_compression
from kmp.distributed import sparse
from kmp.distributed.sparse import DEFAULT_SPARSE_GRADIENTS, check_sparse_gradients

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "check_bucket_bytes",
    "overlap_warning",
    "payload_bytes",
    "plan_buckets",
]

# The bucket size kmp.wrap_optimizer uses unless told otherwise, chosen by `kmp bench --only
# peers` (docs/performance.md): a model of less than 4 MiB of gradients (the digits CNN) keeps
# one bucket, since smaller buckets cost one Horovod negotiation each and lost 5-15 % on one
# host; a big model (42 MB) gets one bucket per wide layer, which overlapped the backward pass.
DEFAULT_BUCKET_BYTES: int | None = 4 * 1024 * 1024


def check_bucket_bytes(bucket_bytes: int | None) -> int | None:
    """Check a ``bucket_bytes`` setting: None (one bucket) or a positive integer.

    Raises:
        TypeError: ``bucket_bytes`` is neither None nor an integer.
        ValueError: ``bucket_bytes`` is below 1.
    """
    if bucket_bytes is None:
        return None
    return check_int(
        "bucket_bytes",
        bucket_bytes,
        minimum=1,
        hint="Pass the bytes per allreduce bucket (e.g. 4 * 2**20), or None for one bucket.",
    )


def plan_buckets(sizes: Sequence[int], bucket_bytes: int | None) -> list[list[int]]:
    """Group tensor positions into allreduce buckets, last tensor first.

    Walking from the last position to the first, a bucket is closed as soon as
    it holds at least ``bucket_bytes``; the rest form the last bucket. A tensor
    larger than ``bucket_bytes`` gets a bucket of its own. Positions whose size
    is 0 (absent gradients) join whichever bucket is open.

    Args:
        sizes: Bytes each tensor hands to the collective, in variable order.
        bucket_bytes: The size at which a bucket is closed; None: one bucket.

    Returns:
        The buckets in the order they are reduced, each a list of positions in
        ascending order. No positions, no buckets.

    Raises:
        TypeError: ``bucket_bytes`` is neither None nor an integer.
        ValueError: ``bucket_bytes`` is below 1.
    """
    bucket_bytes = check_bucket_bytes(bucket_bytes)
    positions = list(range(len(sizes)))
    if not positions:
        return []
    if bucket_bytes is None:
        return [positions]
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for i in reversed(positions):
        current.append(i)
        filled += int(sizes[i])
        if filled >= bucket_bytes:
            buckets.append(sorted(current))
            current, filled = [], 0
    if current:
        buckets.append(sorted(current))
    return buckets


def overlap_warning(n_buckets: int, inter_op_threads: int) -> str | None:
    """What to tell a user whose buckets cannot overlap the backward pass, or None.

    With one inter-op thread TensorFlow's executor keeps running the chain of
    compute ops it is on and starts an asynchronous Horovod op only when that
    chain ends, so every bucket waits for the whole backward pass (measured:
    ``docs/performance.md``). 0 means TensorFlow's default (one per core).

    Args:
        n_buckets: How many buckets the plan has.
        inter_op_threads: ``tf.config.threading.get_inter_op_parallelism_threads()``.
    """
    if n_buckets < 2 or inter_op_threads != 1:
        return None
    return (
        f"The gradients are reduced in {n_buckets} buckets, but TensorFlow runs one inter-op "
        "thread, so no bucket starts before the backward pass ends. Set "
        "tf.config.threading.set_inter_op_parallelism_threads(2) (or TF_NUM_INTEROP_THREADS=2) "
        "for the allreduce to overlap the backward pass, or bucket_bytes=None."
    )


def _dtype_name(dt: Any) -> str:
    name = getattr(dt, "name", None) or str(dt)
    return "float16" if name == "bfloat16" else name  # numpy has no bfloat16; same size


def payload_bytes(
    tensors: Iterable[Any],
    compression: str | None = None,
    sparse_gradients: str = DEFAULT_SPARSE_GRADIENTS,
) -> int:
    """Return how many bytes one rank hands to the collectives for ``tensors``.

    Floating-point tensors count at 2 bytes per element when ``compression`` is
    ``"fp16"`` or ``"bf16"``; everything else at its own item size. ``None``
    entries count nothing. A sparse gradient (``tf.IndexedSlices``) counts as
    ``sparse_gradients`` sends it (:mod:`kmp.distributed.sparse`): its dense shape
    (``"dense"``), or its values and indices (``"gather"``). A dimension unknown
    while tracing (a sparse gradient's rows, usually) counts as 0, so the figure
    is then a lower bound.

    Args:
        tensors: Tensors, arrays, variables or ``tf.IndexedSlices``.
        compression: As accepted by :func:`kmp._names.normalize_compression`.
        sparse_gradients: ``"dense"`` or ``"gather"``.

    Returns:
        The number of bytes.

    Raises:
        TypeError: ``compression`` or ``sparse_gradients`` of the wrong type.
        ValueError: An unknown ``compression`` or ``sparse_gradients``.
    """
    import numpy as np

    comp = normalize_compression(compression)
    strategy = check_sparse_gradients(sparse_gradients)
    total = 0
    for t in tensors:
        if t is None:
            continue
        parts = sparse.parts_sent(t, strategy) if sparse.is_sparse(t) else [(t.shape, t.dtype)]
        for shape, dtype in parts:
            dtype = np.dtype(_dtype_name(dtype))
            item = 2 if comp and dtype.kind == "f" else dtype.itemsize
            total += sparse.count(tuple(shape)) * item
    return total
