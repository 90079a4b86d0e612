"""The Horovod runtime behind a small surface, with a single-process fallback.

Call :func:`init` once at the top of a training script. Under ``horovodrun``
(or ``mpirun``) it initialises Horovod and gives each local rank one GPU with
memory growth; started as a plain ``python train.py`` it is a harmless no-op and
every function here behaves as a world of one process (``size() == 1``,
collectives return their input). The other functions call :func:`init` on
first use, so a forgotten ``init()`` never silently trains unsynchronised ranks.

Only Horovod's core TensorFlow collectives are used (``allreduce``,
``grouped_allreduce``, ``allgather``, ``broadcast``): Horovod's Keras layer does
not work with Keras 3. Keras 3 variables are accepted everywhere a variable is
expected; their ``.value`` (the ``tf.Variable``) is what Horovod sees.

Example::

    import kmp
    world = kmp.distributed.init()
    print(world.rank, world.size)
    total = kmp.distributed.allreduce(local_count, op="sum")
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from collections.abc import Iterable, Sequence
from types import ModuleType
from typing import Any

from kmp._imports import INSTALL_HINTS, optional_import

__all__ = [
    "COMPRESSIONS",
    "LAUNCH_SIZE_VARS",
    "REDUCE_OPS",
    "World",
    "allgather",
    "allreduce",
    "barrier",
    "broadcast_object",
    "broadcast_variables",
    "grouped_allreduce",
    "init",
    "is_chief",
    "is_initialized",
    "launched_world_size",
    "local_rank",
    "local_size",
    "normalize_compression",
    "payload_bytes",
    "rank",
    "size",
    "uses_horovod",
    "world",
]

# Environment variables through which launchers announce the world size, in the
# order they are checked: horovodrun (Gloo), Open MPI, MPICH / Intel MPI, MVAPICH.
LAUNCH_SIZE_VARS: tuple[str, ...] = (
    "HOROVOD_SIZE",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_SIZE",
    "MV2_COMM_WORLD_SIZE",
)

REDUCE_OPS: tuple[str, ...] = ("average", "sum", "min", "max", "product")

# Accepted compression names -> canonical name (None means no compression).
COMPRESSIONS: dict[str | None, str | None] = {
    None: None,
    "none": None,
    "fp16": "fp16",
    "float16": "fp16",
    "bf16": "bf16",
    "bfloat16": "bf16",
}
_COMPRESSED_DTYPE = {"fp16": "float16", "bf16": "bfloat16"}


@dataclasses.dataclass(frozen=True)
class World:
    """Where this process stands in the job.

    Attributes:
        rank: Global rank, 0 for the chief.
        size: Number of processes.
        local_rank: Rank among the processes on this host.
        local_size: Number of processes on this host.
        horovod: True when Horovod is running the collectives; False for a
            single process started without a launcher.
    """

    rank: int
    size: int
    local_rank: int
    local_size: int
    horovod: bool


@dataclasses.dataclass
class _State:
    initialized: bool = False
    hvd: ModuleType | None = None
    world: World = dataclasses.field(default_factory=lambda: World(0, 1, 0, 1, False))


_STATE = _State()


# --------------------------------------------------------------------------- init


def launched_world_size(environ: dict[str, str] | None = None) -> int | None:
    """Return the world size a launcher announced in the environment, or None.

    Args:
        environ: Environment to read (default ``os.environ``).

    Returns:
        The number of processes ``horovodrun`` / ``mpirun`` started, or None when
        the process was not started by such a launcher.
    """
    env = os.environ if environ is None else environ
    for var in LAUNCH_SIZE_VARS:
        value = env.get(var)
        if value:
            try:
                return int(value)
            except ValueError:
                raise RuntimeError(
                    f"The launcher variable {var}={value!r} is not an integer; unset it or "
                    "start the job with horovodrun."
                ) from None
    return None


def init() -> World:
    """Initialise the distributed runtime (idempotent).

    Under ``horovodrun`` / ``mpirun`` this calls ``horovod.tensorflow.init()``
    and, when TensorFlow sees GPUs, makes only the GPU of this process's local
    rank visible, with memory growth. Started without a launcher, or launched as
    a single process without Horovod installed, it sets up a world of one
    process and does nothing else. A second call returns the same world.

    Returns:
        The :class:`World` of this process.

    Raises:
        ImportError: The launcher started more than one process but Horovod
            cannot be imported; the message says how to install it.
    """
    if _STATE.initialized:
        return _STATE.world
    n = launched_world_size()
    if n is None:
        _STATE.world = World(0, 1, 0, 1, False)
        _STATE.initialized = True
        return _STATE.world
    try:
        hvd = optional_import("horovod.tensorflow", feature="multi-process training")
    except ImportError as exc:
        if n > 1:
            raise ImportError(
                f"This script was launched as {n} processes, but Horovod is not available, so "
                f"gradients could not be averaged across them ({exc}). Install Horovod: "
                f"{INSTALL_HINTS['horovod']}; or run a single process without horovodrun."
            ) from exc
        _STATE.world = World(0, 1, 0, 1, False)
        _STATE.initialized = True
        return _STATE.world
    hvd.init()
    _STATE.hvd = hvd
    _STATE.world = World(
        rank=int(hvd.rank()),
        size=int(hvd.size()),
        local_rank=int(hvd.local_rank()),
        local_size=int(hvd.local_size()),
        horovod=True,
    )
    _STATE.initialized = True
    _configure_local_gpu(_STATE.world.local_rank)
    return _STATE.world


def _configure_local_gpu(local_rank_: int) -> None:
    """Give this local rank one GPU with memory growth, if TensorFlow sees any.

    With more ranks on a host than GPUs (``-np 2`` on a one-GPU machine, say), the
    ranks share GPUs round-robin (``local_rank % n_gpus``) with memory growth on,
    and a warning says so: a development set-up runs instead of failing, and a
    production one is told it is oversubscribed.
    """
    import tensorflow as tf

    from kmp import gpu as _gpu

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return
    # Horovod's own local rank, so the launcher variables are not read a second time.
    visible = local_rank_ % len(gpus)
    if local_rank_ >= len(gpus):
        warnings.warn(
            f"Local rank {local_rank_} has no GPU of its own (this host shows {len(gpus)}): it "
            f"shares GPU {visible} with another rank, with memory growth on, which is slower "
            f"and can run out of memory. Start at most {len(gpus)} process(es) per host (e.g. "
            f"horovodrun -H host:{len(gpus)}), or call kmp.configure_gpus(visible=...) right "
            "after kmp.distributed.init(), before any TensorFlow op, to choose yourself.",
            RuntimeWarning,
            stacklevel=3,
        )
    try:
        _gpu.configure_gpus(memory_growth=True, visible=visible)
    except RuntimeError as exc:  # TensorFlow already initialised its devices.
        warnings.warn(
            f"kmp.distributed.init() could not pin GPU {local_rank_} to this rank ({exc}). "
            "Call kmp.distributed.init() before building any model or tensor.",
            RuntimeWarning,
            stacklevel=3,
        )


def _ensure() -> World:
    return _STATE.world if _STATE.initialized else init()


def is_initialized() -> bool:
    """Return True once :func:`init` has run (in either mode)."""
    return _STATE.initialized


def world() -> World:
    """Return the :class:`World` of this process (initialising on first use)."""
    return _ensure()


def uses_horovod() -> bool:
    """Return True when Horovod runs the collectives (launched by horovodrun)."""
    _ensure()
    return _STATE.hvd is not None


def rank() -> int:
    """Return the global rank of this process (0 in a single process)."""
    return _ensure().rank


def size() -> int:
    """Return the number of processes (1 in a single process)."""
    return _ensure().size


def local_rank() -> int:
    """Return the rank of this process on its host (0 in a single process)."""
    return _ensure().local_rank


def local_size() -> int:
    """Return the number of processes on this host (1 in a single process)."""
    return _ensure().local_size


def is_chief() -> bool:
    """Return True on rank 0, the process that writes files and logs."""
    return rank() == 0


def _hvd() -> ModuleType | None:
    """Horovod's TF module when more than one process runs, else None."""
    w = _ensure()
    return _STATE.hvd if w.size > 1 else None


# ------------------------------------------------------------------- validation


def normalize_compression(compression: str | None) -> str | None:
    """Return the canonical compression name (``None``, ``"fp16"`` or ``"bf16"``).

    Raises:
        ValueError: ``compression`` is not one of the names in :data:`COMPRESSIONS`.
    """
    key = compression.lower() if isinstance(compression, str) else compression
    if key not in COMPRESSIONS:
        raise ValueError(
            f"Unknown compression {compression!r}. Use None (send gradients as they are), "
            "'fp16' (send float16, half the bytes) or 'bf16' (send bfloat16, half the bytes)."
        )
    return COMPRESSIONS[key]


def _check_op(op: str) -> str:
    name = op.lower() if isinstance(op, str) else op
    if name not in REDUCE_OPS:
        raise ValueError(f"Unknown reduction op {op!r}; use one of {', '.join(REDUCE_OPS)}.")
    return name


def _hvd_op(hvd: ModuleType, op: str) -> Any:
    return {
        "average": hvd.Average,
        "sum": hvd.Sum,
        "min": hvd.Min,
        "max": hvd.Max,
        "product": hvd.Product,
    }[op]


def payload_bytes(tensors: Iterable[Any], compression: str | None = None) -> int:
    """Return how many bytes one rank hands to the collective for ``tensors``.

    Floating-point tensors count at 2 bytes per element when ``compression`` is
    ``"fp16"`` or ``"bf16"``; everything else at its own item size.

    Args:
        tensors: Tensors, arrays or variables (anything with ``shape`` and ``dtype``).
        compression: As accepted by :func:`normalize_compression`.

    Returns:
        The number of bytes.
    """
    import numpy as np

    comp = normalize_compression(compression)
    total = 0
    for t in tensors:
        if t is None:
            continue
        dtype = np.dtype(_dtype_name(t))
        count = int(np.prod([int(d) for d in t.shape])) if len(t.shape) else 1
        item = 2 if comp and dtype.kind == "f" else dtype.itemsize
        total += count * item
    return total


def _dtype_name(t: Any) -> str:
    dt = t.dtype
    name = getattr(dt, "name", None) or str(dt)
    return "float16" if name == "bfloat16" else name  # numpy has no bfloat16; same size


# ------------------------------------------------------------------ collectives


def _as_tf_variable(v: Any) -> Any:
    import keras

    return v.value if isinstance(v, keras.Variable) else v


def barrier() -> None:
    """Block until every process reaches this call (no-op in a single process)."""
    hvd = _hvd()
    if hvd is None:
        return
    import tensorflow as tf

    hvd.allreduce(tf.constant(0, tf.int32), op=hvd.Sum, name="kmp.barrier").numpy()


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
    """
    hvd = _hvd()
    if hvd is None:
        return None
    _check_root(root)
    seen: set[int] = set()
    unique = []
    for v in variables:
        if id(v) not in seen:
            seen.add(id(v))
            unique.append(v)
    if not unique:
        return None
    import keras

    if keras.backend.backend() == "tensorflow":
        return hvd.broadcast_variables([_as_tf_variable(v) for v in unique], root_rank=root)
    # Other backends: move the values through TensorFlow eagerly.
    import numpy as np
    import tensorflow as tf

    for i, v in enumerate(unique):
        value = hvd.broadcast(tf.constant(np.asarray(v)), root, name=f"kmp.bcast.{i}")
        v.assign(value.numpy())
    return None


def broadcast_object(obj: Any, root: int = 0) -> Any:
    """Return rank ``root``'s ``obj`` (any picklable object) on every rank."""
    hvd = _hvd()
    if hvd is None:
        return obj
    _check_root(root)
    return hvd.broadcast_object(obj, root_rank=root)


def _check_root(root: int) -> None:
    n = size()
    if not isinstance(root, int) or isinstance(root, bool) or not 0 <= root < n:
        raise ValueError(f"root must be a rank between 0 and {n - 1}; got {root!r}.")


def allreduce(x: Any, op: str = "average", compression: str | None = None) -> Any:
    """Reduce one tensor across all ranks.

    Args:
        x: A tensor (TensorFlow backend), array or number.
        op: ``"average"``, ``"sum"``, ``"min"``, ``"max"`` or ``"product"``.
        compression: ``None``, ``"fp16"`` or ``"bf16"``: floating tensors are sent in
            that dtype and cast back after.

    Returns:
        The reduced tensor (``x`` itself in a single process).
    """
    return grouped_allreduce([x], op=op, compression=compression)[0]


def grouped_allreduce(
    tensors: Sequence[Any], op: str = "average", compression: str | None = None
) -> list[Any]:
    """Reduce several tensors across all ranks in one fused Horovod operation.

    ``None`` entries are passed through. Sparse gradients (``tf.IndexedSlices``)
    are densified first. With ``compression="fp16"`` floating tensors go through
    Horovod's allreduce in float16 (pre-scaled by ``1/size`` for ``"average"`` so
    the sum cannot overflow where the mean would not). Horovod has no bfloat16
    reduction, so ``"bf16"`` sends the bfloat16 bit patterns with one fused
    allgather and sums them locally in float32: half the bytes of float32 for two
    ranks, growing with the number of ranks (prefer ``"fp16"`` beyond a few).
    Results keep each input's dtype.

    Args:
        tensors: The tensors to reduce, in the same order on every rank.
        op: One of :data:`REDUCE_OPS`.
        compression: ``None``, ``"fp16"`` or ``"bf16"``.

    Returns:
        A list of reduced tensors (the inputs themselves in a single process).
    """
    op = _check_op(op)
    comp = normalize_compression(compression)
    tensors = list(tensors)
    hvd = _hvd()
    if hvd is None:
        return tensors
    import tensorflow as tf

    idx = [i for i, t in enumerate(tensors) if t is not None]
    if not idx:
        return tensors
    dense = [tf.convert_to_tensor(_as_tf_variable(tensors[i])) for i in idx]
    n = hvd.size()
    if comp == "bf16":
        reduced = _bf16_allgather_reduce(hvd, dense, op, n)
    else:
        sent = [
            tf.cast(t, tf.float16) if comp == "fp16" and t.dtype.is_floating else t for t in dense
        ]
        if comp == "fp16" and op == "average":
            out = _grouped_by_dtype(hvd, sent, op=hvd.Sum, prescale_factor=1.0 / n)
        else:
            out = _grouped_by_dtype(hvd, sent, op=_hvd_op(hvd, op))
        reduced = [
            o if o.dtype == t.dtype else tf.cast(o, t.dtype)
            for o, t in zip(out, dense, strict=True)
        ]
    result = list(tensors)
    for i, r in zip(idx, reduced, strict=True):
        result[i] = r
    return result


def _grouped_by_dtype(hvd: ModuleType, tensors: list[Any], **kwargs: Any) -> list[Any]:
    """One fused Horovod allreduce per dtype (a grouped op takes a single dtype)."""
    by_dtype: dict[Any, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    out: list[Any] = [None] * len(tensors)
    for positions in by_dtype.values():
        reduced = hvd.grouped_allreduce([tensors[i] for i in positions], **kwargs)
        for i, r in zip(positions, reduced, strict=True):
            out[i] = r
    return out


def _bf16_allgather_reduce(hvd: ModuleType, dense: list[Any], op: str, n: int) -> list[Any]:
    import tensorflow as tf

    floating = [i for i, t in enumerate(dense) if t.dtype.is_floating]
    others = [i for i in range(len(dense)) if i not in floating]
    out: list[Any] = [None] * len(dense)
    if floating:
        bits = [
            tf.bitcast(tf.reshape(tf.cast(dense[i], tf.bfloat16), [-1]), tf.int16) for i in floating
        ]
        gathered = hvd.grouped_allgather(bits)
        reducer = {
            "average": tf.reduce_mean,
            "sum": tf.reduce_sum,
            "min": tf.reduce_min,
            "max": tf.reduce_max,
            "product": tf.reduce_prod,
        }[op]
        for i, g in zip(floating, gathered, strict=True):
            values = tf.cast(tf.bitcast(g, tf.bfloat16), tf.float32)
            values = tf.reshape(values, [n, -1])
            red = tf.reshape(reducer(values, axis=0), tf.shape(dense[i]))
            out[i] = tf.cast(red, dense[i].dtype)
    if others:
        rest = _grouped_by_dtype(hvd, [dense[i] for i in others], op=_hvd_op(hvd, op))
        for i, r in zip(others, rest, strict=True):
            out[i] = r
    return out


def allgather(x: Any) -> Any:
    """Concatenate ``x`` from all ranks along its first axis (rank order).

    Scalars are treated as shape ``[1]``, so the result always has a first axis
    of ``size() * len(x)``.

    Returns:
        The gathered tensor (``x``, with scalars reshaped to ``[1]``, in a single process).
    """
    hvd = _hvd()
    if hvd is None:
        from keras import ops

        t = ops.convert_to_tensor(x)
        return ops.reshape(t, [1]) if len(t.shape) == 0 else t
    import tensorflow as tf

    t = tf.convert_to_tensor(_as_tf_variable(x))
    if t.shape.rank == 0:
        t = tf.reshape(t, [1])
    return hvd.allgather(t)


def _reset_for_tests() -> None:
    """Forget the initialised state (single-process tests only)."""
    if _STATE.hvd is not None and "horovod.tensorflow" in sys.modules:
        raise RuntimeError("Cannot reset a running Horovod job.")
    _STATE.initialized = False
    _STATE.hvd = None
    _STATE.world = World(0, 1, 0, 1, False)
