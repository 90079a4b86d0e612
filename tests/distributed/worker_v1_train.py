"""Worker: a TF1 graph-mode Horovod script built with kmp.compat.v1 (tests/compat/test_v1.py).

Two phases in one job, each a fresh graph and a ``tf.compat.v1.Session`` from kmp's config:

* ``float32``: a tf.data pipeline, ``GradientDescentOptimizer`` wrapped by
  ``distributed_optimizer(scale_lr=True)``.
* ``dynamic``: placeholders, ``AdamOptimizer`` with ``loss_scale="force_dynamic"``, fp16 gradient
  compression and, when TensorFlow runs with oneDNN, Grappler's bfloat16 rewrite
  (``session_config(mixed_precision="bfloat16")``). Rank 1 alone feeds an inf at step 2:
  both ranks must skip that step together and halve the scale.

In both, each rank starts from different random variables and reads different data; the
initial values are broadcast from rank 0, and the ranks must end with identical variables.
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")  # for the bfloat16 graph rewrite

import numpy as np
from _common import write_result

import kmp.distributed as dist
from kmp.compat import v1 as kv1

STEPS = 6


def model(tf, x, rank: int):
    v1 = tf.compat.v1
    init = v1.random_normal_initializer(stddev=0.5, seed=11 + rank)  # differs per rank
    w1 = v1.get_variable("w1", [8, 16], initializer=init)
    b1 = v1.get_variable("b1", [16], initializer=v1.zeros_initializer())
    w2 = v1.get_variable("w2", [16, 1], initializer=init)
    return tf.matmul(tf.nn.relu(tf.matmul(x, w1) + b1), w2)


def data(rank: int):
    rng = np.random.default_rng(3 + rank)  # different data on each rank
    x = rng.normal(size=(8 * STEPS, 8)).astype("float32")
    y = (x @ np.linspace(-1, 1, 8)[:, None] + 0.1 * rank).astype("float32")
    return x, y


def flat_vars(tf, sess) -> list[float]:
    values = sess.run(tf.compat.v1.trainable_variables())
    return np.concatenate([np.ravel(v) for v in values]).astype("float32").tolist()


def phase_float32(tf, rank: int) -> dict:
    v1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        x_np, y_np = data(rank)
        ds = tf.data.Dataset.from_tensor_slices((x_np, y_np)).batch(8).repeat()
        x, y = v1.data.make_one_shot_iterator(ds).get_next()
        loss = tf.reduce_mean(tf.square(model(tf, x, rank) - y))
        step = v1.train.get_or_create_global_step()
        opt = kv1.distributed_optimizer(v1.train.GradientDescentOptimizer(0.05), scale_lr=True)
        train = opt.minimize(loss, global_step=step)
        bcast = kv1.broadcast_global_variables(root=0)
        init = v1.global_variables_initializer()
    with kv1.session(graph=g) as sess:
        sess.run(init)
        start = flat_vars(tf, sess)
        sess.run(bcast)
        losses = [float(sess.run([train, loss])[1]) for _ in range(STEPS)]
        return {
            "start_checksum": float(np.sum(start)),
            "vars": flat_vars(tf, sess),
            "global_step": int(sess.run(step)),
            "learning_rate": float(opt.optimizer._learning_rate),
            "losses": losses,
        }


def phase_dynamic(tf, rank: int) -> dict:
    v1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, 8])
        y = v1.placeholder(tf.float32, [None, 1])
        loss = tf.reduce_mean(tf.square(model(tf, x, rank) - y))
        step = v1.train.get_or_create_global_step()
        opt = kv1.distributed_optimizer(
            v1.train.AdamOptimizer(0.01),
            loss_scale="force_dynamic",
            initial_scale=2.0**10,
            growth_interval=3,
            compression="fp16",
        )
        train = opt.minimize(loss, global_step=step)
        bcast = kv1.broadcast_global_variables(root=0)
        init = v1.global_variables_initializer()
    from tensorflow.python.util import _pywrap_util_port

    onednn = bool(_pywrap_util_port.IsMklEnabled())
    config = kv1.session_config(mixed_precision="bfloat16" if onednn else None)
    x_np, y_np = data(rank)
    with kv1.session(config, graph=g) as sess:
        sess.run(init)
        sess.run(bcast)
        scales, steps, bf16_nodes = [], [], 0
        for i in range(STEPS):
            xb, yb = x_np[8 * i : 8 * i + 8].copy(), y_np[8 * i : 8 * i + 8]
            if i == 2 and rank == 1:
                xb[0, 0] = np.inf
            md = v1.RunMetadata()
            sess.run(
                train,
                {x: xb, y: yb},
                options=v1.RunOptions(output_partition_graphs=True),
                run_metadata=md,
            )
            bf16_nodes += sum(
                1
                for pg in md.partition_graphs
                for n in pg.node
                if n.op.endswith("MatMul") and n.attr["T"].type == tf.bfloat16.as_datatype_enum
            )
            scales.append(float(sess.run(opt.loss_scale)))
            steps.append(int(sess.run(step)))
        return {
            "vars": flat_vars(tf, sess),
            "scales": scales,
            "global_steps": steps,
            "onednn": onednn,
            "bf16_matmuls": bf16_nodes,
            "finite": bool(np.all(np.isfinite(flat_vars(tf, sess)))),
        }


def main() -> None:
    world = dist.init()
    import tensorflow as tf

    tf.compat.v1.disable_eager_execution()
    t0 = time.time()
    out = {"world": [world.rank, world.size], "float32": phase_float32(tf, world.rank)}
    t1 = time.time()
    out["dynamic"] = phase_dynamic(tf, world.rank)
    out["seconds"] = [t1 - t0, time.time() - t1]
    write_result(world.rank, out)


if __name__ == "__main__":
    main()
