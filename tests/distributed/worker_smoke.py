"""Smoke job: every rank reports its rank, the world size and an allreduce."""

import horovod
import horovod.tensorflow as hvd
import tensorflow as tf
from _common import write_result

hvd.init()
summed = hvd.allreduce(tf.constant([float(hvd.rank() + 1), 10.0]), op=hvd.Sum)
averaged = hvd.allreduce(tf.constant(float(hvd.rank())), op=hvd.Average)
write_result(
    hvd.rank(),
    {
        "rank": hvd.rank(),
        "size": hvd.size(),
        "local_rank": hvd.local_rank(),
        "sum": summed.numpy().tolist(),
        "average": float(averaged.numpy()),
        "gloo": bool(hvd.gloo_built()),
        "version": horovod.__version__,
    },
)
