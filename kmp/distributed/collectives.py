"""Collectives across the ranks of the job: argument checks, then one call on the engine.

Each function checks its arguments and hands them to the engine
(:class:`kmp.distributed.engines.Engine`) that :mod:`kmp.distributed.world` holds:
:class:`~kmp.distributed.engines.SingleProcess` in a world of one (the input comes
back), Horovod (:mod:`kmp.distributed._horovod`: TensorFlow tensors, buckets,
compression) or JAX (:mod:`kmp.distributed._jax`: host values, NumPy results).
Keras 3 variables are accepted everywhere a variable is expected. No collective
starts an engine: in a job the launcher started as several processes, a collective
called before :func:`kmp.distributed.init` raises a ``RuntimeError`` that says so.
The accepted reduction and compression names are those of :mod:`kmp._names`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from typing import Any

from kmp._checks import check_int
from kmp._names import normalize_compression, normalize_reduce_op
from kmp.distributed import _jax, sparse
from kmp.distributed.buckets import check_bucket_bytes
from kmp.distributed.engines import SINGLE_PROCESS, Engine, Transport
from kmp.distributed.sparse import DEFAULT_SPARSE_GRADIENTS, check_sparse_gradients
from kmp.distributed.world import engine, world

__all__ = [
    "alone",
    "allgather",
    "allreduce",
    "barrier",
    "broadcast_object",
    "broadcast_variables",
    "check_averaging_runtime",
    "grouped_allreduce",
    "gradients_need_allreduce",
    "unique_variables",
]


# ------------------------------------------------------------------- helpers


def _engine() -> Engine:
    """The engine for a collective: none is needed in a world of one, whatever runs.

    Raises:
        RuntimeError: A launched multi-process job where :func:`kmp.distributed.init`
            has not run (:func:`kmp.distributed.world.engine`).
    """
    running = engine()
    return SINGLE_PROCESS if world().size == 1 else running


def _check_root(root: Any) -> int:
    """Check ``root``: an integer always, and a rank of this job when it has several.

    Raises:
        TypeError: ``root`` is not an integer.
        ValueError: ``root`` is not a rank of this job.
    """
    n = world().size
    if n == 1:  # A world of one ignores root; only its type can be wrong.
        return check_int("root", root, minimum=None, hint="Pass the rank whose values are sent.")
    return check_int(
        "root",
        root,
        minimum=0,
        maximum=n - 1,
        hint=f"It is the rank whose values are sent; this job has {n} ranks.",
    )


def check_averaging_runtime(world_size: int) -> None:
    """Check that gradients can be averaged over ``world_size`` ranks here.

    The one rule for where kmp's optimizers average gradients: any Keras backend
    in a world of one; on the JAX engine, the JAX backend (the distribution
    averages them); on Horovod, the TensorFlow backend (Horovod's collectives
    are TensorFlow ops) and no ``tf.distribute`` strategy in force.

    Raises:
        RuntimeError: Several ranks on another backend, or inside a strategy's scope;
            on the JAX engine, kmp's distribution gone (``clear_session()``);
            or a launched multi-process job where :func:`kmp.distributed.init` has
            not run (nothing says which engine would average).
    """
    if world_size == 1:
        return
    import keras

    backend = keras.backend.backend()
    if engine().name == "jax":
        if backend != "jax":
            raise RuntimeError(
                f"The JAX engine runs {world_size} processes, but KERAS_BACKEND is {backend!r}; "
                "set KERAS_BACKEND=jax (kmp launch --engine jax does)."
            )
        if _jax.distribution_lost():
            raise RuntimeError(
                f"kmp's data-parallel distribution over the {world_size} JAX processes is no "
                "longer Keras's distribution (keras.backend.clear_session() drops it, as does "
                "another keras.distribution.set_distribution): each process would train "
                "alone and the ranks drift apart. Call kmp.distributed.init() again after "
                "clear_session(); it sets the distribution again."
            )
        return
    if backend != "tensorflow":
        raise RuntimeError(
            f"{world_size} Horovod ranks are running, but kmp averages gradients only on the "
            f"TensorFlow backend (Horovod's collectives are TensorFlow ops) and KERAS_BACKEND "
            f"is {backend!r}. Set KERAS_BACKEND=tensorflow, or run one process, or use the JAX "
            "engine (kmp launch --engine jax)."
        )
    import tensorflow as tf

    if tf.distribute.has_strategy():
        raise RuntimeError(
            "kmp.wrap_optimizer averages gradients with Horovod; do not also use a "
            "tf.distribute strategy. Build and fit the model outside strategy.scope()."
        )


def gradients_need_allreduce() -> bool:
    """True when kmp's optimizer must average the gradients itself (several Horovod ranks).

    In a world of one there is nothing to average; on the JAX engine the step
    averages them (:mod:`kmp.distributed._jax_step`: one flat all-reduce), so they
    arrive averaged and are not reduced a second time.

    Raises:
        RuntimeError: A launched multi-process job where :func:`kmp.distributed.init`
            has not run.
    """
    return _engine().optimizer_averages


# --------------------------------------------------------------- collectives


def alone() -> contextlib.AbstractContextManager:
    """Return a context in which this process works alone (e.g. the chief saving a model).

    On the JAX engine, Keras's distribution is lifted inside it, so variables
    that Keras creates while saving stay on this process instead of waiting for
    the others. Elsewhere it changes nothing.
    """
    return _engine().alone()


def barrier() -> None:
    """Block until every process reaches this call (no-op in a single process)."""
    _engine().barrier()


def unique_variables(variables: Iterable[Any]) -> list[Any]:
    """``variables`` in order, each object once (a variable shared by two lists counts once)."""
    seen: set[int] = set()
    unique = []
    for v in variables:
        if id(v) not in seen:
            seen.add(id(v))
            unique.append(v)
    return unique


def broadcast_variables(variables: Iterable[Any], root: int = 0) -> Any:
    """Overwrite ``variables`` on every rank with their values on rank ``root``.

    Accepts Keras 3 variables (``model.variables``, ``optimizer.variables``) and
    ``tf.Variable``; works eagerly and inside ``tf.function``. Duplicates are
    broadcast once. In a single process nothing happens.

    Args:
        variables: The variables to synchronise, in the same order on all ranks.
        root: The rank whose values win.

    Returns:
        The TensorFlow op group in graph mode, else None.

    Raises:
        TypeError: ``root`` is not an integer.
        ValueError: ``root`` is not a rank of this job.
    """
    running = _engine()
    return running.broadcast_variables(unique_variables(variables), _check_root(root))


def broadcast_object(obj: Any, root: int = 0) -> Any:
    """Return rank ``root``'s ``obj`` (any picklable object) on every rank.

    Args:
        obj: The object; only rank ``root``'s is used.
        root: The rank whose object wins.

    Returns:
        Rank ``root``'s object (``obj`` itself in a single process).

    Raises:
        TypeError: ``root`` is not an integer.
        ValueError: ``root`` is not a rank of this job.
    """
    running = _engine()
    return running.broadcast_object(obj, _check_root(root))


def allreduce(x: Any, op: str = "average", compression: str | None = None) -> Any:
    """Reduce one tensor across all ranks.

    Args:
        x: A tensor (TensorFlow backend), array or number.
        op: ``"average"``, ``"sum"``, ``"min"``, ``"max"`` or ``"product"``.
        compression: ``None``, ``"fp16"`` or ``"bf16"``: floating tensors are sent in
            that dtype and cast back after.

    Returns:
        The reduced tensor (``x`` itself in a single process).

    Raises:
        TypeError: ``op`` or ``compression`` of the wrong type.
        ValueError: An unknown ``op`` or ``compression``.
    """
    return grouped_allreduce([x], op=op, compression=compression)[0]


def grouped_allreduce(
    tensors: Sequence[Any],
    op: str = "average",
    compression: str | None = None,
    bucket_bytes: int | None = None,
    sparse_gradients: str = DEFAULT_SPARSE_GRADIENTS,
) -> list[Any]:
    """Reduce several tensors across all ranks in fused Horovod operations.

    ``None`` entries are passed through. Sparse gradients (``tf.IndexedSlices``)
    follow ``sparse_gradients`` (:mod:`kmp.distributed.sparse`): ``"dense"``
    scatters them into dense tensors of their ``dense_shape`` that are reduced
    with the rest; ``"gather"`` allgathers their rows and indices (compressed
    too) after the buckets, for ``"average"`` and ``"sum"`` only. With
    ``compression="fp16"`` floating tensors go through Horovod's allreduce in
    float16 (pre-scaled by ``1/size`` for ``"average"`` so the sum cannot
    overflow where the mean would not). Horovod has no bfloat16
    reduction, so ``"bf16"`` sends the bfloat16 bit patterns with one fused
    allgather and sums them locally in float32: half the bytes of float32 for two
    ranks, growing with the number of ranks (prefer ``"fp16"`` beyond a few).
    Results keep each input's dtype.

    Without ``bucket_bytes`` all tensors go in one fused operation, which waits
    for the last of them. With it they are reduced in buckets of about that
    many bytes (as sent, after compression), last tensor first, each bucket its
    own fused operation (:func:`kmp.distributed.buckets.plan_buckets`): inside a
    ``tf.function`` with two or more inter-op threads a bucket starts as soon as
    its tensors exist, so the last layers' gradients travel while the backward
    pass computes the first ones (with one inter-op thread TensorFlow starts them
    only after it, and a warning says so).

    Args:
        tensors: The tensors to reduce, in the same order on every rank.
        op: One of :data:`kmp._names.REDUCE_OPS`.
        compression: ``None``, ``"fp16"`` or ``"bf16"``.
        bucket_bytes: Bytes per bucket, or None for a single fused operation.
        sparse_gradients: ``"dense"`` or ``"gather"``.

    Returns:
        A list of reduced tensors (the inputs themselves in a single process).

    Raises:
        TypeError: ``op``, ``compression``, ``bucket_bytes`` or ``sparse_gradients``
            of the wrong type.
        ValueError: An unknown ``op``, ``compression`` or ``sparse_gradients``,
            ``bucket_bytes`` below 1, or gathered sparse gradients with an ``op``
            other than ``"average"`` or ``"sum"``.
    """
    op = normalize_reduce_op(op)
    comp = normalize_compression(compression)
    bucket_bytes = check_bucket_bytes(bucket_bytes)
    strategy = check_sparse_gradients(sparse_gradients)
    tensors = list(tensors)
    idx = [i for i, t in enumerate(tensors) if t is not None]
    gathered = strategy == "gather" and any(sparse.is_sparse(tensors[i]) for i in idx)
    if gathered and op not in ("average", "sum"):
        raise ValueError(
            f"Sparse gradients (tf.IndexedSlices) can be gathered for op='average' or 'sum', "
            f"not {op!r}; pass sparse_gradients='dense' to reduce them as dense tensors."
        )
    running = _engine()
    if not idx:
        return tensors
    how = Transport(comp, bucket_bytes, strategy)
    reduced = running.grouped_allreduce([tensors[i] for i in idx], op, how)
    for i, r in zip(idx, reduced, strict=True):
        tensors[i] = r
    return tensors


def allgather(x: Any) -> Any:
    """Concatenate ``x`` from all ranks along its first axis (rank order).

    Scalars are treated as shape ``[1]``, so the result always has a first axis
    of ``size() * len(x)``.

    Args:
        x: A tensor, array, number or variable, of the same shape past the first
            axis on every rank.

    Returns:
        The gathered tensor (``x``, with scalars reshaped to ``[1]``, in a single process).
    """
    return _engine().allgather(x)
