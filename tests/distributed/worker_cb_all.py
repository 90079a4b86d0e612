"""Worker for tests/callbacks/test_defaults.py, run on 2 ranks under horovodrun.

Each rank builds its model and optimizer state from a different seed, then
trains on different data with kmp's callbacks, and reports:
- the max weight / optimizer-state difference between ranks before and right
  after BroadcastInitialState (allgathered with Horovod directly);
- the per-rank epoch logs before and after MetricAverage (with the loss scale
  added by LossScaleMonitor) and the warm-up learning rates;
- which checkpoint / CSV files this rank wrote.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import keras
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_result

import kmp
from kmp import callbacks as kcb


def max_rank_diff(hvd, tf, arrays) -> float:
    """Max |rank0 - rank1| over the flattened arrays (0.0 means bit-identical)."""
    flat = np.concatenate([np.asarray(a, dtype=np.float64).ravel() for a in arrays])
    gathered = hvd.allgather(tf.constant(flat[None, :])).numpy()
    return float(np.max(np.abs(gathered - gathered[0])))


class Snapshot(keras.callbacks.Callback):
    """Placed after BroadcastInitialState: measures the rank difference right after it."""

    def __init__(self, hvd, tf):
        super().__init__()
        self.hvd, self.tf = hvd, tf
        self.result = {}

    def on_train_begin(self, logs=None):
        m, opt = self.model, self.model.optimizer
        self.result["diff_after"] = max_rank_diff(self.hvd, self.tf, m.get_weights())
        self.result["opt_diff_after"] = max_rank_diff(
            self.hvd, self.tf, [v.numpy() for v in opt.variables]
        )
        self.result["n_opt_vars"] = len(opt.variables)


class Logs(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epochs = []
        self.lrs = []

    def on_train_batch_begin(self, batch, logs=None):
        self.lrs.append(float(np.asarray(self.model.optimizer.learning_rate)))

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append({k: float(v) for k, v in logs.items()})


def main() -> None:
    world = kmp.distributed.init()
    import horovod.tensorflow as hvd
    import tensorflow as tf

    assert world.size == 2, world
    rank = world.rank
    out = Path(os.environ["KMP_TEST_OUT"])

    keras.utils.set_random_seed(100 + rank)  # different initial weights on each rank
    model = keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)]
    )
    # Loss-scale state differs between ranks too, until the broadcast.
    opt = kmp.wrap_optimizer(
        keras.optimizers.Adam(0.01),
        # Taken as it is (float32 alone would mean no scaling); overflows only move it.
        loss_scale=kmp.LossScale(
            "dynamic", initial_scale=2.0 ** (10 + 2 * rank), underflow_threshold=None
        ),
        scale_lr=False,
    )
    model.compile(optimizer=opt, loss="mse", metrics=["mae"])
    # Give each rank different optimizer state (moments, iteration count).
    opt.build(model.trainable_variables)
    for _ in range(rank + 1):  # the inner optimizer: kmp's would average over the ranks
        opt.inner_optimizer.apply([tf.random.normal(v.shape) for v in model.trainable_variables])

    result = {
        "diff_before": max_rank_diff(hvd, tf, model.get_weights()),
        "opt_diff_before": max_rank_diff(hvd, tf, [v.numpy() for v in opt.variables]),
    }

    rng = np.random.default_rng(rank)  # different data on each rank
    x = rng.normal(size=(64, 5)).astype("float32")
    y = (x.sum(axis=1, keepdims=True) * (1 + rank)).astype("float32")
    xv, yv = x[:16] + 1.0, y[:16]

    snapshot, raw, avg = Snapshot(hvd, tf), Logs(), Logs()
    ckpt_dir = out / f"ckpt_rank{rank}"
    csv = out / f"log_rank{rank}.csv"
    callbacks = [
        kcb.BroadcastInitialState(),
        snapshot,
        raw,
        kcb.MetricAverage(),
        kcb.LossScaleMonitor(),
        kcb.LearningRateWarmup(1),  # from 0.01 / 2 ranks to 0.01 over the first epoch
        avg,
        kcb.AtomicCheckpoint(ckpt_dir, keep=2),
        kcb.chief_only(keras.callbacks.CSVLogger(str(csv))),
    ]
    hist = model.fit(
        x,
        y,
        batch_size=16,
        epochs=3,
        validation_data=(xv, yv),
        callbacks=callbacks,
        verbose=kcb.verbosity(0),
    )

    result.update(snapshot.result)
    result["raw"] = raw.epochs
    result["avg"] = avg.epochs
    result["lrs"] = avg.lrs
    result["history_loss"] = [float(v) for v in hist.history["loss"]]
    result["ckpt_files"] = sorted(os.listdir(ckpt_dir)) if ckpt_dir.exists() else []
    result["csv_exists"] = csv.exists()
    if csv.exists():
        header, *rows = csv.read_text().splitlines()
        result["csv_last_loss"] = float(rows[-1].split(",")[header.split(",").index("loss")])
    result["verbosity"] = kcb.verbosity()

    # A plain Keras optimizer would not average over the ranks: refused at the start.
    plain = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
    plain.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    try:
        plain.fit(x, y, epochs=1, verbose=0, callbacks=[kcb.BroadcastInitialState()])
    except TypeError as exc:
        result["plain_refused"] = str(exc)
    # A step compiled with XLA cannot hold Horovod's allreduce: compiled again without it.
    keras.utils.set_random_seed(7 + rank)
    jit = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
    jit.compile(
        optimizer=kmp.wrap_optimizer(keras.optimizers.SGD(0.01)), loss="mse", jit_compile=True
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jit.fit(x, y, epochs=1, verbose=0, callbacks=[kcb.BroadcastInitialState()])
    result["jit_warned"] = any("no XLA kernels" in str(w.message) for w in caught)
    result["jit_after"] = bool(jit.jit_compile)
    result["jit_diff"] = max_rank_diff(hvd, tf, jit.get_weights())
    write_result(rank, result)


if __name__ == "__main__":
    main()
