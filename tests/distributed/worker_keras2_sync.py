"""Worker: the tf-keras (Keras 2) path on real ranks (started by tests/compat/test_keras2.py).

Runs two phases in one job: float32, then mixed_float16. In each, the ranks start from
different random weights (rank-dependent seed), fit on different data, and must end with
identical weights: Horovod's callback broadcasts rank 0's weights after the first batch and
``LossScaleOptimizer(hvd.DistributedOptimizer(opt))`` averages every gradient. In
mixed_float16, rank 1 alone gets one batch that overflows float16: both ranks must skip that
step together and halve the loss scale.
"""

from __future__ import annotations

import os
import time

os.environ["TF_USE_LEGACY_KERAS"] = "1"  # before TensorFlow is imported

import numpy as np
from _common import write_result

import kmp.distributed as dist
from kmp.compat import keras2

BATCH = 16
STEPS = 6
INITIAL_SCALE = 2.0**10


def build(tf_keras, seed: int):
    tf_keras.utils.set_random_seed(seed)
    return tf_keras.Sequential(
        [
            tf_keras.layers.Dense(16, activation="relu", input_shape=(8,)),
            tf_keras.layers.Dense(3),
            tf_keras.layers.Activation("softmax", dtype="float32"),
        ]
    )


def phase(tf_keras, tf, policy: str, rank: int, inject: bool) -> dict:
    tf_keras.backend.clear_session()
    keras2.set_global_policy(policy)
    model = build(tf_keras, seed=100 + rank)  # different start on each rank
    opt = keras2.wrap_optimizer(
        tf_keras.optimizers.SGD(0.05), initial_scale=INITIAL_SCALE, growth_interval=1000
    )
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    rng = np.random.default_rng(7 + rank)  # different data on each rank
    x = rng.normal(size=(BATCH * STEPS, 8)).astype("float32")
    y = rng.integers(0, 3, size=(BATCH * STEPS,))
    if inject and rank == 1:
        x[BATCH * 3] = 1e5  # batch 3 overflows float16 on rank 1 only
    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[keras2.broadcast_callback(0)],
    )
    flat = np.concatenate([np.ravel(w) for w in model.get_weights()]).astype("float32")
    gathered = np.asarray(dist.allgather(tf.constant(flat[None, :]))).reshape(2, -1)
    out = {
        "optimizer": [type(opt).__module__, type(opt).__name__],
        "is_loss_scale_optimizer": isinstance(opt, tf_keras.mixed_precision.LossScaleOptimizer),
        "compute_dtype": model.layers[0].compute_dtype,
        "variable_dtype": model.layers[0].kernel.dtype.name,
        "max_diff": float(np.max(np.abs(gathered[0] - gathered[1]))),
        "finite": bool(np.all(np.isfinite(flat))),
        "iterations": int(opt.iterations.numpy()),
        "checksum": float(np.sum(flat)),
    }
    if out["is_loss_scale_optimizer"]:
        inner = opt.inner_optimizer
        out["inner"] = [type(inner).__module__, type(inner).__name__]
        out["inner_is_horovod"] = hasattr(inner, "_allreduce_grads")
        out["loss_scale"] = float(opt.loss_scale.numpy())
    else:
        out["inner_is_horovod"] = hasattr(opt, "_allreduce_grads")
    return out


def main() -> None:
    t0 = time.time()
    world = dist.init()
    import tensorflow as tf
    import tf_keras

    t1 = time.time()
    result = {
        "world": [world.rank, world.size],
        "legacy": keras2.is_legacy_keras(),
        "tf_keras_is_tf_keras": tf.keras.Sequential is tf_keras.Sequential,
        "float32": phase(tf_keras, tf, "float32", world.rank, inject=False),
        "mixed_float16": phase(tf_keras, tf, "mixed_float16", world.rank, inject=True),
    }
    result["seconds"] = {"import": t1 - t0, "phases": time.time() - t1}
    write_result(world.rank, result)


if __name__ == "__main__":
    main()
