"""Worker: kmp.distributed collectives on real ranks (started by test_collectives.py)."""

from __future__ import annotations

import sys

import numpy as np
from _common import write_result

import kmp.distributed as dist
from kmp.distributed.buckets import payload_bytes


def before_init() -> dict:
    """What the getters and a collective do before init(): nothing is started."""
    seen = [dist.rank(), dist.size(), dist.is_initialized(), dist.uses_horovod()]
    try:
        dist.barrier()
        refused = ""
    except RuntimeError as exc:
        refused = str(exc)
    return {
        "before_init": [*seen, "horovod.tensorflow" in sys.modules],
        "refused_before_init": refused,
    }


def main() -> None:
    early = before_init()
    world = dist.init()
    assert dist.init() is world  # idempotent
    import keras
    import tensorflow as tf

    r = dist.rank()
    out: dict = {
        "world": [world.rank, world.size, world.local_rank, world.local_size, world.horovod],
        "is_chief": dist.is_chief(),
        "uses_horovod": dist.uses_horovod(),
        **early,
    }
    x = tf.constant([1.0 + r, 10.0 * (r + 1)])
    for op in ("average", "sum", "min", "max", "product"):
        out[op] = dist.allreduce(x, op=op).numpy().tolist()
    # Grouped, mixed dtypes, a None passed through, sparse gathered (the default) or densified.
    sparse = tf.IndexedSlices(tf.constant([[1.0 * (r + 1)]]), tf.constant([r]), tf.constant([2, 1]))
    grouped = dist.grouped_allreduce(
        [tf.fill([3], float(r)), None, tf.constant([r + 1], tf.int32), sparse], op="sum"
    )
    out["grouped"] = [
        None if g is None else np.asarray(tf.convert_to_tensor(g)).tolist() for g in grouped
    ]
    out["grouped_dtypes"] = [None if g is None else g.dtype.name for g in grouped]
    out["grouped_sparse_kind"] = type(grouped[3]).__name__
    (dense,) = dist.grouped_allreduce([sparse], op="sum", sparse_gradients="dense")
    out["grouped_dense"] = [type(dense).__name__, np.asarray(dense).tolist()]
    # Compression: values exactly representable in 8 mantissa bits survive both paths.
    y = tf.constant([0.5 + r, -2.0 * (r + 1), 3.0], tf.float32)
    for comp in ("fp16", "bf16"):
        red = dist.allreduce(y, op="average", compression=comp)
        out[f"avg_{comp}"] = red.numpy().tolist()
        out[f"avg_{comp}_dtype"] = red.dtype.name
        out[f"max_{comp}"] = dist.allreduce(y, op="max", compression=comp).numpy().tolist()
    # kmp's scatter path for compressed sums (alltoall, float32 sum, allgather): an int rides
    # along (ordinary allreduce), a bfloat16 input of odd size is padded, dtypes are kept.
    from kmp.distributed import _horovod

    odd = tf.cast(tf.constant([1.0 + r, 2.0, 3.0 * (r + 1)]), tf.bfloat16)
    for comp in ("fp16", "bf16"):
        got = _horovod.grouped_allreduce(
            dist.engine().hvd, [y, tf.constant([r + 1], tf.int32), odd], "sum", comp,
            path="scatter",
        )  # fmt: skip
        out[f"scatter_{comp}"] = [np.asarray(tf.cast(g, tf.float32)).tolist() for g in got]
        out[f"scatter_{comp}_dtypes"] = [g.dtype.name for g in got]
    out["allgather"] = dist.allgather(tf.constant([float(r), float(r) + 0.5])).numpy().tolist()
    out["allgather_scalar"] = dist.allgather(tf.constant(float(r))).numpy().tolist()
    # Keras 3 variables: rank 1 starts different, broadcast from rank 0, eagerly and in tf.function.
    v = keras.Variable(np.full((2, 2), float(r + 1), "float32"))
    w = keras.Variable(np.array(7.0 * (r + 1), "float32"))
    dist.broadcast_variables([v, w, v], root=0)
    out["bcast_eager"] = [v.numpy().tolist(), float(w.numpy())]
    u = keras.Variable(np.full((3,), float(r + 1), "float32"))

    @tf.function
    def bcast_in_graph():
        dist.broadcast_variables([u], root=1)
        return u.value.read_value()

    out["bcast_graph"] = bcast_in_graph().numpy().tolist()
    out["bcast_object"] = dist.broadcast_object({"rank": r, "list": [r] * 2}, root=1)
    try:
        dist.broadcast_object(1, root=2)
        out["bad_root"] = "no error"
    except ValueError as exc:
        out["bad_root"] = str(exc)
    dist.barrier()
    out["payload_fp32"] = payload_bytes([y, x])
    out["payload_fp16"] = payload_bytes([y, x], compression="fp16")
    write_result(r, out)


if __name__ == "__main__":
    main()
