"""Where this process stands in the job: :func:`init`, the :class:`World`, its engine and accessors.

The state lives here, once per process: the one :class:`~kmp.distributed.engines.Engine`
that carries the collectives, and the :class:`World` it describes. :func:`init` reads
the launcher's world size (through :mod:`kmp._launcher_env`), chooses the engine
(:func:`kmp.distributed.engines.choose_engine`) and starts it when the job has more
than one process: Horovod (:mod:`kmp.distributed._horovod`, which then pins this
local rank's GPU through :func:`kmp.gpu.configure_gpus`) or JAX's runtime
(:mod:`kmp.distributed._jax`); otherwise the engine is
:class:`~kmp.distributed.engines.SingleProcess`.

Nothing else starts an engine. Before :func:`init` the accessors (:func:`rank`,
:func:`size`, :func:`world`, ...) answer from the launcher's environment, read at
each call, without starting anything (a plain ``python train.py`` is a world of
one); :func:`engine` and every collective then raise a ``RuntimeError`` that says
to call :func:`init` first when the launcher started several processes (or an
elastic job), and act as a world of one otherwise.

An engine the script started itself is adopted, not started again. A script that
called ``hvd.init()`` before kmp (Horovod's examples, TF1 scripts) runs Horovod
already: on the TensorFlow backend every accessor, :func:`engine` and :func:`init`
take it as the process's engine (:func:`kmp.distributed._horovod.adopt`, which
looks in ``sys.modules`` and neither imports nor initialises Horovod). Registering
an engine the script started is not starting one, so the rule above stands: a
getter never starts an engine. A script that joined JAX's process group itself
(``jax.distributed.initialize()``) is different: adopting it means setting Keras's
distribution and seeds, a side effect, so only :func:`init` adopts it
(:func:`kmp.distributed._jax.adopt`: everything but joining); before that,
:func:`world` answers from JAX (rank and size, ``engine="none"``) and
:func:`engine` raises a ``RuntimeError`` that says to call :func:`init`.

Note that the package :mod:`kmp.distributed` re-exports the function
:func:`world` under the name of this module, so ``kmp.distributed.world`` is the
function; import from this module as ``from kmp.distributed.world import ...``.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings

from kmp import _launcher_env as _env
from kmp.distributed import _horovod, _jax
from kmp.distributed.engines import SINGLE_PROCESS, Engine, choose_engine, layout

__all__ = [
    "World",
    "engine",
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
        engine: ``"horovod"``, ``"jax"``, or ``"none"``: a single process, or a
            launched process before :func:`init` (no engine runs yet).
    """

    rank: int
    size: int
    local_rank: int
    local_size: int
    horovod: bool
    cross_rank: int = 0
    cross_size: int = 1
    engine: str = "none"


def _world_of(running: Engine) -> World:
    """The :class:`World` an engine describes (its name says which engine runs)."""
    rank_, size_, local_rank_, local_size_, cross_rank_, cross_size_ = running.layout()
    return World(
        rank_,
        size_,
        local_rank_,
        local_size_,
        running.name == "horovod",
        cross_rank=cross_rank_,
        cross_size=cross_size_,
        engine=running.name,
    )


@dataclasses.dataclass
class _State:
    """The process-wide state: the engine :func:`init` started (None before), and its world."""

    engine: Engine | None = None
    world: World = dataclasses.field(default_factory=lambda: _world_of(SINGLE_PROCESS))


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
    process and does nothing else. A second call returns the same world (on the
    JAX engine it sets kmp's distribution again if ``keras.backend.clear_session()``
    dropped it).

    An engine the script started itself is adopted, not started again: after
    the script's own ``hvd.init()`` the Horovod engine is that Horovod (its rank
    and size), and after its own ``jax.distributed.initialize()`` the JAX engine
    skips joining and does the rest (seed, distribution, process 0's initial
    values), with the rank and size JAX gives.

    It is the one function that starts an engine: call it once at the top of a
    training script, before building the model or wrapping the optimizer. The
    accessors and collectives never call it (see the module docstring).

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
    if _STATE.engine is not None:
        if _STATE.engine.name == "jax" and _jax.distribution_lost():
            _jax.set_distribution()  # keras.backend.clear_session() had dropped it
        return _STATE.world
    started = _adopt(chosen) or _start(chosen)
    _hold(started)
    if started.name == "horovod":
        _configure_local_gpu(_STATE.world.local_rank)
    return _STATE.world


def _hold(running: Engine) -> None:
    """Make ``running`` the process's engine, and its world the process's world."""
    _STATE.world = _world_of(running)
    _STATE.engine = running


def _adopt(chosen: str) -> Engine | None:
    """The ``chosen`` engine when the script started it itself (adopted, not started), else None."""
    if chosen == "horovod":
        return _horovod.adopt()
    if chosen == "jax" and _jax.script_joined():
        _jax.adopt(own_step=_env.launched_jax_step() == "flat")
        return _jax.JaxEngine(*_launcher_place())
    return None


def _launcher_place() -> tuple[int | None, int | None, tuple[int, int] | None]:
    """The launcher's local rank, local size and ``(cross_rank, cross_size)``, each or None."""
    return _env.launcher_local_rank(), _env.launcher_local_size(), _env.launcher_cross()


def _held() -> Engine | None:
    """The process's engine: the one :func:`init` holds, or the Horovod the script started.

    The script's own Horovod (``hvd.init()`` before kmp) is adopted on the
    TensorFlow backend (the Horovod engine's); adopting it starts nothing.
    """
    if _STATE.engine is None and _backend_is_tensorflow():
        adopted = _horovod.adopt()
        if adopted is not None:
            _hold(adopted)
    return _STATE.engine


def _backend_is_tensorflow() -> bool:
    """True on Keras's TensorFlow backend (only asked once Horovod runs in this process)."""
    if sys.modules.get("horovod.tensorflow") is None:
        return False  # no Horovod: nothing to adopt, and Keras need not be imported
    import keras

    return keras.backend.backend() == "tensorflow"


def _start(chosen: str) -> Engine:
    """Start the ``chosen`` engine if the launcher started a job for it, else one process."""
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
    if chosen == "horovod" and (n is not None or elastic):
        started = _horovod.start(n or 1, elastic=elastic)
        if started is not None:
            return started
    return SINGLE_PROCESS


def _start_jax(n: int) -> Engine:
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
        timeouts=_env.launched_jax_timeouts(),
        local_device=local_rank_ if shared else None,
        own_step=_env.launched_jax_step() == "flat",
    )
    return _jax.JaxEngine(local_rank_, local_size_, _env.launcher_cross())


def restart() -> World:
    """Start the engine again after the job's workers changed (elastic training).

    Horovod is shut down and initialised again; in an elastic job the new world
    (rank, size, hosts) comes from the driver. The GPU stays the one pinned by
    :func:`init`: TensorFlow cannot change it in a running process.

    Returns:
        The new :class:`World` of this process.

    Raises:
        RuntimeError: Horovod is not running (a single process has no world to
            restart; a launched one must call :func:`init` first).
    """
    running = engine()
    running.restart()
    _STATE.world = _world_of(running)
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


def _launched_size() -> int:
    """The number of processes the launcher announced (1 without a launcher)."""
    return _env.launched_world_size() or _env.launched_local_run_size() or 1


def _not_started(what: str) -> RuntimeError:
    elastic = " (an elastic job)" if _env.launched_elastic() else ""
    return RuntimeError(
        f"{what}: the launcher started {_launched_size()} process(es){elastic}, but "
        "kmp.distributed.init() has not run, so no engine carries the collectives. Call "
        "kmp.distributed.init() once at the top of the script, before building the model "
        "or wrapping the optimizer (kmp does not start the engine on first use)."
    )


def _jax_size() -> int:
    """How many processes the JAX runtime the script joined has (0: it joined none)."""
    if not _jax.script_joined():
        return 0
    import jax

    return int(jax.process_count())


def _jax_not_adopted(n: int) -> RuntimeError:
    return RuntimeError(
        f"kmp.distributed needs its engine: this script joined JAX's process group itself "
        f"(jax.distributed.initialize(), {n} processes), but kmp.distributed.init() has not "
        "run, and kmp's getters do not set Keras's distribution behind your back. Call "
        "kmp.distributed.init() once after jax.distributed.initialize(), before building the "
        "model or wrapping the optimizer: it adopts the running JAX runtime (no second "
        "initialize) and sets the data-parallel distribution."
    )


def _launched_world() -> World:
    """The :class:`World` before :func:`init`: JAX's or the launcher's (nothing started)."""
    n = _jax_size()
    if n > 1:  # the script joined JAX's process group itself: JAX knows the rank
        import jax

        known = int(jax.process_index())
    else:
        n = _launched_size()
        if n == 1:
            return _world_of(SINGLE_PROCESS)
        known = _env.launched_rank()
        if known is None:
            raise _not_started("This process's rank is unknown")
    rank_, n, local_rank_, local_size_, cross_rank_, cross_size_ = layout(
        known, n, *_launcher_place()
    )
    return World(
        rank_, n, local_rank_, local_size_, False, cross_rank=cross_rank_, cross_size=cross_size_
    )


def engine() -> Engine:
    """Return the engine that carries this process's collectives, never starting one.

    It is the engine :func:`init` started, or the Horovod the script started
    itself (``hvd.init()``: adopted, see the module docstring); before
    :func:`init`, the single-process engine when the launcher started one
    process (or none).

    Raises:
        RuntimeError: The launcher started several processes, or an elastic job,
            and :func:`init` has not run; or the script joined a JAX process
            group of several processes itself and :func:`init` has not adopted
            it. The message says to call :func:`init`.
    """
    running = _held()
    if running is not None:
        return running
    n = _jax_size()
    if n > 1:
        raise _jax_not_adopted(n)
    if _launched_size() > 1 or _env.launched_elastic():
        raise _not_started("kmp.distributed needs its engine")
    return SINGLE_PROCESS


def is_initialized() -> bool:
    """Return True once :func:`init` has run (either mode) or the script's Horovod is adopted."""
    return _held() is not None


def world() -> World:
    """Return the :class:`World` of this process.

    After :func:`init` (or with the script's own Horovod, adopted), the
    engine's; before, the one the JAX runtime the script joined gives, or the
    launcher announced in the environment (``engine="none"``: nothing is
    started), or a world of one.
    """
    return _STATE.world if _held() is not None else _launched_world()


def uses_horovod() -> bool:
    """Return True when Horovod runs the collectives (after :func:`init`, or ``hvd.init()``)."""
    running = _held()
    return running is not None and running.name == "horovod"


def rank() -> int:
    """Return the global rank of this process (0 in a single process)."""
    return world().rank


def size() -> int:
    """Return the number of processes (1 in a single process)."""
    return world().size


def local_rank() -> int:
    """Return the rank of this process on its host (0 in a single process)."""
    return world().local_rank


def local_size() -> int:
    """Return the number of processes on this host (1 in a single process)."""
    return world().local_size


def is_chief() -> bool:
    """Return True on rank 0, the process that writes files and logs."""
    return rank() == 0


def _reset_for_tests() -> None:
    """Forget the initialised state (single-process tests only; import it from this module).

    Raises:
        RuntimeError: Horovod is running; a live job cannot be reset.
    """
    if _STATE.engine is not None:
        _STATE.engine.close()
    _STATE.engine = None
    _STATE.world = _world_of(SINGLE_PROCESS)
