"""Two engines behind one small surface, with a single-process fallback.

Call :func:`init` once at the top of a training script. Under ``horovodrun``
(or ``mpirun``, ``kmp launch``) it initialises Horovod and gives each local rank
one GPU with memory growth; under ``kmp launch --engine jax`` (Keras's JAX
backend) it joins JAX's runtime and sets a ``DataParallel`` distribution (see
:mod:`kmp.distributed.engines`); started as a plain ``python train.py`` it is a
harmless no-op and
every function here behaves as a world of one process (``size() == 1``,
collectives return their input). The other functions call :func:`init` on
first use, so a forgotten ``init()`` never silently trains unsynchronised ranks.

Only Horovod's core TensorFlow collectives are used (``allreduce``,
``grouped_allreduce``, ``allgather``, ``broadcast``): Horovod's Keras layer does
not work with Keras 3. Keras 3 variables are accepted everywhere a variable is
expected; their ``.value`` (the ``tf.Variable``) is what Horovod sees.

The package is split by concern: :mod:`kmp.distributed.world` holds the state,
:func:`init` and the accessors; :mod:`kmp.distributed.collectives` the
collectives; :mod:`kmp.distributed.sparse` what the step does with sparse
gradients; :mod:`kmp.distributed._horovod` every call into Horovod and
:mod:`kmp.distributed._jax` every call into JAX's runtime. The
launcher's environment is read by :mod:`kmp._launcher_env`, and the accepted
reduction and compression names live in :mod:`kmp._names`; everything is
re-exported here, where it has always been.

Example::

    import kmp
    world = kmp.distributed.init()
    print(world.rank, world.size)
    total = kmp.distributed.allreduce(local_count, op="sum")
"""

from __future__ import annotations

from kmp._launcher_env import LAUNCH_SIZE_VARS, launched_world_size
from kmp._names import COMPRESSIONS, REDUCE_OPS, SPARSE_GRADIENTS, normalize_compression
from kmp.distributed.collectives import (
    allgather,
    allreduce,
    alone,
    barrier,
    broadcast_object,
    broadcast_variables,
    check_averaging_runtime,
    gradients_need_allreduce,
    grouped_allreduce,
    payload_bytes,
)
from kmp.distributed.engines import ENGINES

# Imported last on purpose: importing the submodule ``world`` binds it as an attribute
# of this package, and the function ``world`` imported here must win that name.
from kmp.distributed.world import (
    World,
    _reset_for_tests,  # noqa: F401 - tests reset the state through the package
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

__all__ = [
    "COMPRESSIONS",
    "ENGINES",
    "LAUNCH_SIZE_VARS",
    "REDUCE_OPS",
    "SPARSE_GRADIENTS",
    "World",
    "allgather",
    "alone",
    "allreduce",
    "barrier",
    "broadcast_object",
    "broadcast_variables",
    "check_averaging_runtime",
    "gradients_need_allreduce",
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
    "restart",
    "size",
    "uses_horovod",
    "world",
]
