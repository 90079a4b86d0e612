"""Worker: a training script a scheduler preempts through its launcher, run again to finish.

Started by tests/test_resume.py with ``kmp launch -np 2`` (and by bench/preempt.py): each
run resumes from the newest checkpoint in ``FOLDER/ckpt`` when there is one, trains a
model with Dropout and BatchNormalization to ``EPOCHS`` epochs with step checkpoints,
and lets ``kmp.callbacks.Preempted`` end the process (exit status 75) when the launcher
passes a signal on. Rank 0 writes its optimizer's step count to ``FOLDER/progress``
after every batch, so the test knows when to signal. A run that finishes also trains
the same model without any stop and writes, per rank, the largest difference between
the two (every weight and optimizer variable) and between the ranks.

    kmp launch -np 2 tests/distributed/worker_preempt.py FOLDER [SECONDS_PER_STEP]
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np
from _common import write_result

import kmp.distributed as dist

WORLD = dist.init()
RANK = WORLD.rank

import keras  # noqa: E402

import kmp  # noqa: E402

STEPS, BATCH, EPOCHS = 8, 4, 3


def build() -> keras.Model:
    keras.utils.set_random_seed(1000 + RANK)
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16),
            keras.layers.BatchNormalization(),
            keras.layers.Activation("relu"),
            keras.layers.Dropout(0.2),
            keras.layers.Dense(3),
        ]
    )
    model.compile(
        optimizer=kmp.wrap_optimizer(keras.optimizers.AdamW(1e-3)),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


class Pace(keras.callbacks.Callback):
    """Slow steps (so a test can signal inside an epoch) and rank 0's progress file."""

    def __init__(self, folder: Path, seconds: float):
        super().__init__()
        self.folder, self.seconds = folder, seconds

    def on_train_batch_end(self, batch, logs=None):
        time.sleep(self.seconds)
        if RANK == 0:
            step = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
            (self.folder / "progress.tmp").write_text(str(step))
            (self.folder / "progress.tmp").replace(self.folder / "progress")


def fit(model, data, initial_epoch=0, callbacks=()):
    x, y = data
    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=EPOCHS,
        initial_epoch=initial_epoch,
        shuffle=False,
        verbose=0,
        callbacks=[kmp.callbacks.BroadcastInitialState(), *callbacks],
    )


def state(model) -> np.ndarray:
    values = [*model.weights, *model.optimizer.variables]
    return np.concatenate(
        [np.ravel(np.asarray(keras.ops.convert_to_numpy(v), "float64")) for v in values]
    )


def main(folder: Path, seconds: float) -> None:
    kmp.enable("mixed_float16")
    rng = np.random.default_rng(RANK)
    data = rng.normal(size=(STEPS * BATCH, 8)).astype("float32"), rng.integers(0, 3, STEPS * BATCH)
    found = kmp.callbacks.latest_checkpoint(folder / "ckpt")
    model = kmp.load_model(found.path) if found.path else build()
    ckpt = kmp.callbacks.AtomicCheckpoint(  # the ranks meet after every step: an exact stop
        folder / "ckpt", save_every_steps=5, verbose=1, agree_every_seconds=0
    )
    fit(model, data, found.epoch, [Pace(folder, seconds), ckpt])  # Preempted ends it here
    got = state(model)
    straight = build()
    fit(straight, data)
    trained = np.concatenate(  # the moving statistics differ per rank under Horovod
        [np.ravel(keras.ops.convert_to_numpy(w)).astype("float64") for w in model.trainable_weights]
    )
    every = np.asarray(keras.ops.convert_to_numpy(dist.allgather(trained[None])))
    write_result(
        RANK,
        {
            "resumed_from": [found.epoch, found.step],
            "skipped": ckpt.skipped_steps,
            "iterations": int(keras.ops.convert_to_numpy(model.optimizer.iterations)),
            "resumed_vs_straight": float(np.max(np.abs(got - state(straight)))),
            "ranks": float(np.max(np.abs(every - every[0]))),
        },
    )


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    main(Path(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 0.3)
