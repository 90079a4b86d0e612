"""Worker: sparse gradients (tf.IndexedSlices) on 2 Horovod ranks (distributed/test_sparse.py).

Usage: ``worker_sparse.py SECTION [SECTION ...]``. Each rank trains on its own data and
writes what it measured under the section's key of this rank's JSON result.

Sections:
  train     a tiny GPT (token and position Embedding, causal MultiHeadAttention,
            LayerNormalization, Dense head) fitted under float32 (no compression)
            and mixed_bfloat16 (bf16 compression) for both sparse_gradients
            strategies: the ranks must end bit-identical. (Accumulation with
            sparse gradients: tests/distributed/test_sparse.py, in one process.)
  overflow  a custom loop under mixed_float16 (fp16 compression) that puts an inf
            into the token embedding's gradient on rank 1 at step 2 only, for both
            strategies.
  v1        a TF1 graph with tf.gather on a variable under
            kmp.compat.v1.distributed_optimizer, for both strategies.
"""

from __future__ import annotations

import sys

import numpy as np
from _common import rank_spread, write_result

import kmp.distributed as dist

WORLD = dist.init()
RANK = WORLD.rank

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from keras import ops  # noqa: E402

from kmp.optimizer import wrap_optimizer  # noqa: E402

VOCAB, SEQ, DIM, BATCH = 64, 16, 32, 8
STRATEGIES = ("dense", "gather")
COMPRESSION = {"float32": None, "mixed_bfloat16": "bf16"}  # mixed_float16: see overflow


class TokenAndPosition(keras.layers.Layer):
    """Token embedding plus learned position embedding: two sparse gradients."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.tokens = keras.layers.Embedding(VOCAB, DIM, name="tokens")
        self.positions = keras.layers.Embedding(SEQ, DIM, name="positions")

    def call(self, x):
        return self.tokens(x) + self.positions(ops.arange(SEQ))


def tiny_gpt(policy: str, seed: int) -> keras.Model:
    keras.config.set_dtype_policy(policy)
    keras.utils.set_random_seed(seed)
    x = inp = keras.Input((SEQ,), dtype="int32")
    x = TokenAndPosition()(x)
    h = keras.layers.LayerNormalization()(x)
    h = keras.layers.MultiHeadAttention(num_heads=2, key_dim=DIM // 2)(h, h, use_causal_mask=True)
    logits = keras.layers.Dense(VOCAB)(keras.layers.LayerNormalization()(x + h))
    out = keras.layers.Activation("linear", dtype="float32")(logits)
    return keras.Model(inp, out)


def make_data(seed: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Next-token pairs from a noisy counting sequence: learnable, different per seed."""
    rng = np.random.default_rng(seed)
    start = rng.integers(0, VOCAB, size=(n, 1))
    seq = (start + np.arange(SEQ + 1)[None]) % VOCAB
    noise = rng.random(seq.shape) < 0.1
    seq = np.where(noise, rng.integers(0, VOCAB, size=seq.shape), seq).astype("int32")
    return seq[:, :-1], seq[:, 1:]


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def max_diff(a: list, b: list) -> float:
    return max(
        float(np.max(np.abs(np.asarray(x, "float64") - np.asarray(y))))
        for x, y in zip(a, b, strict=True)
    )


def same_start(policy: str) -> keras.Model:
    model = tiny_gpt(policy, seed=10 + RANK)  # a different init on every rank ...
    dist.broadcast_variables(model.variables, root=0)  # ... until rank 0's is broadcast
    return model


def token_embedding_index(model: keras.Model) -> int:
    return next(i for i, v in enumerate(model.trainable_variables) if "tokens" in v.path)


def sparse_kinds(model: keras.Model, x: np.ndarray, y: np.ndarray) -> list[str]:
    with tf.GradientTape() as tape:
        loss = LOSS(y, model(x, training=True))
    return sorted(
        type(g).__name__ for g in tape.gradient(loss, model.trainable_variables)
    )  # fmt: skip


def poisoned_step(model: keras.Model, opt, emb: int, seen: list):
    """A train step that adds ``poison`` to the token embedding's (sparse) gradient."""

    @tf.function
    def step(xb, yb, poison):
        with tf.GradientTape() as tape:
            scaled = opt.scale_loss(LOSS(yb, model(xb, training=True)))
        grads = tape.gradient(scaled, model.trainable_variables)
        g = grads[emb]
        seen.append(type(g).__name__)
        grads[emb] = tf.IndexedSlices(g.values + poison, g.indices, g.dense_shape)
        opt.apply(grads, model.trainable_variables)

    return step


# ------------------------------------------------------------------ sections


def train() -> dict:
    x, y = make_data(100 + RANK, 4 * BATCH)  # different data on every rank
    out: dict = {}
    for strategy, policy in [(s, p) for s in STRATEGIES for p in COMPRESSION]:
        model = same_start(policy)
        start = model.get_weights()
        kinds = sparse_kinds(model, x[:2], y[:2])
        opt = wrap_optimizer(
            keras.optimizers.Adam(1e-2),
            sparse_gradients=strategy,
            compression=COMPRESSION[policy],
        )
        model.compile(optimizer=opt, loss=LOSS, jit_compile=False)
        hist = model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
        out[f"{strategy}/{policy}"] = {
            "kinds": kinds,
            "spread": rank_spread(model.get_weights()),
            "moved": max_diff(model.get_weights(), start),
            "iterations": int(opt.iterations),
            "skipped": opt.skipped_steps,
            "loss": float(hist.history["loss"][-1]),
            "bytes_per_step": opt.allreduce_bytes_per_step,
            "params": int(model.count_params()),
            "compute_dtype": model.layers[1].compute_dtype,
        }
        keras.backend.clear_session()
    return out


def overflow() -> dict:
    x, y = make_data(200 + RANK, 4 * BATCH)
    bad = 2
    out: dict = {}
    for strategy in STRATEGIES:
        model = same_start("mixed_float16")
        opt = wrap_optimizer(
            keras.optimizers.Adam(1e-2), sparse_gradients=strategy, compression="fp16"
        )
        seen: list[str] = []
        step = poisoned_step(model, opt, token_embedding_index(model), seen)
        rows = []
        for i in range(4):
            poison = np.inf if (RANK == 1 and i == bad) else 0.0
            sl = slice(i * BATCH, (i + 1) * BATCH)
            step(x[sl], y[sl], tf.constant(poison, tf.float32))
            rows.append(
                {
                    "weights": model.get_weights(),
                    "scale": opt.loss_scale,
                    "skipped": opt.skipped_steps,
                    "iterations": int(opt.iterations),
                }
            )
        out[strategy] = {
            "embedding_gradient": seen[0],
            "unchanged_by_bad_step": max_diff(rows[bad]["weights"], rows[bad - 1]["weights"]),
            "changed_by_good_steps": [
                max_diff(rows[i]["weights"], rows[i - 1]["weights"]) for i in (1, bad + 1)
            ],
            "scales": [r["scale"] for r in rows],
            "skipped": [r["skipped"] for r in rows],
            "iterations": [r["iterations"] for r in rows],
            "spread": rank_spread(model.get_weights()),
            "bytes_per_step": opt.allreduce_bytes_per_step,
            "finite": bool(all(np.isfinite(w).all() for w in model.get_weights())),
            "compute_dtype": model.layers[1].compute_dtype,
        }
        keras.backend.clear_session()
    return out


def v1() -> dict:
    from kmp.compat import v1 as kv1

    out: dict = {}
    rng = np.random.default_rng(300 + RANK)
    ids_np = rng.integers(0, VOCAB, size=(4, 8, SEQ)).astype("int32")
    for strategy in STRATEGIES:
        c = tf.compat.v1
        g = tf.Graph()
        with g.as_default():
            ids = c.placeholder(tf.int32, [None, SEQ])
            poison = c.placeholder(tf.float32, [])
            init = c.random_normal_initializer(stddev=0.5, seed=11 + RANK)  # differs per rank
            emb = c.get_variable("emb", [VOCAB, 8], initializer=init)
            w = c.get_variable("w", [8, 1], initializer=init)
            h = tf.reduce_mean(tf.gather(emb, ids), axis=1) + poison
            loss = tf.reduce_mean(tf.square(tf.matmul(h, w) - 1.0))
            opt = kv1.distributed_optimizer(
                c.train.AdamOptimizer(0.05), loss_scale="force_dynamic", sparse_gradients=strategy
            )
            pairs = opt.compute_gradients(loss)
            kinds = [type(gr).__name__ for gr, _ in pairs]
            train_op = opt.apply_gradients(pairs)
            bcast = kv1.broadcast_global_variables(root=0)
            init_op = c.global_variables_initializer()
        with kv1.session(graph=g) as sess:
            sess.run(init_op)
            sess.run(bcast)
            start = sess.run([emb, w])
            for i in range(4):
                bad = np.inf if (RANK == 1 and i == 2) else 0.0
                sess.run(train_op, {ids: ids_np[i], poison: bad})
            end = sess.run([emb, w])
            out[strategy] = {
                "kinds": kinds,
                "weights": [e.ravel().tolist() for e in end],
                "moved": max_diff(end, start),
                "skipped": int(sess.run(opt.skipped_steps)),
                "scale": float(sess.run(opt.loss_scale)),
            }
    return out


SECTIONS = {f.__name__: f for f in (train, overflow, v1)}


def main(names: list[str]) -> None:
    write_result(RANK, {name: SECTIONS[name]() for name in names})


if __name__ == "__main__":
    main(sys.argv[1:])
