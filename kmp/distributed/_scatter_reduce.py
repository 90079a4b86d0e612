"""A 16-bit reduction whose sum is vectorised: alltoall, float32 sum in TensorFlow, allgather.

Horovod's Gloo sums float16 one element at a time on a CPU, and has no bfloat16 sum at
all, so a compressed allreduce gains less than the halved bytes promise
(``docs/performance.md``). This path moves only bits through Horovod:

1. every floating tensor of the group is cast to the wire dtype and laid end to end in one
   vector, padded to ``N`` equal chunks;
2. one ``alltoall`` sends chunk ``i`` to rank ``i`` (each rank now holds every rank's copy
   of its own chunk: ``(N - 1) / N`` of the 16-bit payload sent);
3. each rank sums its chunk's ``N`` copies in float32 with one TensorFlow reduction, in rank
   order, and casts the result back to the wire dtype;
4. one ``allgather`` returns every rank's reduced chunk (another ``(N - 1) / N``).

The bytes are a ring allreduce's, ``2 (N - 1) / N`` of the 16-bit payload per rank, and
every rank ends with the same values (each chunk is reduced once, by one rank, and then
copied), so an overflow is seen by all and every rank skips the step together.
bfloat16 travels as its int16 bit pattern (Horovod has no bfloat16).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from kmp.distributed._op_names import named

__all__ = ["scatter_reduce"]

WIRE = {"fp16": "float16", "bf16": "bfloat16"}


def scatter_reduce(hvd: ModuleType, tensors: list[Any], op: str, compression: str) -> list[Any]:
    """Reduce floating TensorFlow ``tensors`` over every rank in ``compression``'s dtype.

    Args:
        hvd: The Horovod module.
        tensors: Dense floating ``tf.Tensor`` objects, same order and shapes on every rank.
        op: ``"average"`` or ``"sum"``.
        compression: ``"fp16"`` or ``"bf16"``.

    Returns:
        The reduced tensors, each in its input's dtype and shape.
    """
    import tensorflow as tf

    n = int(hvd.size())
    wire = getattr(tf, WIRE[compression])
    flat = tf.concat([tf.reshape(tf.cast(t, wire), [-1]) for t in tensors], axis=0)
    total = int(flat.shape[0])
    chunk = -(-total // n)
    flat = tf.pad(flat, [[0, chunk * n - total]])

    def send(x: Any) -> Any:  # Horovod moves int16 bits for bfloat16
        return tf.bitcast(x, tf.int16) if wire == tf.bfloat16 else x

    def receive(x: Any) -> Any:
        return tf.bitcast(x, tf.bfloat16) if wire == tf.bfloat16 else x

    mine = receive(named(hvd.alltoall, "alltoall", send(tf.reshape(flat, [n, chunk]))))
    summed = tf.reduce_sum(tf.cast(mine, tf.float32), axis=0)
    if op == "average":
        summed = summed / n
    reduced = receive(named(hvd.allgather, "scatter_allgather", send(tf.cast(summed, wire)[None])))
    values = tf.reshape(reduced, [-1])[:total]
    out, start = [], 0
    for t in tensors:  # static shapes, as in a traced training step
        size = t.shape.num_elements()
        out.append(tf.cast(tf.reshape(values[start : start + size], tf.shape(t)), t.dtype))
        start += size
    return out
