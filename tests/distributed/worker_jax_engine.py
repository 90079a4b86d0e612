"""Worker for the JAX engine tests: fit a small model on this process's data, report the weights.

Usage: worker_jax_engine.py POLICIES MODE [CKPT_DIR]
  POLICIES: comma-separated; each trains a fresh model in turn (one process start for all).
  MODE "dist": started by kmp launch --engine jax; each process trains on its own half.
  MODE "single": one process trains on the concatenated global batches (the reference).
Under mixed_float16 the first batch of process 1 (and the same rows in "single") holds
1e6, which overflows float16: every process must skip that step. CKPT_DIR: checkpoints of
the first policy's run (the chief writes them). In "dist" mode a last run trains a model
with BatchNormalization and Dropout, and every run reports how many all-reduces its
compiled train step holds (kmp's step: one).
"""

import os
import re
import sys

import keras
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _common import write_result

import kmp

POLICIES, MODE = sys.argv[1].split(","), sys.argv[2]
CKPT = sys.argv[3] if len(sys.argv) > 3 else None
PROCS, N, BS, FEATURES = 2, 48, 8, 6

world = kmp.distributed.init()
if MODE == "dist":
    assert world.size == PROCS and world.engine == "jax", world


def data(policy: str):
    rng = np.random.default_rng(0)
    x_all = rng.normal(size=(PROCS, N, FEATURES)).astype("float32")
    y_all = rng.integers(0, 3, size=(PROCS, N)).astype("int32")
    if policy == "mixed_float16":
        x_all[1, :BS] = 1e6  # process 1's first batch overflows float16
    if MODE == "dist":
        return x_all[world.rank], y_all[world.rank], BS
    # global batch b = [process 0's batch b, process 1's batch b]
    steps = range(N // BS)
    x = np.concatenate([np.concatenate(list(x_all[:, b * BS : (b + 1) * BS])) for b in steps])
    y = np.concatenate([np.concatenate(list(y_all[:, b * BS : (b + 1) * BS])) for b in steps])
    return x, y, BS * PROCS


def train(policy: str, ckpt: str | None) -> dict:
    kmp.enable(policy)
    x, y, batch = data(policy)
    keras.utils.set_random_seed(1)  # the same on every process, as JAX requires
    model = kmp.float32_outputs(
        keras.Sequential(
            [
                keras.Input((FEATURES,)),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.Dense(3, activation="softmax"),
            ]
        )
    )
    opt = kmp.wrap_optimizer(keras.optimizers.SGD(0.05))
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    callbacks = kmp.callbacks.default_callbacks(checkpoint_dir=ckpt, verbose=0)
    history = model.fit(
        x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0, callbacks=callbacks
    )
    return {
        **outcome(model, x[:batch], y[:batch], count=policy == "float32"),
        "skipped": int(opt.skipped_steps),
        "loss_scale": float(opt.loss_scale),
        "loss": [float(v) for v in history.history["loss"]],
        "accuracy": [float(v) for v in history.history["accuracy"]],
    }


def outcome(model, x, y, count: bool = True) -> dict:
    """The weights (non-trainable too), their spread over processes, the step's all-reduces."""
    import jax
    from keras.src.backend.jax.trainer import _distribute_data

    flat = np.concatenate([np.asarray(w, "float64").ravel() for w in model.get_weights()])
    gathered = np.asarray(kmp.distributed.allgather(flat[None]))
    out = {
        "max_diff": float(np.abs(gathered - gathered[0]).max()),
        "weights": flat.tolist(),
        "finite": bool(np.isfinite(flat).all()),
    }
    if not count:  # compiling the step again costs seconds
        return out
    state = model._get_jax_state(
        trainable_variables=True,
        non_trainable_variables=True,
        optimizer_variables=True,
        metrics_variables=True,
        purge_model_variables=False,
    )
    step = jax.jit(model.train_step).lower(state, _distribute_data((x, y, None)))
    hlo = step.compile().as_text()  # after XLA's partitioning, where its all-reduces appear
    return {**out, "all_reduces": len(re.findall(r"= [^=]*all-reduce(?:-start)?\(", hlo))}


def train_normalized() -> dict:
    """BatchNormalization's moving statistics and Dropout's seed under the engine's step.

    Rank 0 audits the model alone first, as launch/train.py does.
    """
    kmp.enable("mixed_float16")
    x, y, batch = data("float32")
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.LayerNormalization(),
            keras.layers.Dropout(0.3),
            keras.layers.Dense(3, activation="softmax", dtype="float32"),
        ]
    )
    model.compile(optimizer=kmp.wrap_optimizer(keras.optimizers.SGD(0.05)), loss="mse")
    if world.rank == 0:  # alone: its measured checks' throw-away layers stay on this process
        assert kmp.audit(model).rows
    targets = np.eye(3, dtype="float32")[y]
    model.fit(x, targets, batch_size=batch, epochs=1, verbose=0)
    return outcome(model, x[:batch], targets[:batch])


runs = {p: train(p, CKPT if i == 0 else None) for i, p in enumerate(POLICIES)}
if MODE == "dist":
    runs["normalized"] = train_normalized()
# The collectives outside the step, on this engine.
obj = kmp.distributed.broadcast_object({"from": world.rank}, root=world.size - 1)
summed = kmp.distributed.allreduce(np.array([world.rank + 1.0]), op="sum")
biggest = kmp.distributed.allreduce(np.array([world.rank + 1.0]), op="max")
kmp.distributed.barrier()
write_result(
    world.rank,
    {
        "engine": world.engine,
        "size": world.size,
        "runs": runs,
        "collectives": {"object": obj, "sum": float(summed[0]), "max": float(biggest[0])},
    },
)
