"""Worker: an Embedding model on the JAX engine, 2 processes (tests/distributed/test_sparse.py).

Started by ``kmp launch --engine jax -np 2``. JAX gradients are dense arrays, so
``sparse_gradients`` changes nothing here: each process fits a token + position
Embedding model on its own data, for both settings, and the processes must end
bit-identical (and the two settings train alike).
"""

import os
import sys

import keras
import numpy as np
from keras import ops

sys.path.insert(0, os.path.dirname(__file__))
from _common import write_result

import kmp

VOCAB, SEQ, DIM = 64, 16, 16
world = kmp.distributed.init()
assert world.size == 2 and world.engine == "jax", world


class TokenAndPosition(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.tokens = keras.layers.Embedding(VOCAB, DIM)
        self.positions = keras.layers.Embedding(SEQ, DIM)

    def call(self, x):
        return self.tokens(x) + self.positions(ops.arange(SEQ))


def train(policy: str, strategy: str) -> dict:
    kmp.enable(policy)
    keras.utils.set_random_seed(1)  # the same on every process, as JAX requires
    model = keras.Sequential(
        [
            keras.Input((SEQ,), dtype="int32"),
            TokenAndPosition(),
            keras.layers.LayerNormalization(),
            keras.layers.Dense(VOCAB),
            keras.layers.Activation("linear", dtype="float32"),
        ]
    )
    opt = kmp.wrap_optimizer(keras.optimizers.Adam(1e-2), sparse_gradients=strategy)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(100 + world.rank)  # different data on each process
    seq = (rng.integers(0, VOCAB, size=(32, 1)) + np.arange(SEQ + 1)) % VOCAB
    start = np.concatenate([np.ravel(w) for w in model.get_weights()])
    hist = model.fit(seq[:, :-1], seq[:, 1:], batch_size=8, epochs=1, verbose=0, shuffle=False)
    flat = np.concatenate([np.asarray(w, "float64").ravel() for w in model.get_weights()])
    gathered = np.asarray(kmp.distributed.allgather(flat[None]))
    return {
        "max_diff": float(np.abs(gathered - gathered[0]).max()),
        "moved": float(np.abs(flat - start).max()),
        "skipped": int(opt.skipped_steps),
        "loss": [float(v) for v in hist.history["loss"]],
    }


runs = {f"{s}/{p}": train(p, s) for p in ("float32", "mixed_bfloat16") for s in ("dense", "gather")}
write_result(world.rank, {"engine": world.engine, "runs": runs})
