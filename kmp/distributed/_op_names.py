"""Names of the Horovod collectives kmp puts in traced graphs: what they are, not their inputs.

Horovod pairs the collectives of the ranks by the name of their op. Left to itself it
names a grouped allreduce in a traced step after its first and last input tensors,
whose names hold Keras's layer and optimizer names; Keras numbers those per process
(``dense_3``, ``adam_1``), so a rank that built one more model than its peers (an
evaluation copy, the copy ``AtomicCheckpoint(async_write=True)`` writes from) names
its gradients' allreduce otherwise and every rank waits for ever. :func:`named` gives
the op a name of kmp's own at the graph's top scope, which the graph numbers in the
order the step is traced (``kmp_grouped_allreduce``, ``kmp_grouped_allreduce_1``,
...): the same on every rank that traces the same step, whatever else it built.
Eager collectives are left as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["named"]


def named(call: Callable[..., Any], kind: str, *args: Any, **kwargs: Any) -> Any:
    """Call the Horovod collective ``call``, named ``kmp_<kind>`` when it goes into a graph."""
    import tensorflow as tf

    if tf.executing_eagerly():
        return call(*args, **kwargs)
    with tf.compat.v1.get_default_graph().name_scope(None):  # the graph's top scope
        return call(*args, name=f"kmp_{kind}", **kwargs)
