"""Two engines behind one small surface, with a single-process fallback.

Call :func:`init` once at the top of a training script. Under ``horovodrun``
(or ``mpirun``, ``kmp launch``) it initialises Horovod and gives each local rank
one GPU with memory growth; under ``kmp launch --engine jax`` (Keras's JAX
backend) it joins JAX's runtime and sets a ``DataParallel`` distribution (see
:mod:`kmp.distributed.engines`); started as a plain ``python train.py`` it is a
harmless no-op and
every function here behaves as a world of one process (``size() == 1``,
collectives return their input).

:func:`init` is the only function that starts an engine. Before it runs,
:func:`rank`, :func:`size`, :func:`local_rank`, :func:`local_size`,
:func:`is_chief` and :func:`world` answer from the launcher's environment
(``HOROVOD_RANK``, ``OMPI_COMM_WORLD_SIZE``, ``KMP_SIZE``, ...; a plain
``python train.py`` is a world of one) without starting anything, and
:func:`uses_horovod` is False. A collective (and :func:`engine`,
``kmp.wrap_optimizer``'s averaging check) in a job the launcher started as
several processes raises a ``RuntimeError`` saying to call :func:`init` first,
so a forgotten ``init()`` never silently trains unsynchronised ranks.
An engine the script started itself is adopted, not started again: Horovod after
its own ``hvd.init()`` (by every accessor and :func:`init`), JAX's runtime after
its own ``jax.distributed.initialize()`` (by :func:`init` only; see
:mod:`kmp.distributed.world`).

Only Horovod's core TensorFlow collectives are used (``allreduce``,
``grouped_allreduce``, ``allgather``, ``broadcast``): Horovod's Keras layer does
not work with Keras 3. Keras 3 variables are accepted everywhere a variable is
expected; their ``.value`` (the ``tf.Variable``) is what Horovod sees.

The package is split by concern: :mod:`kmp.distributed.world` holds the state
(the one :class:`~kmp.distributed.engines.Engine` of the process), :func:`init`
and the accessors; :mod:`kmp.distributed.engines` which engine and what an
engine does; :mod:`kmp.distributed.collectives` the collectives (argument
checks, then one call on the engine); :mod:`kmp.distributed.sparse` what the
step does with sparse gradients; :mod:`kmp.distributed._horovod` (the Horovod
engine) every call into Horovod and :mod:`kmp.distributed._jax` (the JAX
engine) every call into JAX's runtime. The
launcher's environment is read by :mod:`kmp._launcher_env`, and the accepted
reduction and compression names live in :mod:`kmp._names`. This package holds
what a training script calls; the machinery the rest of kmp shares (the
averaging checks, ``payload_bytes``, the engine classes) stays in its module.

Example::

    import kmp
    world = kmp.distributed.init()
    print(world.rank, world.size)
    total = kmp.distributed.allreduce(local_count, op="sum")
"""

from kmp.distributed.collectives import (
    allgather,
    allreduce,
    alone,
    barrier,
    broadcast_object,
    broadcast_variables,
    grouped_allreduce,
)

# Imported last on purpose: importing the submodule ``world`` binds it as an attribute
# of this package, and the function ``world`` imported here must win that name.
from kmp.distributed.world import (
    World,
    engine,
    init,
    is_chief,
    is_initialized,
    local_rank,
    local_size,
    rank,
    restart,
    size,
    uses_horovod,
    world,
)

# What a training script calls (tests/test_public_api.py pins it). The machinery the rest
# of kmp shares stays in its module: ``check_averaging_runtime`` and
# ``gradients_need_allreduce`` in kmp.distributed.collectives, ``payload_bytes`` in
# kmp.distributed.buckets, ``Engine`` in kmp.distributed.engines, the launcher's
# variables in kmp._launcher_env, the accepted names (``COMPRESSIONS``, ...) in kmp._names.
__all__ = [
    "World",
    "allgather",
    "allreduce",
    "alone",
    "barrier",
    "broadcast_object",
    "broadcast_variables",
    "engine",
    "grouped_allreduce",
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
