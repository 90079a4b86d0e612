"""The Horovod engine: every call into ``horovod.tensorflow`` that kmp.distributed makes.

:mod:`kmp.distributed.world` starts it (:func:`start`, which returns the
:class:`HorovodEngine`) and :mod:`kmp.distributed.collectives` hands it checked
values; nothing here validates user arguments or handles the single-process case.
The engine turns the values into dense TensorFlow tensors, plans the buckets
(:mod:`kmp.distributed.buckets`) and sends them.
Only Horovod's core TensorFlow collectives are used (``allreduce``,
``grouped_allreduce``, ``allgather``, ``grouped_allgather``, ``broadcast``; sparse
gradients by :func:`grouped_allgather_slices`):
Horovod's Keras layer does not work with Keras 3. Keras 3 variables are accepted
where a variable is expected; their ``.value`` (the ``tf.Variable``) is what Horovod sees.

Horovod itself is imported only by :func:`start`; the functions take the
imported module as their first argument, so importing this module stays light.
:func:`adopt` takes the Horovod a script initialised itself (``hvd.init()`` before
kmp), found in ``sys.modules``: it neither imports nor initialises anything.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from kmp._imports import INSTALL_HINTS, optional_import
from kmp.distributed import sparse
from kmp.distributed._op_names import named
from kmp.distributed._scatter_reduce import scatter_reduce
from kmp.distributed.buckets import overlap_warning, payload_bytes, plan_buckets
from kmp.distributed.engines import Engine, Layout, Transport

__all__ = [
    "COMPRESSED_PATH",
    "COMPRESSED_PATHS",
    "HorovodEngine",
    "adopt",
    "grouped_allgather_slices",
    "grouped_allreduce",
    "start",
]


def start(launched: int, *, elastic: bool = False) -> HorovodEngine | None:
    """Import and initialise ``horovod.tensorflow`` for a job of ``launched`` processes.

    Args:
        launched: The world size the launcher announced.
        elastic: An elastic job (``HOROVOD_ELASTIC=1``): Horovod is needed even
            while the world is one process.

    Returns:
        The engine, or None when the launcher started a single process and
        Horovod is not installed (nothing to do).

    Raises:
        ImportError: ``launched > 1`` but Horovod cannot be imported; the message
            says how to install it.
    """
    try:
        hvd = optional_import("horovod.tensorflow", feature="multi-process training")
    except ImportError as exc:
        if launched > 1 or elastic:
            raise ImportError(
                f"This script was launched as {launched} processes, but Horovod is not "
                f"available, so gradients could not be averaged across them ({exc}). Install "
                f"Horovod: {INSTALL_HINTS['horovod']}; or run a single process without horovodrun."
            ) from exc
        return None
    hvd.init()
    return HorovodEngine(hvd)


def adopt() -> HorovodEngine | None:
    """The engine around the Horovod the script started itself, or None.

    A script that calls ``hvd.init()`` before kmp (Horovod's own examples, TF1
    scripts) already runs Horovod; kmp takes that module as its engine rather
    than initialising it again. Horovod is looked up in ``sys.modules``, never
    imported, and nothing is started: a getter may call this.

    Returns:
        The engine when ``horovod.tensorflow`` is imported and
        ``hvd.is_initialized()``; None otherwise.
    """
    hvd = sys.modules.get("horovod.tensorflow")
    is_initialized = getattr(hvd, "is_initialized", None)
    if is_initialized is None or not is_initialized():
        return None
    return HorovodEngine(hvd)


def _as_tf_variable(v: Any) -> Any:
    """The ``tf.Variable`` behind a Keras 3 variable; anything else as it is."""
    import keras

    return v.value if isinstance(v, keras.Variable) else v


class HorovodEngine(Engine):
    """Horovod's TensorFlow collectives; kmp's optimizer averages the gradients through them.

    Args:
        hvd: The initialised ``horovod.tensorflow`` module.
    """

    name = "horovod"
    optimizer_averages = True

    def __init__(self, hvd: ModuleType):
        self.hvd = hvd

    def layout(self) -> Layout:
        """Horovod's ``(rank, size, local_rank, local_size, cross_rank, cross_size)``."""
        hvd = self.hvd
        calls = (hvd.rank, hvd.size, hvd.local_rank, hvd.local_size, hvd.cross_rank, hvd.cross_size)
        return tuple(int(f()) for f in calls)  # type: ignore[return-value]

    def restart(self) -> None:
        """Shut Horovod down and initialise it again: an elastic job's new world.

        In an elastic job ``init`` asks the driver's rendezvous for this worker's new
        rank and size, and waits until every worker of the new world has asked.
        """
        self.hvd.shutdown()
        self.hvd.init()

    def close(self) -> None:
        """Refuse: Horovod cannot be started a second time in a process.

        Raises:
            RuntimeError: Always.
        """
        raise RuntimeError("Cannot reset a running Horovod job.")

    def barrier(self) -> None:
        """Block until every rank gets here (a tiny blocking allreduce)."""
        import tensorflow as tf

        hvd = self.hvd
        hvd.allreduce(tf.constant(0, tf.int32), op=hvd.Sum, name="kmp.barrier").numpy()

    def broadcast_variables(self, variables: Sequence[Any], root: int) -> Any:
        """Overwrite ``variables`` with rank ``root``'s values.

        On the TensorFlow backend the ``tf.Variable`` objects are broadcast (eagerly
        or inside a ``tf.function``); on another Keras backend the values move
        through TensorFlow eagerly and are assigned back.

        Returns:
            Horovod's op group in graph mode, else None.
        """
        import keras
        import tensorflow as tf

        if not variables:
            return None
        hvd = self.hvd
        if keras.backend.backend() != "tensorflow":
            import numpy as np

            for i, v in enumerate(variables):
                value = _broadcast(hvd, tf.constant(np.asarray(v)), root, name=f"kmp.bcast.{i}")
                v.assign(value.numpy())
            return None
        tf_variables = [_as_tf_variable(v) for v in variables]
        wide = [v for v in tf_variables if v.dtype != tf.bfloat16]
        # Horovod's broadcast has no bfloat16: those travel as their int16 bit patterns.
        narrow = [
            v.assign(_broadcast(hvd, v, root)) for v in tf_variables if v.dtype == tf.bfloat16
        ]
        group = hvd.broadcast_variables(wide, root_rank=root) if wide else None
        return group if not narrow else tf.group(*narrow, *([group] if group is not None else []))

    def broadcast_object(self, obj: Any, root: int) -> Any:
        """Return rank ``root``'s ``obj`` (pickled through Horovod)."""
        return self.hvd.broadcast_object(obj, root_rank=root)

    def allgather(self, x: Any) -> Any:
        """Concatenate ``x`` from every rank along its first axis (a scalar as ``[1]``)."""
        import tensorflow as tf

        t = tf.convert_to_tensor(_as_tf_variable(x))
        if t.shape.rank == 0:
            t = tf.reshape(t, [1])
        return named(self.hvd.allgather, "allgather", t)

    def grouped_allreduce(self, tensors: Sequence[Any], op: str, how: Transport) -> list[Any]:
        """Reduce ``tensors`` in buckets of fused operations; gathered sparse gradients last.

        Dense values and sparse gradients sent ``"dense"`` go in the buckets of
        :func:`kmp.distributed.buckets.plan_buckets` (last tensor first), each
        bucket one :func:`grouped_allreduce`; with one inter-op thread a warning
        says the buckets cannot overlap the backward pass. Sparse gradients sent
        ``"gather"`` come after (the embeddings come first, so their gradients
        come last), through :func:`grouped_allgather_slices`.
        """
        import tensorflow as tf

        result: list[Any] = list(tensors)
        gathering = how.sparse_gradients == "gather"
        gather = [i for i, t in enumerate(tensors) if gathering and sparse.is_sparse(t)]
        idx = [i for i in range(len(tensors)) if i not in gather]
        dense = [
            sparse.densify(tensors[i])
            if sparse.is_sparse(tensors[i])
            else tf.convert_to_tensor(_as_tf_variable(tensors[i]))
            for i in idx
        ]
        comp = how.compression
        plan = plan_buckets([payload_bytes([t], comp) for t in dense], how.bucket_bytes)
        message = overlap_warning(len(plan), tf.config.threading.get_inter_op_parallelism_threads())
        if message:  # stacklevel: the caller of kmp.distributed.grouped_allreduce
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        for bucket in plan:
            reduced = grouped_allreduce(self.hvd, [dense[j] for j in bucket], op, comp)
            for j, r in zip(bucket, reduced, strict=True):
                result[idx[j]] = r
        if gather:
            slices = [tensors[i] for i in gather]
            gathered = grouped_allgather_slices(self.hvd, slices, op, comp)
            for i, r in zip(gather, gathered, strict=True):
                result[i] = r
        return result


def _op(hvd: ModuleType, op: str) -> Any:
    """Horovod's constant for a canonical reduction name."""
    return {
        "average": hvd.Average,
        "sum": hvd.Sum,
        "min": hvd.Min,
        "max": hvd.Max,
        "product": hvd.Product,
    }[op]


def _broadcast(hvd: ModuleType, tensor: Any, root: int, **kwargs: Any) -> Any:
    """``hvd.broadcast``, bfloat16 included (Horovod has no bfloat16: its int16 bits travel)."""
    import tensorflow as tf

    if tensor.dtype != tf.bfloat16:
        return hvd.broadcast(tensor, root, **kwargs)
    return tf.bitcast(hvd.broadcast(tf.bitcast(tensor, tf.int16), root, **kwargs), tf.bfloat16)


# How a compressed (fp16 / bf16) average or sum of floating tensors is reduced:
# "scatter": kmp/distributed/_scatter_reduce.py (alltoall, one float32 sum in TensorFlow,
# allgather); "horovod": Horovod's float16 allreduce, or kmp's bf16 allgather-sum.
# Chosen by bench/compressed.py (docs/performance.md).
COMPRESSED_PATHS = ("scatter", "horovod")
COMPRESSED_PATH = "horovod"


def grouped_allreduce(
    hvd: ModuleType,
    dense: list[Any],
    op: str,
    compression: str | None,
    path: str = COMPRESSED_PATH,
) -> list[Any]:
    """Reduce dense TensorFlow tensors across ranks; each result keeps its input's dtype.

    Args:
        hvd: The Horovod module.
        dense: Dense ``tf.Tensor`` objects, same order and shapes on every rank.
        op: A canonical reduction name (``kmp._names.REDUCE_OPS``).
        compression: A canonical compression (None, ``"fp16"`` or ``"bf16"``).
        path: How a compressed average or sum travels (:data:`COMPRESSED_PATHS`).

    Returns:
        The reduced tensors, in order.
    """
    import tensorflow as tf

    n = int(hvd.size())

    def plain(tensors: list[Any]) -> list[Any]:
        return grouped_allreduce(hvd, tensors, op, None)

    floating = [i for i, t in enumerate(dense) if t.dtype.is_floating]
    if compression and path == "scatter" and op in ("average", "sum") and floating:
        return _partitioned(
            dense, floating, lambda ts: scatter_reduce(hvd, ts, op, compression), plain
        )
    if compression == "bf16":
        return _partitioned(dense, floating, lambda ts: _bf16_gather_reduce(hvd, ts, op, n), plain)
    bf16 = [i for i, t in enumerate(dense) if t.dtype == tf.bfloat16]
    if compression is None and bf16:
        # Horovod has no bfloat16 reduction: bfloat16 tensors (the gradients of bfloat16
        # weights) travel as they are through the allgather path, the rest as usual.
        return _partitioned(dense, bf16, lambda ts: _bf16_gather_reduce(hvd, ts, op, n), plain)
    sent = [
        tf.cast(t, tf.float16) if compression == "fp16" and t.dtype.is_floating else t
        for t in dense
    ]
    if compression == "fp16" and op == "average":
        # Pre-scale by 1/n so the float16 sum cannot overflow where the mean would not.
        out = _grouped_by_dtype(hvd, sent, op=hvd.Sum, prescale_factor=1.0 / n)
    else:
        out = _grouped_by_dtype(hvd, sent, op=_op(hvd, op))
    return [
        o if o.dtype == t.dtype else tf.cast(o, t.dtype) for o, t in zip(out, dense, strict=True)
    ]


def _grouped_by_dtype(hvd: ModuleType, tensors: list[Any], **kwargs: Any) -> list[Any]:
    """One fused Horovod allreduce per dtype (a grouped op takes a single dtype)."""
    by_dtype: dict[Any, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    out: list[Any] = [None] * len(tensors)
    for positions in by_dtype.values():
        group = [tensors[i] for i in positions]
        reduced = named(hvd.grouped_allreduce, "grouped_allreduce", group, **kwargs)
        for i, r in zip(positions, reduced, strict=True):
            out[i] = r
    return out


def _partitioned(
    tensors: list[Any], chosen: list[int], reduce_chosen: Any, reduce_rest: Any
) -> list[Any]:
    """Reduce the ``chosen`` positions with one function and the rest with another, in order."""
    rest = [i for i in range(len(tensors)) if i not in chosen]
    out: list[Any] = [None] * len(tensors)
    for positions, reduce in ((chosen, reduce_chosen), (rest, reduce_rest)):
        if positions:
            reduced = reduce([tensors[i] for i in positions])
            for i, r in zip(positions, reduced, strict=True):
                out[i] = r
    return out


def _bf16_gather_reduce(hvd: ModuleType, floating: list[Any], op: str, n: int) -> list[Any]:
    """Reduce floating tensors as bfloat16 bit patterns: one fused allgather, local float32 math.

    Horovod has no bfloat16 reduction. The tensors are cast to bfloat16, sent as int16 bit
    patterns with one grouped allgather and reduced here in float32, in rank order.
    """
    import tensorflow as tf

    bits = [tf.bitcast(tf.reshape(tf.cast(t, tf.bfloat16), [-1]), tf.int16) for t in floating]
    gathered = named(hvd.grouped_allgather, "bf16_allgather", bits)
    reducer = {
        "average": tf.reduce_mean,
        "sum": tf.reduce_sum,
        "min": tf.reduce_min,
        "max": tf.reduce_max,
        "product": tf.reduce_prod,
    }[op]
    out = []
    for t, g in zip(floating, gathered, strict=True):
        values = tf.reshape(tf.cast(tf.bitcast(g, tf.bfloat16), tf.float32), [n, -1])
        out.append(tf.cast(tf.reshape(reducer(values, axis=0), tf.shape(t)), t.dtype))
    return out


def _grouped_allgather(hvd: ModuleType, tensors: list[Any]) -> list[Any]:
    """One fused Horovod allgather per dtype (a grouped op takes a single dtype)."""
    by_dtype: dict[Any, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    out: list[Any] = [None] * len(tensors)
    for positions in by_dtype.values():
        group = [tensors[i] for i in positions]
        gathered = named(hvd.grouped_allgather, "grouped_allgather", group)
        for i, g in zip(positions, gathered, strict=True):
            out[i] = g
    return out


def grouped_allgather_slices(
    hvd: ModuleType, slices: list[Any], op: str, compression: str | None
) -> list[Any]:
    """Reduce sparse gradients by gathering them: every rank's rows and indices, in rank order.

    The values travel in ``compression``'s dtype (bfloat16 as int16 bit patterns)
    and are cast back; for ``"average"`` they are then divided by the number of
    ranks, as Horovod's ``allreduce`` does for a ``tf.IndexedSlices``.

    Args:
        hvd: The Horovod module.
        slices: ``tf.IndexedSlices``, in the same order on every rank.
        op: ``"average"`` or ``"sum"`` (checked by the caller).
        compression: A canonical compression (None, ``"fp16"`` or ``"bf16"``).

    Returns:
        ``tf.IndexedSlices`` holding every rank's rows, with the inputs' dense shapes.
    """
    import tensorflow as tf

    def send(v: Any) -> Any:
        if compression == "fp16" and v.dtype.is_floating:
            return tf.cast(v, tf.float16)
        if (compression == "bf16" and v.dtype.is_floating) or v.dtype == tf.bfloat16:
            return tf.bitcast(tf.cast(v, tf.bfloat16), tf.int16)  # Horovod has no bfloat16
        return v

    def receive(g: Any, dtype: Any) -> Any:
        if g.dtype == tf.int16 and dtype.is_floating:
            g = tf.bitcast(g, tf.bfloat16)
        return g if g.dtype == dtype else tf.cast(g, dtype)

    n = len(slices)
    gathered = _grouped_allgather(
        hvd, [send(s.values) for s in slices] + [s.indices for s in slices]
    )
    out = []
    for s, values, indices in zip(slices, gathered[:n], gathered[n:], strict=True):
        values = receive(values, s.values.dtype)
        if op == "average":
            values = values / tf.cast(hvd.size(), values.dtype)
        out.append(tf.IndexedSlices(values, indices, s.dense_shape))
    return out
