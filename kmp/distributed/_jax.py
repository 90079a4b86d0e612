"""The JAX engine: JAX's distributed runtime and ``keras.distribution``, for kmp.distributed.

:mod:`kmp.distributed.world` starts it (:func:`start`, then holds a
:class:`JaxEngine`): the process group from
the launcher's environment (``jax.distributed.initialize``), Gloo collectives
for CPU devices, and a Keras ``DataParallel`` distribution over every device
of every process, and one random seed for all of them (Keras, Python and NumPy).
A variable created under that distribution starts from process 0's value on every
process (:func:`install_initial_values_hook`), as Horovod's initial broadcast gives, so a
script that seeds each process differently after ``init()`` runs unchanged. Each step's
gradients arrive at kmp's optimizer averaged over every process (kmp's own step,
:mod:`kmp.distributed._jax_step`, reduces them in one flat all-reduce; with
``KMP_JAX_STEP=keras``, XLA inside Keras's step), so the optimizer does not reduce them
again, and a non-finite gradient is seen by every process alike.

The collectives here serve the training loop outside the step (the initial state,
metrics, results), through ``jax.experimental.multihost_utils``; nothing here checks
user arguments or handles one process (:mod:`kmp.distributed.collectives` does).

A script that joined the process group itself (``jax.distributed.initialize()``
before kmp; :func:`script_joined` tells, without importing JAX) is adopted by
:func:`adopt`: everything :func:`start` does but joining.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import pickle
import socket
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from kmp._keras_internals import JAX_VARIABLE_INITIALIZE
from kmp._keras_local import local_variables
from kmp._launcher_env import JaxTimeouts
from kmp.distributed import _jax_step
from kmp.distributed.engines import Engine, Layout, Transport, layout
from kmp.versions import installed, supported

__all__ = [
    "JaxEngine",
    "adopt",
    "alone",
    "allgather",
    "barrier",
    "broadcast_object",
    "broadcast_values",
    "data_parallel_class",
    "grouped_allreduce",
    "install_initial_values_hook",
    "remove_initial_values_hook",
    "distribution_lost",
    "script_joined",
    "set_distribution",
    "start",
]

# A point of Keras kmp wraps (the other: _jax_step.HOOK_POINT); _keras_internals says what.
HOOK_POINT = JAX_VARIABLE_INITIALIZE

_REDUCE = {"average": np.mean, "sum": np.sum, "min": np.min, "max": np.max, "product": np.prod}


def start(
    coordinator: str,
    num_processes: int,
    process_id: int,
    *,
    timeouts: JaxTimeouts,
    local_device: int | None = None,
    own_step: bool = True,
) -> None:
    """Join the JAX process group and set Keras's data-parallel distribution.

    Every process gets process 0's random seed (Keras, Python and NumPy), and
    every variable created under kmp's distribution (weights, optimizer slots,
    metrics, dropout's ``SeedGenerator`` state) starts from process 0's value:
    kmp broadcasts it, one collective per variable, before JAX lays it out (a script
    seeding each process differently builds process 0's model, as under Horovod).
    Variables created inside :func:`alone`, or assigned later, are not changed.

    Args:
        coordinator: ``host:port`` of process 0's coordinator service.
        num_processes: How many processes the job has.
        process_id: This process's id, 0 to ``num_processes - 1``.
        timeouts: How long to wait for every process to join, for a silent process's
            heartbeat, and at exit for the others (:class:`kmp._launcher_env.JaxTimeouts`).
        local_device: The one GPU this process takes when several processes
            share a host (its local rank); None: every local GPU (one process
            per host). CPU devices are not affected.
        own_step: Train with kmp's step (:mod:`kmp.distributed._jax_step`), not Keras's.

    Raises:
        RuntimeError: The group did not form within ``timeouts.join`` (a process did
            not start, or cannot reach the coordinator), or the coordinator's
            port is taken; the message says which and what to do. Also raised
            before joining when this Keras lacks the hook point kmp needs
            (:data:`HOOK_POINT`).
    """
    import jax

    _install_hooks(own_step)
    timeout_s = timeouts.join
    _check_coordinator(coordinator, process_id, timeout_s)
    print(
        f"[kmp] process {process_id} of {num_processes} joins the JAX job at {coordinator}; "
        f"if a process never joins, JAX ends this one after {timeout_s} s (KMP_JAX_TIMEOUT); "
        f"once joined, a process silent for {timeouts.heartbeat} s ends the job "
        "(KMP_JAX_HEARTBEAT_TIMEOUT).",
        file=sys.stderr,
        flush=True,
    )
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=num_processes,
            process_id=process_id,
            initialization_timeout=timeout_s,
            heartbeat_timeout_seconds=timeouts.heartbeat,
            shutdown_timeout_seconds=timeouts.shutdown,
            local_device_ids=None if local_device is None else [local_device],
            # kmp's launcher said who is who: JAX must not also read SLURM's or MPI's
            # variables (under srun it would take one GPU per node by SLURM_LOCALID).
            cluster_detection_method="deactivate",
        )
    except Exception as exc:  # XlaRuntimeError, DEADLINE_EXCEEDED, address in use, ...
        raise RuntimeError(
            f"Process {process_id} of {num_processes} could not join the JAX job at "
            f"{coordinator} within {timeout_s} s ({type(exc).__name__}: {exc}). Every process "
            "must start and reach the coordinator (process 0's host); check that they all "
            "started, that the port is free and not blocked, or raise KMP_JAX_TIMEOUT."
        ) from exc
    _distribute()


def script_joined() -> bool:
    """True when the script joined JAX's process group itself (``jax.distributed.initialize()``).

    Asked of JAX's public ``jax.distributed.is_initialized`` when JAX is already
    imported; JAX is never imported here and nothing is started.
    """
    jax = sys.modules.get("jax")
    is_initialized = getattr(getattr(jax, "distributed", None), "is_initialized", None)
    return bool(is_initialized is not None and is_initialized())


def adopt(own_step: bool = True) -> None:
    """Take over the process group the script joined itself: :func:`start` without joining.

    ``jax.distributed.initialize`` is not called again; the rest is
    :func:`start`'s: process 0's random seed everywhere, kmp's ``DataParallel``
    distribution over every device of every process, new variables from
    process 0's values, and kmp's train step where ``own_step``.

    Raises:
        RuntimeError: This Keras lacks the hook point kmp needs (:data:`HOOK_POINT`).
    """
    _install_hooks(own_step)
    _distribute()


def _install_hooks(own_step: bool) -> None:
    install_initial_values_hook()
    if own_step:
        _jax_step.install(data_parallel_class())


def _distribute() -> None:
    """Give every process process 0's seed and set kmp's distribution over every device."""
    import random

    import keras

    # A variable must be created with the same value on every process (JAX checks it when
    # it lays the value out over all devices): every process starts from process 0's seed.
    seed = broadcast_object(random.SystemRandom().randrange(2**31), 0)
    keras.utils.set_random_seed(seed)
    set_distribution()


def set_distribution() -> None:
    """Set kmp's data-parallel distribution over every device of every process."""
    import jax
    import keras

    keras.distribution.set_distribution(
        data_parallel_class()(devices=jax.devices(), auto_shard_dataset=False)
    )


def distribution_lost() -> bool:
    """True when kmp's distribution is not Keras's current one (``clear_session()`` drops it)."""
    import keras

    return not isinstance(keras.distribution.distribution(), data_parallel_class())


@functools.cache
def data_parallel_class() -> type:
    """Return kmp's ``keras.distribution.DataParallel``, whose new variables start from process 0.

    It is Keras's ``DataParallel``; the hook (:func:`install_initial_values_hook`)
    acts only while an instance of it is Keras's distribution, so a distribution
    the user sets is left as Keras made it.
    """
    import keras

    class FromProcess0DataParallel(keras.distribution.DataParallel):
        """Keras's ``DataParallel``; new variables start from process 0's values (kmp)."""

    return FromProcess0DataParallel


def _hook_point() -> tuple[type, Any]:
    """Return Keras's ``JaxVariable`` class and its own ``_initialize``, or fail clearly."""
    import importlib

    module_name, class_names, method_name, params = HOOK_POINT
    where = f"{module_name}.{'|'.join(class_names)}.{method_name}{params}"
    try:
        module = importlib.import_module(module_name)
        cls = next(getattr(module, n) for n in class_names if hasattr(module, n))
        method = cls.__dict__[method_name]
        found = tuple(inspect.signature(method).parameters)
    except (ImportError, StopIteration, KeyError, TypeError, ValueError) as exc:
        found, cls, method = (f"missing: {type(exc).__name__}: {exc}",), None, None
    if found != params:
        raise RuntimeError(
            f"kmp's JAX engine gives every process process 0's initial variable values through "
            f"Keras's {where}, which this Keras ({installed()['keras']}) does not have ({found}). "
            f"Install a Keras kmp supports (pip install '{supported('keras').requirement}'), "
            "or use the Horovod engine (kmp launch --engine horovod)."
        )
    return cls, method


def install_initial_values_hook() -> None:
    """Make variables created under kmp's distribution start from process 0's values.

    Wraps Keras's ``JaxVariable._initialize`` (:data:`HOOK_POINT`; Keras has no
    public hook for a variable's initial value). The wrapper broadcasts the
    value from process 0 while :func:`data_parallel_class`'s distribution is set,
    and does nothing otherwise. Idempotent.

    Raises:
        RuntimeError: This Keras has no such method; the message says what to install.
    """
    cls, method = _hook_point()
    if getattr(method, "_kmp_original", None) is not None:
        return

    @functools.wraps(method)
    def _initialize(variable: Any, value: Any) -> Any:
        return method(variable, _from_process_0(value))

    _initialize._kmp_original = method  # type: ignore[attr-defined]
    cls._initialize = _initialize


def remove_initial_values_hook() -> None:
    """Put Keras's own ``JaxVariable._initialize`` back (nothing to do if not installed)."""
    cls, method = _hook_point()
    original = getattr(method, "_kmp_original", None)
    if original is not None:
        cls._initialize = original


def _from_process_0(value: Any) -> Any:
    """Return process 0's ``value`` while kmp's distribution is set, else ``value`` itself."""
    import jax
    import keras

    if not isinstance(keras.distribution.distribution(), data_parallel_class()):
        return value
    if isinstance(value, jax.core.Tracer):
        return value
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        return value  # already laid out over every process
    host = np.asarray(value)
    sent = host.view(np.uint8) if host.dtype == np.bool_ else host
    (got,) = broadcast_values([sent], 0)
    # A NumPy value: under the distribution the variable always has a layout, and JAX
    # places the host value straight onto every device.
    return got.view(np.bool_) if host.dtype == np.bool_ else got.astype(host.dtype, copy=False)


def _check_coordinator(coordinator: str, process_id: int, timeout_s: int) -> None:
    """Fail clearly where JAX would abort: process 0's port taken, or not reached in time."""
    host, _, port_text = coordinator.rpartition(":")
    port = int(port_text)
    if process_id == 0:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
            except OSError as exc:
                raise RuntimeError(
                    f"The JAX coordinator's port {port} is already in use on this host ({exc}). "
                    "Launch again with another --coordinator-port, or let kmp launch pick one."
                ) from exc
        return
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=2):
                return
        except OSError as exc:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"Process {process_id} could not reach the JAX coordinator at {coordinator} "
                    f"within {timeout_s} s ({exc}): process 0 did not start there, or the port "
                    "is blocked. Check that every process started, or raise KMP_JAX_TIMEOUT."
                ) from exc
            time.sleep(0.5)


class JaxEngine(Engine):
    """JAX's runtime, once :func:`start` has joined the process group.

    The step averages the gradients, so kmp's optimizer does not; these collectives
    serve what runs outside the step (host values in, NumPy arrays out).

    Args:
        local_rank: This process's rank on its host, as the launcher said, or None.
        local_size: The number of processes on this host, or None (one per host).
        cross: The launcher's ``(cross_rank, cross_size)``, or None.
    """

    name = "jax"

    def __init__(
        self, local_rank: int | None, local_size: int | None, cross: tuple[int, int] | None
    ):
        self._place = (local_rank, local_size, cross)

    def layout(self) -> Layout:
        """The rank and size from JAX; the place on the host from the launcher."""
        import jax

        return layout(int(jax.process_index()), int(jax.process_count()), *self._place)

    def close(self) -> None:
        """Put Keras's own variable initialisation and train step back."""
        remove_initial_values_hook()
        _jax_step.remove()

    def alone(self) -> contextlib.AbstractContextManager:
        """Lift Keras's distribution while this process works by itself (:func:`alone`)."""
        return alone()

    def barrier(self) -> None:
        """Wait for every process."""
        barrier()

    def broadcast_variables(self, variables: Sequence[Any], root: int) -> None:
        """Assign process ``root``'s values to ``variables``."""
        for v, value in zip(variables, broadcast_values(variables, root), strict=True):
            v.assign(value)

    def broadcast_object(self, obj: Any, root: int) -> Any:
        """Return process ``root``'s ``obj``."""
        return broadcast_object(obj, root)

    def grouped_allreduce(self, tensors: Sequence[Any], op: str, how: Transport) -> list[Any]:
        """Reduce host values (``how``: compression, buckets, sparse strategy do not apply)."""
        return grouped_allreduce(tensors, op)

    def allgather(self, x: Any) -> np.ndarray:
        """Concatenate ``x`` in process order (a scalar as ``[1]``)."""
        host = _host(x)
        return allgather(host.reshape(1) if host.ndim == 0 else host)


@contextlib.contextmanager
def alone() -> Iterator[None]:
    """Run the block on this process only: Keras's distribution is lifted meanwhile.

    Under the distribution every new Keras variable is laid out over all
    processes, which every process must do together; a chief that saves a
    model alone (Keras builds a throw-away optimizer while saving) would wait
    for the others. Inside this block new variables stay on this process.
    """
    with local_variables():
        yield


def barrier() -> None:
    """Wait for every process."""
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices("kmp.barrier")


def _host(x: Any) -> np.ndarray:
    value = getattr(x, "value", x)  # a Keras variable
    return np.asarray(value)


def _gather_stacked(x: np.ndarray) -> np.ndarray:
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=False))


def grouped_allreduce(tensors: Sequence[Any], op: str) -> list[np.ndarray]:
    """Reduce each tensor over the processes (``op`` from :data:`kmp._names.REDUCE_OPS`)."""
    out = []
    for t in tensors:
        host = _host(t)
        stacked = _gather_stacked(host.astype(np.float32) if host.dtype.kind == "f" else host)
        out.append(_REDUCE[op](stacked, axis=0).astype(host.dtype))
    return out


def allgather(x: Any) -> np.ndarray:
    """Concatenate ``x`` (at least 1-D, same shape past the first axis) in process order."""
    host = _host(x)
    stacked = _gather_stacked(host)
    return stacked.reshape((-1, *host.shape[1:]))


def broadcast_values(values: Sequence[Any], root: int) -> list[np.ndarray]:
    """Return process ``root``'s values of ``values`` (arrays or variables) on every process."""
    import jax
    from jax.experimental import multihost_utils

    hosts = [_host(v) for v in values]
    is_root = int(jax.process_index()) == root
    return [np.asarray(a) for a in multihost_utils.broadcast_one_to_all(hosts, is_source=is_root)]


def broadcast_object(obj: Any, root: int) -> Any:
    """Return process ``root``'s ``obj`` (picklable) on every process."""
    import jax

    is_root = int(jax.process_index()) == root
    payload = np.frombuffer(pickle.dumps(obj), dtype=np.uint8) if is_root else np.zeros(0, np.uint8)
    (length,) = broadcast_values([np.array([payload.size], np.int64)], root)
    padded = np.zeros(int(length[0]), np.uint8)
    if is_root:
        padded[:] = payload
    (data,) = broadcast_values([padded], root)
    return pickle.loads(data.tobytes())
