"""Worker: each process seeds itself differently (the Horovod idiom), then builds and trains.

The same script runs on both engines: ``kmp launch --engine jax -np 2`` (KERAS_BACKEND=jax)
and horovodrun (KERAS_BACKEND=tensorflow). After ``kmp.distributed.init()`` every process
calls ``keras.utils.set_random_seed(1000 + rank)``, builds a model with a Dense, an
Embedding and a Dropout, and trains a few steps with ``kmp.wrap_optimizer`` and kmp's
default callbacks (``BroadcastInitialState`` first). It reports:

* ``own_vs_ref0``: how far this process's own-seed build is from process 0's (0 on process 0);
* ``built_vs_ref0``: how far the model it built is from process 0's own-seed build, right
  after building (JAX engine: 0, kmp gives process 0's values; Horovod: not yet broadcast);
* ``started_vs_ref0``: the same at the start of training, after the broadcast (0 on both);
* ``final_spread`` / ``opt_spread`` / ``seed_spread``: the largest difference between the
  processes of the trained weights, the optimizer's variables and the dropout's
  ``SeedGenerator`` state.
"""

import os
import sys

import keras
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _common import write_result

import kmp

VOCAB, TOKENS, N, BS = 50, 5, 32, 8

world = kmp.distributed.init()
keras.utils.set_random_seed(1000 + world.rank)  # a different seed on every process


def build() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((TOKENS,), dtype="int32"),
            keras.layers.Embedding(VOCAB, 8),
            keras.layers.Flatten(),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dropout(0.5),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )


def flat(variables) -> np.ndarray:
    return np.concatenate([np.asarray(v, "float64").ravel() for v in variables])


def seed_states(model: keras.Model) -> list:
    return [sg.state for layer in model.layers for sg in getattr(layer, "_seed_generators", [])]


def spread(x: np.ndarray) -> float:
    gathered = np.asarray(kmp.distributed.allgather(x[None]))
    return float(np.abs(gathered - gathered[0]).max())


model = build()
built = flat(model.weights)
# What each process builds by itself from its own seed; process 0's is the reference.
with kmp.distributed.alone():
    keras.utils.set_random_seed(1000 + world.rank)
    own = flat(build().weights)
ref0 = np.asarray(kmp.distributed.allgather(own[None]))[0]
keras.utils.set_random_seed(2000 + world.rank)  # data and dropout: still per process


class Snapshot(keras.callbacks.Callback):
    """The weights at the start of training, after kmp's broadcast."""

    def on_train_begin(self, logs=None):
        self.weights = flat(self.model.weights)


rng = np.random.default_rng(world.rank)
x = rng.integers(0, VOCAB, size=(N, TOKENS)).astype("int32")
y = rng.integers(0, 3, size=(N,)).astype("int32")
opt = kmp.wrap_optimizer(keras.optimizers.Adam(0.01))
model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
snapshot = Snapshot()
callbacks = [*kmp.callbacks.default_callbacks(verbose=0), snapshot]
model.fit(x, y, batch_size=BS, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
final = flat(model.weights)
result = {
    "engine": world.engine,
    "size": world.size,
    "own_vs_ref0": float(np.abs(own - ref0).max()),
    "built_vs_ref0": float(np.abs(built - ref0).max()),
    "started_vs_ref0": float(np.abs(snapshot.weights - ref0).max()),
    "final_spread": spread(final),
    "opt_spread": spread(flat(opt.variables)),
    "trained": float(np.abs(final - snapshot.weights).max()),
    "finite": bool(np.isfinite(final).all()),
}
if world.engine == "jax":
    result["seed_spread"] = spread(flat(seed_states(model)))
kmp.distributed.barrier()
write_result(world.rank, result)
