"""Worker: kmp.wrap_optimizer under real Horovod ranks (started by tests/test_optimizer.py).

Usage: ``worker_opt_train.py SECTION [SECTION ...]``; each section trains tiny
models with ``model.fit`` (or a custom loop) on data that differs per rank and
writes what it measured under its own key of this rank's JSON result.

Sections:
  identical   float32 / mixed_float16 / mixed_bfloat16: ranks end bit-identical
              (and, as a control, plain Keras Adam lets them drift apart).
  concat      two ranks == one process trained on the concatenated batch.
  loop        a custom tf.GradientTape loop == model.fit.
  compression fp16 / bf16 compression: half the bytes (Horovod timeline), same loss.
  overflow    an inf on rank 1 only: both ranks skip that step, halve the scale.
  accumulate  backward_passes_per_step=2 == one step on the doubled batch; a bad
              micro-batch on rank 1 skips that window only.
  resume      save / load_model / resume == training straight through.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
from _common import rank_spread, write_result

import kmp.distributed as dist

WORLD = dist.init()
RANK = WORLD.rank

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from kmp.optimizer import wrap_optimizer  # noqa: E402

FEATURES, CLASSES = 8, 4
W_TRUE = np.random.default_rng(7).normal(size=(FEATURES, CLASSES))


def make_data(seed: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype("float32")
    y = np.argmax(x @ W_TRUE + 0.3 * rng.normal(size=(n, CLASSES)), axis=1).astype("int32")
    return x, y


def build_model(policy: str, seed: int) -> keras.Model:
    keras.config.set_dtype_policy(policy)
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(CLASSES),
            keras.layers.Activation("softmax", dtype="float32"),
        ]
    )


def same_start(model: keras.Model) -> None:
    """Every rank starts from rank 0's weights."""
    dist.broadcast_variables(model.variables, root=0)


def compile_fit(model, opt, x, y, *, epochs, batch, callbacks=None, **kw):
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", jit_compile=False)
    hist = model.fit(x, y, batch_size=batch, epochs=epochs, verbose=0, callbacks=callbacks, **kw)
    return hist.history["loss"][-1]


def flat(weights: list) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(w, "float64")) for w in weights])


def max_diff(a: list, b: list) -> float:
    return float(np.max(np.abs(flat(a) - flat(b))))


# ------------------------------------------------------------------ sections


def identical() -> dict:
    out = {}
    x, y = make_data(100 + RANK, 96)  # different data on every rank
    for policy in ("float32", "mixed_float16", "mixed_bfloat16"):
        model = build_model(policy, seed=10 + RANK)  # different init on every rank ...
        before = rank_spread(model.get_weights())
        same_start(model)  # ... until rank 0's weights are broadcast
        start = model.get_weights()
        opt = wrap_optimizer(keras.optimizers.Adam(1e-2))
        compile_fit(model, opt, x, y, epochs=3, batch=16, shuffle=True)
        out[policy] = {
            "spread_before_broadcast": before,
            "spread": rank_spread(model.get_weights()),
            "moved": max_diff(model.get_weights(), start),
            "mode": opt.loss_scale_mode,
            "loss_scale": opt.loss_scale,
            "iterations": int(opt.iterations),
            "compute_dtype": model.layers[0].compute_dtype,
            "bytes_per_step": opt.allreduce_bytes_per_step,
        }
    # Control: plain Keras Adam under horovodrun does not average; the ranks drift.
    model = build_model("float32", seed=10)
    same_start(model)
    compile_fit(model, keras.optimizers.Adam(1e-2), x, y, epochs=1, batch=16)
    out["plain_keras_spread"] = rank_spread(model.get_weights())
    return out


def concat() -> dict:
    # Rank r trains on shard r; the reference trains one process on both shards, batch by batch.
    shards = [make_data(200 + r, 64) for r in range(2)]
    batch = 16
    model = build_model("float32", seed=3)
    same_start(model)
    start = model.get_weights()
    x, y = shards[RANK]
    compile_fit(
        model,
        wrap_optimizer(keras.optimizers.Adam(1e-2)),
        x,
        y,
        epochs=2,
        batch=batch,
        shuffle=False,
    )
    xs = np.concatenate(
        [np.concatenate([s[0][i : i + batch] for s in shards]) for i in range(0, 64, batch)]
    )
    ys = np.concatenate(
        [np.concatenate([s[1][i : i + batch] for s in shards]) for i in range(0, 64, batch)]
    )
    ref = build_model("float32", seed=3)
    ref.set_weights(start)
    compile_fit(ref, keras.optimizers.Adam(1e-2), xs, ys, epochs=2, batch=2 * batch, shuffle=False)
    # The same single process on its own shard only, to show the comparison can fail.
    alone = build_model("float32", seed=3)
    alone.set_weights(start)
    compile_fit(alone, keras.optimizers.Adam(1e-2), x, y, epochs=2, batch=batch, shuffle=False)
    return {
        "vs_reference": max_diff(model.get_weights(), ref.get_weights()),
        "own_shard_vs_reference": max_diff(alone.get_weights(), ref.get_weights()),
        "moved": max_diff(model.get_weights(), start),
    }


def loop() -> dict:
    x, y = make_data(300 + RANK, 64)
    model = build_model("mixed_float16", seed=4)
    same_start(model)
    start = model.get_weights()
    opt_fit = wrap_optimizer(keras.optimizers.Adam(1e-2), growth_interval=3)
    compile_fit(model, opt_fit, x, y, epochs=2, batch=16, shuffle=False)

    model2 = build_model("mixed_float16", seed=4)
    model2.set_weights(start)
    opt = wrap_optimizer(keras.optimizers.Adam(1e-2), growth_interval=3)
    loss_fn = keras.losses.SparseCategoricalCrossentropy()

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model2(xb, training=True))
            scaled = opt.scale_loss(loss)
        grads = tape.gradient(scaled, model2.trainable_variables)
        opt.apply(grads, model2.trainable_variables)
        return loss

    for _ in range(2):
        for i in range(0, 64, 16):
            step(x[i : i + 16], y[i : i + 16])
    return {
        "loop_vs_fit": max_diff(model.get_weights(), model2.get_weights()),
        "spread": rank_spread(model2.get_weights()),
        "scales": [opt_fit.loss_scale, opt.loss_scale],
        "iterations": [int(opt_fit.iterations), int(opt.iterations)],
        "moved": max_diff(model2.get_weights(), start),
    }


def _timeline_bytes(path: str) -> dict:
    """Bytes per dtype that this rank contributed to the collectives in Horovod's timeline.

    Allreduce outputs have the size of what each rank sends; allgather outputs hold
    every rank's part, so they are divided by the number of ranks.
    """
    sizes = {"float16": 2, "float32": 4, "int16": 2, "int32": 4, "int64": 8}
    with open(path) as fh:
        text = fh.read()
    decoder = json.JSONDecoder()
    events, pos = [], text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \n\r\t,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            break
        event, pos = decoder.raw_decode(text, pos)
        events.append(event)
    names = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name" and "name" in e.get("args", {})
    }
    found: dict[str, float] = {}
    for e in events:
        args = e.get("args", {})
        if e.get("ph") != "E" or "dtype" not in args:
            continue
        dims = [int(d) for d in args["shape"].strip("[]").split(",") if d.strip()]
        nbytes = int(np.prod(dims)) * sizes[args["dtype"]]
        if "allgather" in names.get(e["pid"], "").lower():  # Horovod's names, or kmp_*_allgather
            nbytes /= WORLD.size
        found[args["dtype"]] = found.get(args["dtype"], 0) + nbytes
    return found


def compression() -> dict:
    import horovod.tensorflow as hvd

    x, y = make_data(400 + RANK, 64)
    out = {}
    tmp = os.environ["KMP_TEST_OUT"]
    for comp in (None, "fp16", "bf16"):
        model = build_model("float32", seed=5)
        same_start(model)
        opt = wrap_optimizer(keras.optimizers.Adam(1e-2), compression=comp)
        compile_fit(model, opt, x, y, epochs=3, batch=16, shuffle=False)
        # Two more steps with Horovod's timeline on: what really went over the wire.
        timeline = os.path.join(tmp, f"timeline_{comp}.json")
        hvd.start_timeline(timeline, mark_cycles=False)
        model.fit(x[:32], y[:32], batch_size=16, epochs=1, verbose=0, shuffle=False)
        hvd.stop_timeline()
        dist.barrier()
        loss = model.evaluate(x, y, verbose=0)
        out[str(comp)] = {
            "loss": float(dist.allreduce(tf.constant(loss), op="average").numpy()),
            "bytes_per_step": opt.allreduce_bytes_per_step,
            "timeline": _timeline_bytes(timeline) if RANK == 0 else None,
            "spread": rank_spread(model.get_weights()),
        }
    return out


class Recorder(keras.callbacks.Callback):
    """Weights, loss scale, skipped steps and iterations after every batch."""

    def __init__(self, opt):
        super().__init__()
        self.opt = opt
        self.rows = []

    def on_train_batch_end(self, batch, logs=None):
        self.rows.append(
            {
                "weights": self.model.get_weights(),
                "scale": self.opt.loss_scale,
                "skipped": self.opt.skipped_steps,
                "iterations": int(self.opt.iterations),
            }
        )


def overflow() -> dict:
    x, y = make_data(500 + RANK, 64)
    bad = 2  # the third step overflows float16 on rank 1 only
    if RANK == 1:
        x[bad * 16 : bad * 16 + 16] = 1e30
    model = build_model("mixed_float16", seed=6)
    same_start(model)
    opt = wrap_optimizer(keras.optimizers.Adam(1e-2))
    rec = Recorder(opt)
    compile_fit(model, opt, x, y, epochs=1, batch=16, shuffle=False, callbacks=[rec])
    r = rec.rows
    return {
        "unchanged_by_bad_step": max_diff(r[bad]["weights"], r[bad - 1]["weights"]),
        "changed_by_good_steps": [
            max_diff(r[i]["weights"], r[i - 1]["weights"]) for i in (1, bad + 1)
        ],
        "scales": [row["scale"] for row in r],
        "skipped": [row["skipped"] for row in r],
        "iterations": [row["iterations"] for row in r],
        "spread": rank_spread(model.get_weights()),
    }


def accumulate() -> dict:
    x, y = make_data(600 + RANK, 64)
    out = {}
    model = build_model("float32", seed=8)
    same_start(model)
    start = model.get_weights()
    compile_fit(
        model, wrap_optimizer(keras.optimizers.Adam(1e-2)), x, y, epochs=1, batch=16, shuffle=False
    )
    acc = build_model("float32", seed=8)
    acc.set_weights(start)
    opt = wrap_optimizer(keras.optimizers.Adam(1e-2), backward_passes_per_step=2)
    compile_fit(acc, opt, x, y, epochs=1, batch=8, shuffle=False)
    out["vs_double_batch"] = max_diff(acc.get_weights(), model.get_weights())
    out["iterations"] = int(opt.iterations)
    out["spread"] = rank_spread(acc.get_weights())
    # A non-finite micro-batch on rank 1 (micro-batch 3 = 2nd of window 1) skips window 1 only.
    xb = x.copy()
    if RANK == 1:
        xb[3 * 8 : 4 * 8] = np.inf
    acc2 = build_model("float32", seed=8)
    acc2.set_weights(start)
    opt2 = wrap_optimizer(keras.optimizers.Adam(1e-2), backward_passes_per_step=2)
    rec = Recorder(opt2)
    compile_fit(acc2, opt2, xb, y, epochs=1, batch=8, shuffle=False, callbacks=[rec])
    rows = rec.rows
    out["bad_window"] = {
        "skipped": opt2.skipped_steps,
        "iterations": int(opt2.iterations),
        "window1_unchanged": max_diff(rows[3]["weights"], rows[1]["weights"]),
        "later_windows_moved": max_diff(rows[7]["weights"], rows[3]["weights"]),
        "finite": bool(np.all(np.isfinite(flat(acc2.get_weights())))),
        "spread": rank_spread(acc2.get_weights()),
    }
    return out


def resume() -> dict:
    x, y = make_data(700 + RANK, 64)
    if RANK == 1:
        x[16:32] = 1e30  # one overflow in epoch 1, so the saved state has a skipped step

    def fresh():
        model = build_model("mixed_float16", seed=9)
        same_start(model)
        opt = wrap_optimizer(keras.optimizers.Adam(1e-2), initial_scale=2.0**10, growth_interval=3)
        model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", jit_compile=False)
        return model

    straight = fresh()
    straight.fit(x, y, batch_size=16, epochs=4, verbose=0, shuffle=False)

    first = fresh()
    first.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    path = os.path.join(os.environ["KMP_TEST_OUT"], "resume.keras")
    if dist.is_chief():
        first.save(path)
    dist.barrier()
    loaded = keras.saving.load_model(path)
    lo = loaded.optimizer
    state_after_load = [lo.loss_scale, lo.skipped_steps, int(lo.iterations)]
    state_saved = [
        first.optimizer.loss_scale,
        first.optimizer.skipped_steps,
        int(first.optimizer.iterations),
    ]
    loaded.fit(x, y, batch_size=16, epochs=4, initial_epoch=2, verbose=0, shuffle=False)
    so = straight.optimizer
    return {
        "type": type(lo).__name__,
        "state_saved": state_saved,
        "state_after_load": state_after_load,
        "straight": [so.loss_scale, so.skipped_steps, int(so.iterations)],
        "resumed": [lo.loss_scale, lo.skipped_steps, int(lo.iterations)],
        "weights_diff": max_diff(straight.get_weights(), loaded.get_weights()),
        "spread": rank_spread(loaded.get_weights()),
    }


def _grouped_ops(tensors: list, **kwargs) -> int:
    """How many Horovod grouped allreduce ops one traced call of grouped_allreduce makes."""
    graph = tf.function(lambda: dist.grouped_allreduce(tensors, **kwargs)).get_concrete_function()
    return sum(op.type == "HorovodGroupedAllreduce" for op in graph.graph.get_operations())


def buckets() -> dict:
    """bucket_bytes: ops per plan, same weights as one bucket, overflow and accumulation."""
    x, y = make_data(700 + RANK, 64)
    out: dict = {}
    # Gradient sizes of build_model: 1024, 128, 512, 16 bytes (float32).
    grads = [tf.ones(v.shape) * (RANK + 1) for v in build_model("float32", 0).trainable_variables]
    out["ops"] = {str(b): _grouped_ops(grads, bucket_bytes=b) for b in (None, 200, 1)}
    out["ops_fp16"] = _grouped_ops(grads, bucket_bytes=200, compression="fp16")
    reduced = dist.grouped_allreduce(grads, bucket_bytes=1)
    out["bucketed_mean"] = sorted({float(np.unique(r.numpy())[0]) for r in reduced})
    weights = {}
    start = None
    for b in (None, 200, 1):
        model = build_model("float32", seed=9)
        same_start(model)
        start = start or model.get_weights()
        model.set_weights(start)
        opt = wrap_optimizer(keras.optimizers.Adam(1e-2), bucket_bytes=b)
        compile_fit(model, opt, x, y, epochs=2, batch=16, shuffle=False)
        weights[str(b)] = model.get_weights()
        out[f"spread/{b}"] = rank_spread(model.get_weights())
    out["vs_one_bucket"] = max(max_diff(weights[k], weights["None"]) for k in ("200", "1"))
    # An overflow on rank 1 only, with every gradient in its own bucket.
    xo = x.copy()
    if RANK == 1:
        xo[32:48] = 1e30
    model = build_model("mixed_float16", seed=6)
    same_start(model)
    opt = wrap_optimizer(keras.optimizers.Adam(1e-2), bucket_bytes=1)
    rec = Recorder(opt)
    compile_fit(model, opt, xo, y, epochs=1, batch=16, shuffle=False, callbacks=[rec])
    out["overflow"] = {
        "skipped": [row["skipped"] for row in rec.rows],
        "scales": [row["scale"] for row in rec.rows],
        "spread": rank_spread(model.get_weights()),
    }
    # Accumulation and fp16 compression with buckets == without buckets.
    acc = {}
    for b in (None, 200):
        model = build_model("float32", seed=8)
        model.set_weights(start)
        opt = wrap_optimizer(
            keras.optimizers.Adam(1e-2), backward_passes_per_step=2, compression="fp16",
            bucket_bytes=b,
        )  # fmt: skip
        compile_fit(model, opt, x, y, epochs=1, batch=8, shuffle=False)
        acc[str(b)] = model.get_weights()
        out[f"accumulate_spread/{b}"] = rank_spread(model.get_weights())
        out[f"accumulate_iterations/{b}"] = int(opt.iterations)
    out["accumulate_vs_one_bucket"] = max_diff(acc["200"], acc["None"])
    # XLA for forward and backward (kmp.xla), the bucketed allreduce outside it.
    from kmp.xla import jit_gradients

    xla = {}
    for jit in (False, True):
        model = build_model("float32", seed=9)
        model.set_weights(start)
        model.compile(
            optimizer=wrap_optimizer(keras.optimizers.Adam(1e-2), bucket_bytes=200),
            loss="sparse_categorical_crossentropy",
            jit_compile=False,
        )
        if jit:
            jit_gradients(model)
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
        xla[jit] = model.get_weights()
        out[f"xla_spread/{jit}"] = rank_spread(model.get_weights())
    out["xla_vs_plain"] = max_diff(xla[True], xla[False])
    out["xla_moved"] = max_diff(xla[True], start)
    return out


SECTIONS = {
    f.__name__: f
    for f in (identical, concat, loop, compression, overflow, accumulate, resume, buckets)
}


def main(names: list[str]) -> None:
    result = {}
    for name in names:
        result[name] = SECTIONS[name]()
        keras.backend.clear_session()
    write_result(RANK, result)


if __name__ == "__main__":
    main(sys.argv[1:])
