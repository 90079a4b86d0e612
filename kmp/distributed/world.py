"""Where this process stands in the job: :func:`init`, the :class:`World` and its accessors.

The state lives here, once per process. :func:`init` reads the launcher's world
size (through :mod:`kmp._launcher_env`), chooses the engine
(:func:`kmp.distributed.engines.choose_engine`) and starts it when the job has
more than one process: Horovod (:mod:`kmp.distributed._horovod`, which then
pins this local rank's GPU through :func:`kmp.gpu.configure_gpus`) or JAX's
runtime (:mod:`kmp.distributed._jax`).

Note that the package :mod:`kmp.distributed` re-exports the function
:func:`world` under the name of this module, so ``kmp.distributed.world`` is the
function; import from this module as ``from kmp.distributed.world import ...``.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from types import ModuleType

from kmp import _launcher_env as _env
from kmp.distributed import _horovod, _jax
from kmp.distributed.engines import choose_engine

__all__ = [
    "World",
    "init",
    "is_chief",
    "is_initialized",
    "local_rank",
    "local_size",
    "rank",
    "restart",
    "size",
    "uses_horovod",
    "world",
]


@dataclasses.dataclass(frozen=True)
class World:
    """Where this process stands in the job.

    Attributes:
        rank: Global rank, 0 for the chief.
        size: Number of processes.
        local_rank: Rank among the processes on this host.
        local_size: Number of processes on this host.
        horovod: True when Horovod is running the collectives.
        cross_rank: Which host this is, among the hosts (0 on the first).
        cross_size: Number of hosts.
        engine: ``"horovod"``, ``"jax"``, or ``"none"`` for a single process
            started without a launcher.
    """

    rank: int
    size: int
    local_rank: int
    local_size: int
    horovod: bool
    cross_rank: int = 0
    cross_size: int = 1
    engine: str = "none"


def _single() -> World:
    return World(rank=0, size=1, local_rank=0, local_size=1, horovod=False)


@dataclasses.dataclass
class _State:
    """The process-wide state: whether :func:`init` ran, the engine, and the world."""

    initialized: bool = False
    hvd: ModuleType | None = None  # horovod.tensorflow once Horovod runs
    jax: bool = False  # True once the JAX engine runs
    world: World = dataclasses.field(default_factory=_single)


_STATE = _State()


def init(engine: str = "auto") -> World:
    """Initialise the distributed runtime (idempotent).

    ``engine`` chooses what carries the collectives when the job has more than
    one process (see :mod:`kmp.distributed.engines`): ``"horovod"`` (the
    TensorFlow backend, under ``horovodrun`` / ``mpirun`` / ``kmp launch``),
    ``"jax"`` (the JAX backend, under ``kmp launch --engine jax``), or
    ``"auto"``: the launcher's engine, else the Keras backend's.

    With Horovod this calls ``horovod.tensorflow.init()`` and, when TensorFlow
    sees GPUs, makes only the GPU of this process's local rank visible, with
    memory growth (with more ranks on the host than GPUs, ranks share GPU
    ``local_rank % n_gpus`` and a ``RuntimeWarning`` says so; see
    :func:`kmp.gpu.configure_gpus`). With JAX it joins the process group at the
    launcher's coordinator and sets a Keras ``DataParallel`` distribution over
    every device of every process; every variable created under it starts from
    process 0's value (one broadcast per variable), so a script that seeds each
    process differently after ``init()`` builds process 0's model everywhere, as
    Horovod's ``BroadcastInitialState`` gives (see :func:`kmp.distributed._jax.start`).
    Started without a launcher, or launched as a
    single Horovod process without Horovod installed, it sets up a world of one
    process and does nothing else. A second call returns the same world.

    Args:
        engine: ``"auto"``, ``"horovod"`` or ``"jax"``.

    Returns:
        The :class:`World` of this process.

    Raises:
        TypeError: ``engine`` is not a string.
        ValueError: An unknown engine, one that contradicts the Keras backend or
            the launcher's ``--engine``, or a bad launcher variable.
        ImportError: The launcher started more than one process but Horovod
            cannot be imported; the message says how to install it.
        RuntimeError: The JAX processes did not all join in time, or this Keras
            lacks the hook the JAX engine needs (the message says what to install).
    """
    import keras

    chosen = choose_engine(engine, keras.backend.backend(), _env.launched_engine())
    if _STATE.initialized:
        return _STATE.world
    n = _env.launched_world_size()
    elastic = _env.launched_elastic()
    local_run = _env.launched_local_run_size()
    if chosen == "jax" and (n or local_run or 1) > 1:
        return _start_jax(n or local_run)
    if chosen == "horovod" and n is None and local_run is not None:
        raise ValueError(
            "This process was started by kmp's local launcher (KMP_SIZE), which runs JAX-engine "
            "jobs; Horovod needs horovodrun. Launch with kmp launch (--engine horovod)."
        )
    hvd = None
    if chosen == "horovod" and (n is not None or elastic):
        hvd = _horovod.start(n or 1, elastic=elastic)
    if hvd is None:
        _STATE.world = _single()
        _STATE.initialized = True
        return _STATE.world
    _STATE.hvd = hvd
    _STATE.world = _horovod_world(hvd)
    _STATE.initialized = True
    _configure_local_gpu(_STATE.world.local_rank)
    return _STATE.world


def _start_jax(n: int) -> World:
    coordinator = _env.launched_coordinator()
    process_id = _env.launched_rank()
    if coordinator is None or process_id is None:
        raise ValueError(
            f"This job has {n} processes on the JAX engine, but KMP_COORDINATOR (host:port) "
            "or the process's rank (HOROVOD_RANK, OMPI_COMM_WORLD_RANK, ...) is not set. "
            "Start it with kmp launch --engine jax, which sets both."
        )
    if process_id >= n:
        raise ValueError(f"The launcher gave rank {process_id} in a job of {n} processes.")
    local_rank_, local_size_ = _env.launcher_local_rank(), _env.launcher_local_size()
    # Several processes on a host: one GPU each (as Horovod's ranks); one: all of them.
    shared = local_rank_ is not None and (local_size_ or 1) > 1
    _jax.start(
        coordinator,
        n,
        process_id,
        timeout_s=_env.launched_jax_timeout(),
        local_device=local_rank_ if shared else None,
    )
    layout = _jax.local_layout(local_rank_, local_size_, _env.launcher_cross())
    rank_, size_, local_rank_, local_size_, cross_rank_, cross_size_ = layout
    _STATE.jax = True
    _STATE.world = World(
        rank_,
        size_,
        local_rank_,
        local_size_,
        False,
        cross_rank=cross_rank_,
        cross_size=cross_size_,
        engine="jax",
    )
    _STATE.initialized = True
    return _STATE.world


def _horovod_world(hvd: ModuleType) -> World:
    rank_, size_, local_rank_, local_size_, cross_rank_, cross_size_ = _horovod.local_layout(hvd)
    return World(
        rank_,
        size_,
        local_rank_,
        local_size_,
        True,
        cross_rank=cross_rank_,
        cross_size=cross_size_,
        engine="horovod",
    )


def restart() -> World:
    """Start the engine again after the job's workers changed (elastic training).

    Horovod is shut down and initialised again; in an elastic job the new world
    (rank, size, hosts) comes from the driver. The GPU stays the one pinned by
    :func:`init`: TensorFlow cannot change it in a running process.

    Returns:
        The new :class:`World` of this process.

    Raises:
        RuntimeError: Horovod is not running (a single process has no world to restart).
    """
    if _STATE.hvd is None:
        raise RuntimeError(
            "kmp.distributed.restart() needs a running Horovod job (started by horovodrun); "
            "this process runs alone."
        )
    _horovod.restart(_STATE.hvd)
    _STATE.world = _horovod_world(_STATE.hvd)
    return _STATE.world


def _configure_local_gpu(local_rank_: int) -> None:
    """Give this local rank its GPU with memory growth, if TensorFlow sees any.

    The engine's own local rank is passed on, so the launcher variables are not
    read a second time. The rule for more ranks than GPUs is
    :func:`kmp.gpu.configure_gpus`'s: share GPU ``local_rank % n_gpus``, with a
    warning. A TensorFlow that already initialised its GPUs gets a warning
    instead of an error: the job still runs, on whatever TensorFlow chose.
    """
    from kmp import gpu as _gpu

    try:
        _gpu.configure_gpus(memory_growth=True, visible="local_rank", local_rank=local_rank_)
    except RuntimeError as exc:  # GPUConfigurationError: TensorFlow already set up its GPUs.
        warnings.warn(
            f"kmp.distributed.init() could not pin a GPU to local rank {local_rank_} ({exc}). "
            "Call kmp.distributed.init() before building any model or tensor.",
            RuntimeWarning,
            stacklevel=3,
        )


def _ensure() -> World:
    return _STATE.world if _STATE.initialized else init()


def _engine() -> ModuleType | None:
    """Horovod's TF module when more than one Horovod process runs, else None (initialising)."""
    w = _ensure()
    return _STATE.hvd if w.size > 1 else None


def _jax_engine() -> bool:
    """True when more than one process runs on the JAX engine (initialising first)."""
    w = _ensure()
    return _STATE.jax and w.size > 1


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


def _reset_for_tests() -> None:
    """Forget the initialised state (single-process tests only).

    Raises:
        RuntimeError: Horovod is running; a live job cannot be reset.
    """
    if _STATE.hvd is not None and "horovod.tensorflow" in sys.modules:
        raise RuntimeError("Cannot reset a running Horovod job.")
    if _STATE.jax:
        _jax.remove_initial_values_hook()
    _STATE.initialized = False
    _STATE.hvd = None
    _STATE.jax = False
    _STATE.world = _single()
