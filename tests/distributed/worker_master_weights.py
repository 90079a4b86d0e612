"""Worker: bfloat16 weights in every master-weights mode on 2 ranks (tests/test_master_weights.py).

Started by horovodrun (TensorFlow backend: the Horovod engine) or by ``kmp launch
--engine jax``. Each rank fits a token Embedding + Dense model under the bfloat16 policy
on its own data, once per mode (stochastic twice from the same seed), and reports the
largest difference between the ranks' weights and optimizer state (0: bit-identical).
One more run scales the loss dynamically (on Horovod it also accumulates 2 micro-batches,
sends bfloat16 and uses small buckets).
"""

import os
import sys

import keras
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _common import write_result

import kmp

VOCAB, SEQ, DIM = 64, 8, 16
world = kmp.distributed.init()
assert world.size == 2, world


def flat(variables) -> np.ndarray:
    return np.concatenate(
        [np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(v, "float32")), "float64").ravel()
         for v in variables]
    )  # fmt: skip


def train(mode: str, **settings) -> dict:
    kmp.enable("bfloat16")
    keras.utils.set_random_seed(1)  # the same model everywhere (JAX requires it)
    model = keras.Sequential(
        [
            keras.Input((SEQ,), dtype="int32"),
            keras.layers.Embedding(VOCAB, DIM),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(VOCAB),
        ]
    )
    model = kmp.float32_outputs(model)
    opt = kmp.wrap_optimizer(keras.optimizers.Adam(3e-3), master_weights=mode, **settings)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(100 + world.rank)  # different data on each rank
    seq = (rng.integers(0, VOCAB, size=(64, 1)) + np.arange(SEQ + 1)) % VOCAB
    start = flat(model.trainable_weights)
    model.fit(seq[:, :-1], seq[:, 1:], batch_size=8, epochs=2, verbose=0, shuffle=False)
    state = flat([*model.weights, *opt.variables])
    gathered = np.asarray(kmp.distributed.allgather(state[None]))
    weights = flat(model.trainable_weights)
    return {
        "max_diff": float(np.abs(gathered - gathered[0]).max()),
        "moved": float(np.abs(weights - start).max()),
        "dtype": model.trainable_weights[0].dtype,
        "weights": [round(float(weights.sum()), 6), *[float(w) for w in weights[:4]]],
    }


runs = {m: train(m) for m in ("kahan", "stochastic", "none")}
runs["stochastic-again"] = train("stochastic")
# With a dynamic loss scale (the finite check and the skip path); on Horovod also with 2
# accumulated micro-batches, bfloat16 compression and small buckets (JAX has no accumulation).
extra = {"loss_scale": "force_dynamic"}
if world.engine == "horovod":
    extra.update(backward_passes_per_step=2, compression="bf16", bucket_bytes=1024)
runs["kahan-scaled"] = train("kahan", **extra)
write_result(world.rank, {"engine": world.engine, "runs": runs})
