"""Which engine runs the collectives, and what every engine does: the :class:`Engine`.

Two engines carry kmp's collectives across processes:

* ``"horovod"``: Horovod's TensorFlow collectives (the TensorFlow backend), under
  ``horovodrun``, ``mpirun`` or ``kmp launch``
  (:class:`kmp.distributed._horovod.HorovodEngine`);
* ``"jax"``: JAX's distributed runtime with a Keras ``DataParallel``
  distribution (the JAX backend), under ``kmp launch --engine jax``
  (:class:`kmp.distributed._jax.JaxEngine`).

A process that runs alone has the :class:`SingleProcess` engine, whose
collectives return their input. :mod:`kmp.distributed.world` holds the one
engine of the process; :mod:`kmp.distributed.collectives` checks the arguments
and makes one call on it.

``"auto"`` picks the engine of the Keras backend, unless the launcher named
one (``KMP_ENGINE``). :func:`choose_engine` decides and explains mismatches
before anything starts.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Sequence
from typing import Any, ClassVar, NamedTuple

from kmp._checks import check_choice
from kmp._names import ENGINE_CHOICES

__all__ = [
    "SINGLE_PROCESS",
    "Engine",
    "SingleProcess",
    "Transport",
    "choose_engine",
    "layout",
]

_BACKEND_OF = {"horovod": "tensorflow", "jax": "jax"}

# (rank, size, local_rank, local_size, cross_rank, cross_size)
Layout = tuple[int, int, int, int, int, int]


class Transport(NamedTuple):
    """How a grouped allreduce's tensors travel (checked and canonical settings).

    Attributes:
        compression: None, ``"fp16"`` or ``"bf16"`` (:data:`kmp._names.COMPRESSIONS`).
        bucket_bytes: Bytes per bucket, or None for one fused operation
            (:mod:`kmp.distributed.buckets`).
        sparse_gradients: ``"dense"`` or ``"gather"`` (:mod:`kmp.distributed.sparse`).
    """

    compression: str | None
    bucket_bytes: int | None
    sparse_gradients: str


class Engine(abc.ABC):
    """What carries the collectives of one process: one process alone, Horovod, or JAX.

    Every method receives checked arguments (:mod:`kmp.distributed.collectives`
    checks them) and runs in a world of more than one process, except on
    :class:`SingleProcess`. Tensors are those of the engine's backend.

    Attributes:
        name: ``"none"`` (one process), ``"horovod"`` or ``"jax"``: what
            :attr:`kmp.distributed.World.engine` says.
        optimizer_averages: True when kmp's optimizer must average the gradients
            itself (Horovod); on the JAX engine Keras's distribution averages
            them inside the step, and one process has nothing to average.
    """

    name: ClassVar[str]
    optimizer_averages: ClassVar[bool] = False

    @abc.abstractmethod
    def layout(self) -> Layout:
        """Return ``(rank, size, local_rank, local_size, cross_rank, cross_size)``."""

    def restart(self) -> None:
        """Start again after the job's workers changed (elastic training).

        Raises:
            RuntimeError: This engine cannot restart (only Horovod's can).
        """
        where = "runs alone" if self.name == "none" else f"runs on the {self.name} engine"
        raise RuntimeError(
            "kmp.distributed.restart() needs a running Horovod job (started by horovodrun); "
            f"this process {where}."
        )

    @abc.abstractmethod
    def close(self) -> None:
        """Undo what starting the engine changed in this process, where that can be undone."""

    def alone(self) -> contextlib.AbstractContextManager:
        """Return a context in which this process works by itself (nothing to lift here)."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def barrier(self) -> None:
        """Block until every process gets here."""

    @abc.abstractmethod
    def broadcast_variables(self, variables: Sequence[Any], root: int) -> Any:
        """Overwrite ``variables`` (each once) with rank ``root``'s values; an op group or None."""

    @abc.abstractmethod
    def broadcast_object(self, obj: Any, root: int) -> Any:
        """Return rank ``root``'s ``obj``."""

    @abc.abstractmethod
    def grouped_allreduce(self, tensors: Sequence[Any], op: str, how: Transport) -> list[Any]:
        """Reduce ``tensors`` (no None among them) with canonical ``op``, sent ``how`` says."""

    @abc.abstractmethod
    def allgather(self, x: Any) -> Any:
        """Concatenate ``x`` from every process along its first axis (a scalar as ``[1]``)."""


class SingleProcess(Engine):
    """The engine of a process that runs alone: every collective returns its input."""

    name = "none"

    def layout(self) -> Layout:
        """Rank 0 of one process, on one host."""
        return (0, 1, 0, 1, 0, 1)

    def close(self) -> None:
        """Nothing was started."""

    def barrier(self) -> None:
        """Nothing to wait for."""

    def broadcast_variables(self, variables: Sequence[Any], root: int) -> None:
        """The variables already hold the only values."""
        return None

    def broadcast_object(self, obj: Any, root: int) -> Any:
        """``obj`` itself."""
        return obj

    def grouped_allreduce(self, tensors: Sequence[Any], op: str, how: Transport) -> list[Any]:
        """The tensors themselves."""
        return list(tensors)

    def allgather(self, x: Any) -> Any:
        """``x`` as a tensor of the Keras backend, a scalar reshaped to ``[1]``."""
        from keras import ops

        t = ops.convert_to_tensor(x)
        return ops.reshape(t, [1]) if len(t.shape) == 0 else t


SINGLE_PROCESS = SingleProcess()


def layout(
    rank: int,
    size: int,
    local_rank: int | None,
    local_size: int | None,
    cross: tuple[int, int] | None,
) -> Layout:
    """Complete a process's place in the job from what is known of it.

    The place on the host defaults to one process per host, and the host to
    ``rank // local_size`` of ``ceil(size / local_size)``, unless the launcher
    said (``cross``: its cross rank and size).
    """
    lrank = 0 if local_rank is None else local_rank
    lsize = 1 if local_size is None else local_size
    cross_rank, cross_size = cross if cross is not None else (rank // lsize, -(-size // lsize))
    return rank, size, lrank, lsize, cross_rank, cross_size


def choose_engine(requested: str, backend: str, launched_engine: str | None = None) -> str:
    """Return ``"horovod"`` or ``"jax"``: the engine for this process.

    Args:
        requested: ``"auto"``, ``"horovod"`` or ``"jax"`` (``init(engine=)``).
        backend: The Keras backend (``keras.backend.backend()``).
        launched_engine: The engine the launcher named (``KMP_ENGINE``), or None.

    Raises:
        TypeError: ``requested`` is not a string.
        ValueError: An unknown engine; an engine that contradicts the launcher's;
            or an engine whose Keras backend is not the one in use.
    """
    requested = check_choice(
        "engine", requested, ENGINE_CHOICES, hint="'auto' follows the Keras backend."
    )
    if requested != "auto" and launched_engine not in (None, requested):
        raise ValueError(
            f"init(engine={requested!r}), but the job was launched with --engine "
            f"{launched_engine} (KMP_ENGINE={launched_engine}). Use engine='auto', or launch "
            f"with kmp launch --engine {requested}."
        )
    if requested != "auto":
        engine = requested
    else:
        engine = launched_engine or ("jax" if backend == "jax" else "horovod")
    need = _BACKEND_OF[engine]
    if backend != need:
        other = "jax" if engine == "horovod" else "horovod"
        raise ValueError(
            f"The {engine} engine runs on Keras's {need} backend, but KERAS_BACKEND is "
            f"{backend!r}. Set KERAS_BACKEND={need} (kmp launch --engine {engine} does), or use "
            f"the {other} engine (kmp launch --engine {other})."
        )
    return engine
