"""Helpers for TF1 (``tf.compat.v1``) graph-mode Horovod scripts.

The canonical Horovod TF1 script builds a ``ConfigProto`` by hand, a session
from it, and wraps its optimizer in ``hvd.DistributedOptimizer``. With kmp::

    import tensorflow as tf
    import kmp
    from kmp.compat import v1 as kv1

    tf.compat.v1.disable_eager_execution()
    world = kmp.distributed.init()
    ...  # build the graph: loss = ...
    opt = kv1.distributed_optimizer(
        tf.compat.v1.train.AdamOptimizer(1e-3), loss_scale="dynamic", scale_lr=True
    )
    train_op = opt.minimize(loss, global_step=tf.compat.v1.train.get_or_create_global_step())
    bcast = kv1.broadcast_global_variables(root=0)
    with kv1.session(mixed_precision="float16") as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(bcast)
        ...

Mixed precision for graphs: TensorFlow 2.21 still ships Grappler's automatic
mixed precision rewrite, switched on per session in the ``ConfigProto``
(``session_config(mixed_precision="float16")`` on NVIDIA GPUs,
``"bfloat16"`` on CPUs with oneDNN). The global
``tf.compat.v1.mixed_precision.enable_mixed_precision_graph_rewrite`` still
exists but is deprecated; it wraps the optimizer in TensorFlow's own
``MixedPrecisionLossScaleOptimizer``, which kmp replaces with ``loss_scale=`` here
so that the Horovod allreduce and the loss-scale check run in one fixed order.

The helpers live in two modules, and what a script calls is re-exported here:
:mod:`kmp.compat.v1.sessions` (``ConfigProto`` and sessions; ``build_session_config``,
the pure part of ``session_config``) and :mod:`kmp.compat.v1.optimizer` (the
distributed optimizer, its class ``DistributedOptimizer``, and the broadcast op).
"""

from kmp.compat.v1.optimizer import broadcast_global_variables, distributed_optimizer
from kmp.compat.v1.sessions import session, session_config

__all__ = ["broadcast_global_variables", "distributed_optimizer", "session", "session_config"]
