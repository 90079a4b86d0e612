"""Horovod's TF1 session script, with kmp's helpers beside its own ``hvd.init()``.

The original (the seed document, section 5, abridged)::

    import horovod.tensorflow as hvd
    hvd.init()
    config = tf.compat.v1.ConfigProto()
    config.gpu_options.allow_growth = True
    config.gpu_options.per_process_gpu_memory_fraction = 0.9
    sess = tf.compat.v1.Session(config=config)
    with tf.device('/gpu:0'):
        optimizer = tf.train.AdamOptimizer(learning_rate=0.001 * hvd.size())
        optimizer = hvd.DistributedOptimizer(optimizer)
    with tf.GradientTape() as tape:
        loss = loss_fn(model(inputs), labels)
    gradients = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(gradients, model.trainable_variables))

What kmp changes. The script keeps its own ``hvd.init()``: kmp adopts the Horovod it started
(no ``kmp.distributed.init()`` needed, none called here).

* ``ConfigProto`` by hand -> ``kmp.compat.v1.session_config(allow_growth=True,
  memory_fraction=0.9)``, which also gives each rank the GPU of its local rank (the
  original's ``'/gpu:0'`` puts every rank of a host on one GPU), and with a GPU turns on
  Grappler's float16 rewrite (``mixed_precision="float16"``).
* ``hvd.DistributedOptimizer(AdamOptimizer(0.001 * hvd.size()))`` ->
  ``kmp.compat.v1.distributed_optimizer(AdamOptimizer(0.001), scale_lr=True,
  loss_scale="force_dynamic")``: the same rate, Horovod's average, and dynamic loss scaling whose
  finite check runs on the averaged gradients, so every rank skips an overflow together.
* ``tape.gradient`` + ``apply_gradients`` -> ``compute_gradients`` + ``apply_gradients``.
  Horovod averages in ``compute_gradients``; its ``apply_gradients`` only applies, so the
  original's tape never averages and its ranks drift apart silently.
* New: ``sess.run(kmp.compat.v1.broadcast_global_variables(0))``, so every rank starts from
  rank 0's variables.

Run it on 2 ranks (CPUs are enough)::

    kmp launch -np 2 examples/horovod_tf1_session.py
    horovodrun --gloo -np 2 -H localhost:2 python examples/horovod_tf1_session.py

Each rank prints one last line with a digest of its variables: the same on every rank.
"""

from __future__ import annotations

import hashlib

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

import kmp
from kmp.compat import v1 as kv1

STEPS = 5


def model(x: tf.Tensor, rank: int) -> tf.Tensor:
    """A tiny MLP whose initial variables differ on every rank (the broadcast fixes that)."""
    v1 = tf.compat.v1
    init = v1.random_normal_initializer(stddev=0.5, seed=7 + rank)
    w1 = v1.get_variable("w1", [4, 8], initializer=init)
    w2 = v1.get_variable("w2", [8, 1], initializer=init)
    return tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2)


def digest(values: list[np.ndarray]) -> str:
    """A short hash of the variables' bytes: equal digests, identical variables."""
    flat = np.concatenate([np.ravel(v) for v in values])
    return hashlib.sha256(flat.tobytes()).hexdigest()[:16]


def main() -> dict:
    """Train a few steps on every rank; return this rank's result."""
    hvd.init()  # the script's own start, as in the original: kmp adopts it
    v1 = tf.compat.v1
    v1.disable_eager_execution()
    gpus = tf.config.list_physical_devices("GPU")
    config = kv1.session_config(
        allow_growth=True, memory_fraction=0.9, mixed_precision="float16" if gpus else None
    )
    rng = np.random.default_rng(hvd.rank())  # each rank reads its own data
    inputs = rng.normal(size=(16, 4)).astype("float32")
    labels = inputs.sum(axis=1, keepdims=True).astype("float32")

    loss = tf.reduce_mean(tf.square(model(tf.constant(inputs), hvd.rank()) - labels))
    optimizer = kv1.distributed_optimizer(
        v1.train.AdamOptimizer(learning_rate=0.001), scale_lr=True, loss_scale="force_dynamic"
    )
    grads_and_vars = optimizer.compute_gradients(loss)  # scaled, averaged, unscaled
    train = optimizer.apply_gradients(grads_and_vars)  # or skipped on an overflow
    broadcast = kv1.broadcast_global_variables(0)
    with v1.Session(config=config) as sess:
        sess.run(v1.global_variables_initializer())
        initial = digest(sess.run(v1.trainable_variables()))  # differs on every rank
        sess.run(broadcast)
        losses = [float(sess.run([train, loss])[1]) for _ in range(STEPS)]
        values = sess.run(v1.trainable_variables())
        scale = float(sess.run(optimizer.loss_scale))
    final = digest(values)
    running = kmp.distributed.engine()
    adopted = getattr(running, "hvd", None) is hvd
    print(
        f"rank {hvd.rank()} of {hvd.size()}: kmp runs on the script's hvd.init() ({adopted}), "
        f"loss scale {scale:g}, "
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f}, variables {final}",
        flush=True,
    )
    return {
        "rank": hvd.rank(),
        "size": hvd.size(),
        "adopted": adopted,
        "initial": initial,
        "digest": final,
        "variables": np.concatenate([np.ravel(v) for v in values]).tolist(),
        "losses": losses,
    }


if __name__ == "__main__":
    main()
