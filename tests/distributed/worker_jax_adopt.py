"""Worker: the script joins JAX's process group itself, then kmp adopts it (test_adopt.py).

Run by ``kmp launch --engine jax -np 2``, whose variables (``KMP_COORDINATOR``, ``KMP_RANK``,
``KMP_SIZE``) the script passes to ``jax.distributed.initialize()`` itself, before kmp. It
reports what kmp's getters answer before ``kmp.distributed.init()`` (the rank and size, a
refused ``engine()``, no distribution set), that ``init()`` does not join again, and that a
kernel built after a per-process seed is process 0's on both (kmp's initial-values hook).
"""

import os
import sys

import jax
import keras
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _common import write_result

import kmp
from kmp.distributed.collectives import check_averaging_runtime

# The script's own start, before any kmp call (importing Keras and kmp starts nothing).
jax.distributed.initialize(
    coordinator_address=os.environ["KMP_COORDINATOR"],
    num_processes=int(os.environ["KMP_SIZE"]),
    process_id=int(os.environ["KMP_RANK"]),
)
d = kmp.distributed
out = {
    "before": {
        "world": [d.rank(), d.size()],
        "initialized": d.is_initialized(),
        "distribution": keras.distribution.distribution() is not None,
    }
}
try:
    d.engine()
    out["refused"] = ""
except RuntimeError as exc:
    out["refused"] = str(exc)
out["distribution_after_refusal"] = keras.distribution.distribution() is not None

calls = []
initialize = jax.distributed.initialize
jax.distributed.initialize = lambda *a, **k: calls.append(a) or initialize(*a, **k)
world = d.init()
out["initialize_calls"] = len(calls)
out["world"] = [world.rank, world.size, world.engine]
out["distribution"] = type(keras.distribution.distribution()).__name__


def kernel() -> list[float]:
    layer = keras.layers.Dense(3)
    layer.build((None, 2))
    return np.asarray(layer.kernel).ravel().tolist()


keras.utils.set_random_seed(1000 + world.rank)  # a different seed on each process
out["kernel"] = kernel()
with d.alone():  # outside kmp's distribution: this process's own seed
    keras.utils.set_random_seed(1000 + world.rank)
    out["own_kernel"] = kernel()
# keras.backend.clear_session() drops kmp's distribution: averaging is refused, not
# silently skipped, and init() sets the distribution again.
keras.backend.clear_session()
try:
    check_averaging_runtime(world.size)
    out["after_clear_session"] = ""
except RuntimeError as exc:
    out["after_clear_session"] = str(exc)
d.init()
check_averaging_runtime(world.size)  # raises if init() did not set it again
out["distribution_after_init"] = type(keras.distribution.distribution()).__name__
write_result(world.rank, out)
d.barrier()
