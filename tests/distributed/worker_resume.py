"""Worker: preempt a run in epoch 2, resume from its checkpoint, compare with a straight run.

Started by tests/test_resume.py (and bench/resume.py for the whole matrix) on real ranks,
on either engine. Arguments: a checkpoint folder, then cases ``model:policy[:master_weights]``.
For each case every rank:

(``--killed SPEC`` and ``--resume SPEC`` are the two jobs of the kill test: the first
saves the uninterrupted run's weights, then is SIGKILLed on rank 1 in the middle of epoch
2; the second resumes from the last checkpoint and compares.)

1. seeds itself (``1000 + rank``: its own initial weights and dropout masks), builds the
   model, and trains 2 epochs on data of its own, with ``BroadcastInitialState``: the
   uninterrupted run;
2. builds the same model from the same seed and trains with
   ``kmp.callbacks.AtomicCheckpoint``; rank 1 alone gets SIGTERM as epoch 2's first batch
   starts (``KMP_RESUME_SIGNAL_AT``, default ``1:0``), so the ranks must agree to stop
   after it: one checkpoint at epoch 1, step 1, and ``Preempted`` on every rank (the
   stopped run), which it then forgets;
3. reseeds to something else, loads the newest checkpoint with ``kmp.load_model`` and
   trains to the end of epoch 2 (``initial_epoch=1``; the batch done is skipped): the
   resumed run.

It writes, per case: the optimizer's class and step count right after the load, the
largest difference between the resumed and the uninterrupted weights (this rank; every
weight, BatchNormalization's per-rank moving statistics included), and between the
ranks' resumed trainable weights (through a real allgather).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import numpy as np
from _common import write_result

import kmp.distributed as dist

WORLD = dist.init()
RANK = WORLD.rank

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for _zoo

import keras  # noqa: E402
from _zoo import gpt2_causal_lm, lm_batch  # noqa: E402

import kmp  # noqa: E402

STEPS, BATCH = 3, 4
# Where rank 1 is signalled: epoch and batch, 0-based (bench/resume.py varies it).
STOP_AT = tuple(int(n) for n in os.environ.get("KMP_RESUME_SIGNAL_AT", "1:0").split(":"))


@keras.saving.register_keras_serializable(package="kmp_tests")
class OwnCompile(keras.Model):
    """A subclassed model whose class overrides ``compile`` (as KerasHub tasks do)."""

    def __init__(self, units: int = 16, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.hidden = keras.layers.Dense(units, activation="relu")
        self.drop = keras.layers.Dropout(0.2)
        self.head = keras.layers.Dense(3)

    def call(self, x, training=False):
        return self.head(self.drop(self.hidden(x), training=training))

    def compile(self, optimizer="adam", loss=None, **kwargs):
        loss = loss or keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        super().compile(optimizer=optimizer, loss=loss, **kwargs)

    def get_config(self):
        return {**super().get_config(), "units": self.units}


def sequential() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dropout(0.2),
            keras.layers.Dense(3),
        ]
    )


def batchnorm() -> keras.Model:
    """Dropout and BatchNormalization: its moving statistics differ between Horovod ranks."""
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16),
            keras.layers.BatchNormalization(),
            keras.layers.Activation("relu"),
            keras.layers.Dropout(0.2),
            keras.layers.Dense(3),
        ]
    )


def own_compile() -> keras.Model:
    model = OwnCompile()
    model(np.zeros((1, 8), "float32"))  # builds its layers, as a first batch would
    return model


def mobilenet() -> keras.Model:
    return keras.applications.MobileNetV3Small(
        weights=None, input_shape=(32, 32, 3), classes=3, include_preprocessing=False
    )


def table_batch(rng: np.random.Generator, n: int):
    return rng.normal(size=(n, 8)).astype("float32"), rng.integers(0, 3, n)


def image_batch(rng: np.random.Generator, n: int):
    return rng.normal(size=(n, 32, 32, 3)).astype("float32"), rng.integers(0, 3, n)


MODELS = {
    "sequential": (sequential, table_batch),
    "batchnorm": (batchnorm, table_batch),
    "own_compile": (own_compile, table_batch),
    "gpt2": (gpt2_causal_lm, lm_batch),
    "mobilenet": (mobilenet, image_batch),
}


def build(name: str, policy: str, master: str | None) -> keras.Model:
    kmp.enable(policy)
    keras.utils.set_random_seed(1000 + RANK)
    builder, _ = MODELS[name]
    model = builder()
    if name in ("gpt2", "mobilenet"):
        model = kmp.float32_outputs(model)
    kwargs = {} if master is None else {"master_weights": master}
    model.compile(
        optimizer=kmp.wrap_optimizer(keras.optimizers.AdamW(1e-3), **kwargs),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=name != "mobilenet"),
    )
    return model


def fit(model: keras.Model, data, epochs: int, initial: int = 0, callbacks=()) -> None:
    x, y = data
    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=epochs,
        initial_epoch=initial,
        shuffle=False,  # the same order in every epoch: the run depends on nothing else
        verbose=0,
        callbacks=[kmp.callbacks.BroadcastInitialState(), *callbacks],
    )


def flat(model: keras.Model, trainable: bool = False) -> np.ndarray:
    weights = model.trainable_weights if trainable else model.weights
    values = [keras.ops.convert_to_numpy(w.value) for w in weights]
    return np.concatenate([np.ravel(np.asarray(v, "float64")) for v in values])


def spread(values: np.ndarray) -> float:
    every = np.asarray(keras.ops.convert_to_numpy(dist.allgather(values[None])))
    return float(np.max(np.abs(every - every[0])))


def case(spec: str, folder: Path) -> dict:
    name, policy, *rest = spec.split(":")
    master = rest[0] if rest else None
    _, batch = MODELS[name]
    data = batch(np.random.default_rng(RANK), BATCH * STEPS)  # each rank its own
    straight = build(name, policy, master)
    fit(straight, data, 2)
    expected = flat(straight)
    del straight

    stopped = build(name, policy, master)
    ckpt = folder / spec.replace(":", "-")
    # Step 2 (inside epoch 1) is written at once and makes the copy that epoch 1's end is
    # written from, in the background; the signal's checkpoint waits for that write.
    # agree_every_seconds=0: the ranks meet after every step, so the stop step is exact.
    kwargs = {"save_every_steps": 2, "async_write": True, "agree_every_seconds": 0}
    callbacks = [kmp.callbacks.AtomicCheckpoint(ckpt, **kwargs)]
    if RANK == 1:  # one rank alone is signalled: the ranks must agree to stop
        callbacks.insert(0, SignalAt(*STOP_AT))
    try:
        fit(stopped, data, 2, callbacks=callbacks)
        preempted = None
    except kmp.callbacks.Preempted as stop:
        preempted = [stop.epoch, stop.step, stop.code, stop.signal]
    del stopped
    dist.barrier()  # the chief's file is complete before anyone reads it

    kmp.enable(policy)
    keras.utils.set_random_seed(77)  # whatever the process does, the file decides
    found = kmp.callbacks.latest_checkpoint(ckpt)
    resumed = kmp.load_model(found.path)
    loaded_class = type(resumed.optimizer).__name__
    loaded_iterations = int(keras.ops.convert_to_numpy(resumed.optimizer.iterations))
    again = kmp.callbacks.AtomicCheckpoint(folder / "again" / spec.replace(":", "-"))
    fit(resumed, data, 2, initial=found.epoch, callbacks=[again])
    got = flat(resumed)
    # And from the epoch end's checkpoint, written in the background.
    from_async = kmp.load_model(ckpt / "ckpt-0001.keras")
    fit(from_async, data, 2, initial=1, callbacks=[kmp.callbacks.AtomicCheckpoint(again.filepath)])
    result = {
        "from_async_vs_straight": float(np.max(np.abs(flat(from_async) - expected))),
        "epoch": found.epoch,
        "step": found.step,
        "skipped_batches": again.skipped_steps,
        "files": sorted(p.name for p in ckpt.iterdir()),
        "preempted": preempted,
        "optimizer": loaded_class,
        "iterations": loaded_iterations,
        "resumed_vs_straight": float(np.max(np.abs(got - expected))),
        "ranks": spread(flat(resumed, trainable=True)),  # moving statistics stay per rank
        "skipped": int(resumed.optimizer.skipped_steps),
    }
    return result  # no clear_session: on the JAX engine it would drop kmp's distribution


class SignalAt(keras.callbacks.Callback):
    """Send this process SIGTERM as batch ``batch`` of epoch ``epoch`` starts (a preemption)."""

    def __init__(self, epoch: int, batch: int):
        super().__init__()
        self.epoch, self.batch, self.now = epoch, batch, -1

    def on_epoch_begin(self, epoch, logs=None):
        self.now = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if (self.now, batch) == (self.epoch, self.batch):
            os.kill(os.getpid(), signal.SIGTERM)


class KillMidEpoch(keras.callbacks.Callback):
    """SIGKILL this process in the middle of epoch ``epoch`` (0-based), after ``batch`` batches."""

    def __init__(self, epoch: int, batch: int):
        super().__init__()
        self.epoch, self.batch, self.now = epoch, batch, -1

    def on_epoch_begin(self, epoch, logs=None):
        self.now = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.now == self.epoch and batch + 1 == self.batch:
            os.kill(os.getpid(), signal.SIGKILL)


def killed(spec: str, folder: Path) -> None:
    """Job 1 of the kill test: the straight run's weights, then a run killed in epoch 2."""
    name, policy, *rest = spec.split(":")
    master = rest[0] if rest else None
    data = MODELS[name][1](np.random.default_rng(RANK), BATCH * STEPS)
    straight = build(name, policy, master)
    fit(straight, data, 2)
    np.save(folder / f"straight-{RANK}.npy", flat(straight))
    dist.barrier()
    run = build(name, policy, master)
    callbacks = [kmp.callbacks.AtomicCheckpoint(folder / "ckpt")]
    if RANK == 1:
        callbacks.append(KillMidEpoch(epoch=1, batch=2))
    fit(run, data, 2, callbacks=callbacks)
    raise SystemExit("rank 1 was to be killed in epoch 2")


def resume(spec: str, folder: Path) -> dict:
    """Job 2 of the kill test: resume from the last checkpoint, finish, compare."""
    name, policy, *_ = spec.split(":")
    data = MODELS[name][1](np.random.default_rng(RANK), BATCH * STEPS)
    kmp.enable(policy)
    found = kmp.callbacks.latest_checkpoint(folder / "ckpt")
    model = kmp.load_model(found.path)
    fit(model, data, 2, initial=found.epoch)
    got = flat(model)
    expected = np.load(folder / f"straight-{RANK}.npy")
    return {
        "epoch": found.epoch,
        "resumed_vs_straight": float(np.max(np.abs(got - expected))),
        "ranks": spread(flat(model, trainable=True)),
    }


def main(folder: str, specs: list[str]) -> None:
    if specs[0] == "--killed":
        killed(specs[1], Path(folder))
    if specs[0] == "--resume":
        out = {specs[1]: resume(specs[1], Path(folder))}
    else:
        out = {spec: case(spec, Path(folder)) for spec in specs}
    write_result(RANK, {"engine": WORLD.engine, "size": WORLD.size, "cases": out})


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    main(sys.argv[1], sys.argv[2:])
