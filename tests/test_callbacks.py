"""Tests of kmp.callbacks: single-process behaviour, then real 2-process runs under horovodrun."""

from __future__ import annotations

import os

import keras
import numpy as np
import pytest
from conftest import requires_horovod, run_workers

import kmp.distributed
from kmp import callbacks as kcb

STEPS = 4  # batches per epoch in the small fits below
BATCH = 8


def _data(n: int = STEPS * BATCH, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5]], dtype="float32")).astype("float32")
    return x, y


def _model(optimizer: keras.optimizers.Optimizer | None = None, seed: int = 1) -> keras.Model:
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    model.compile(optimizer=optimizer or keras.optimizers.SGD(0.01), loss="mse")
    return model


class _Recorder(keras.callbacks.Callback):
    """Records the learning rate at each batch start and copies of the logs."""

    def __init__(self):
        super().__init__()
        self.lrs: list[float] = []
        self.batch_logs: list[dict] = []
        self.epoch_logs: list[dict] = []

    def on_train_batch_begin(self, batch, logs=None):
        self.lrs.append(float(np.asarray(self.model.optimizer.learning_rate)))

    def on_train_batch_end(self, batch, logs=None):
        self.batch_logs.append(dict(logs or {}))

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_logs.append(dict(logs or {}))


@pytest.fixture
def not_chief(monkeypatch):
    """Pretend to be rank 1 of 2."""
    monkeypatch.setattr(kmp.distributed, "rank", lambda: 1)
    monkeypatch.setattr(kmp.distributed, "is_chief", lambda: False)


# --------------------------------------------------------------------------- verbosity


def test_verbosity_chief_and_other_rank(monkeypatch):
    assert kcb.verbosity() == "auto"
    assert kcb.verbosity(2) == 2
    monkeypatch.setattr(kmp.distributed, "is_chief", lambda: False)
    assert kcb.verbosity() == 0
    assert kcb.verbosity(1) == 0


@pytest.mark.parametrize("bad", [3, -1, "loud", True])
def test_verbosity_rejects_bad_values(bad):
    with pytest.raises(ValueError, match="verbose"):
        kcb.verbosity(bad)


# --------------------------------------------------------------------------- broadcast / average


def test_broadcast_single_process_builds_optimizer_and_changes_nothing():
    model = _model(keras.optimizers.Adam(0.01))
    before = [np.array(w) for w in model.get_weights()]
    cb = kcb.BroadcastInitialState()
    cb.set_model(model)
    assert not model.optimizer.built
    cb.on_train_begin()
    assert model.optimizer.built
    names = [v.path for v in cb.state_variables()]
    assert any("iteration" in n for n in names)  # optimizer state is included
    assert len(names) == len(model.weights) + len(model.optimizer.variables)
    for a, b in zip(before, model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_broadcast_bad_input():
    with pytest.raises(ValueError, match="root"):
        kcb.BroadcastInitialState(root=-1)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])  # not compiled
    cb = kcb.BroadcastInitialState()
    cb.set_model(model)
    with pytest.raises(ValueError, match="compile"):
        cb.on_train_begin()


def test_metric_average_is_identity_in_one_process():
    logs = {"loss": 0.5, "val_loss": 0.25, "note": "text"}
    kcb.MetricAverage().on_epoch_end(0, logs)
    assert logs == {"loss": 0.5, "val_loss": 0.25, "note": "text"}


# --------------------------------------------------------------------------- LR warm-up


def test_warmup_sets_linear_rate_per_batch():
    x, y = _data()
    target, start = 0.1, 0.01
    model = _model(keras.optimizers.SGD(target))
    rec = _Recorder()
    warm = kcb.LearningRateWarmup(2, start_lr=start)
    hist = model.fit(x, y, batch_size=BATCH, epochs=3, callbacks=[warm, rec], verbose=0)
    expected = [
        start + (target - start) * (e + b / STEPS) / 2 if e < 2 else target
        for e in range(3)
        for b in range(STEPS)
    ]
    np.testing.assert_allclose(rec.lrs, expected, rtol=1e-6)
    assert float(np.asarray(model.optimizer.learning_rate)) == pytest.approx(target)
    np.testing.assert_allclose(hist.history["learning_rate"][-1], target, rtol=1e-6)


def test_warmup_default_start_is_target_over_size(monkeypatch):
    monkeypatch.setattr(kmp.distributed, "size", lambda: 4)
    x, y = _data()
    model = _model(keras.optimizers.SGD(0.4))
    rec = _Recorder()
    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=2,
        verbose=0,
        callbacks=[kcb.LearningRateWarmup(1), rec],
    )
    expected = [0.1 + 0.3 * b / STEPS for b in range(STEPS)] + [0.4] * STEPS
    np.testing.assert_allclose(rec.lrs, expected, rtol=1e-6)


def test_warmup_fractional_epochs_and_resume_past_warmup():
    x, y = _data()
    model = _model(keras.optimizers.SGD(0.2))
    rec = _Recorder()
    warm = kcb.LearningRateWarmup(0.5, start_lr=0.0, target_lr=0.2)
    model.fit(x, y, batch_size=BATCH, epochs=1, callbacks=[warm, rec], verbose=0)
    np.testing.assert_allclose(rec.lrs, [0.0, 0.1, 0.2, 0.2], rtol=1e-6, atol=1e-9)
    # A later fit past the warm-up leaves a rate set by someone else alone.
    model.optimizer.learning_rate = 0.05
    rec2 = _Recorder()
    model.fit(x, y, batch_size=BATCH, epochs=2, initial_epoch=1, callbacks=[warm, rec2], verbose=0)
    np.testing.assert_allclose(rec2.lrs, [0.05] * STEPS, rtol=1e-6)


def test_warmup_works_through_a_loss_scale_optimizer():
    x, y = _data()
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    model = _model(opt)
    rec = _Recorder()
    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=1,
        verbose=0,
        callbacks=[kcb.LearningRateWarmup(1, start_lr=0.0), rec],
    )
    np.testing.assert_allclose(rec.lrs, [0.1 * b / STEPS for b in range(STEPS)], atol=1e-7)


def test_warmup_rejects_a_schedule_with_advice():
    sched = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.9)
    model = _model(keras.optimizers.SGD(sched))
    x, y = _data()
    with pytest.raises(TypeError, match=r"float learning_rate.*warmup_steps"):
        model.fit(x, y, batch_size=BATCH, callbacks=[kcb.LearningRateWarmup(1)], verbose=0)


def test_warmup_unknown_epoch_length_says_what_to_do():
    cb = kcb.LearningRateWarmup(1)
    cb.set_model(_model())
    cb.set_params({"steps": None, "epochs": 1, "verbose": 0})
    with pytest.raises(ValueError, match="steps_per_epoch="):
        cb.on_train_begin()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"warmup_epochs": 0},
        {"warmup_epochs": -2},
        {"warmup_epochs": float("nan")},
        {"warmup_epochs": 1, "target_lr": 0},
        {"warmup_epochs": 1, "start_lr": -0.1},
        {"warmup_epochs": 1, "steps_per_epoch": 0},
    ],
)
def test_warmup_bad_input(kwargs):
    with pytest.raises(ValueError, match="LearningRateWarmup"):
        kcb.LearningRateWarmup(**kwargs)


def test_warmup_rejects_non_numeric_rates():
    with pytest.raises(TypeError, match="float"):
        kcb.LearningRateWarmup(1, target_lr="0.1")


# --------------------------------------------------------------------------- loss-scale monitor


def _overflow_data() -> tuple[np.ndarray, np.ndarray]:
    """Four batches; the third has inputs so large that the loss overflows float32."""
    x, y = _data()
    x[2 * BATCH : 3 * BATCH] = 1e30
    return x, y


def test_monitor_keras_loss_scale_optimizer_logs_and_reports_overflow(capsys):
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=1024.0)
    model = _model(opt)
    rec = _Recorder()
    x, y = _overflow_data()
    kernel0 = None

    class _Weights(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.snapshots = []

        def on_train_batch_end(self, batch, logs=None):
            self.snapshots.append([np.array(w) for w in self.model.get_weights()])

    snaps = _Weights()
    hist = model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[kcb.LossScaleMonitor(), rec, snaps],
    )
    assert [b["loss_scale"] for b in rec.batch_logs] == [1024.0, 1024.0, 512.0, 512.0]
    assert [b["skipped_steps"] for b in rec.batch_logs] == [0, 0, 1, 1]
    assert hist.history["loss_scale"] == [512.0]
    assert hist.history["skipped_steps"] == [1]
    # The overflowing step really was skipped: weights unchanged by batch 2.
    for a, b in zip(snaps.snapshots[1], snaps.snapshots[2], strict=True):
        np.testing.assert_array_equal(a, b)
    kernel0 = snaps.snapshots[0][0]
    assert not np.array_equal(kernel0, snaps.snapshots[3][0])
    out = capsys.readouterr().out
    assert out.count("overflow: step skipped, loss scale lowered to 512") == 1


def test_monitor_reads_kmp_style_attributes(capsys):
    class _Scaled(keras.optimizers.SGD):
        """Stands in for kmp.wrap_optimizer's optimizer: exposes loss_scale/skipped_steps."""

        loss_scale = 256.0
        skipped_steps = 3

    model = _model(_Scaled(0.01))
    mon = kcb.LossScaleMonitor()
    mon.set_model(model)
    mon.on_train_begin()
    logs: dict = {}
    mon.on_train_batch_end(0, logs)
    assert logs == {"loss_scale": 256.0, "skipped_steps": 3}
    _Scaled.loss_scale, _Scaled.skipped_steps = 128.0, 5
    mon.on_epoch_end(0, logs)
    assert logs == {"loss_scale": 128.0, "skipped_steps": 5}
    assert "overflow: 2 steps skipped, loss scale lowered to 128" in capsys.readouterr().out


def test_monitor_with_kmp_wrap_optimizer(capsys):
    optimizer_mod = pytest.importorskip("kmp.optimizer")
    keras.config.set_dtype_policy("mixed_float16")  # "dynamic" scales under float16 only
    opt = optimizer_mod.wrap_optimizer(
        keras.optimizers.SGD(0.01), loss_scale="dynamic", initial_scale=1024.0
    )
    model = _model(opt)
    rec = _Recorder()
    x, y = _overflow_data()
    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[kcb.LossScaleMonitor(), rec],
    )
    assert [b["skipped_steps"] for b in rec.batch_logs] == [0, 0, 1, 1]
    assert [b["loss_scale"] for b in rec.batch_logs] == [1024.0, 1024.0, 512.0, 512.0]
    assert "overflow: step skipped, loss scale lowered to 512" in capsys.readouterr().out


def test_monitor_without_loss_scaling_logs_nothing(capsys):
    model = _model()
    rec = _Recorder()
    x, y = _data()
    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=1,
        verbose=0,
        callbacks=[kcb.LossScaleMonitor(), rec],
    )
    assert "loss_scale" not in rec.epoch_logs[0]
    assert "does not scale the loss" in capsys.readouterr().out


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_monitor_silent_when_kmp_chose_no_scaling(policy, capsys):
    # Under float32/bfloat16 kmp.wrap_optimizer resolves "dynamic" to no scaling:
    # a constant 1.0 and 0 skips would be noise in every progress bar.
    optimizer_mod = pytest.importorskip("kmp.optimizer")
    keras.config.set_dtype_policy(policy)
    opt = optimizer_mod.wrap_optimizer(keras.optimizers.SGD(0.01))
    model = _model(opt)
    rec = _Recorder()
    x, y = _data()
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0,
              callbacks=[kcb.LossScaleMonitor(), rec])  # fmt: skip
    assert opt.loss_scale_mode == "none"
    assert "loss_scale" not in rec.epoch_logs[0]
    assert all("loss_scale" not in b for b in rec.batch_logs)
    assert "does not scale the loss" not in capsys.readouterr().out


def test_monitor_reports_forced_scaling_under_float32():
    optimizer_mod = pytest.importorskip("kmp.optimizer")
    keras.config.set_dtype_policy("float32")
    opt = optimizer_mod.wrap_optimizer(
        keras.optimizers.SGD(0.01), loss_scale="force_dynamic", initial_scale=64.0
    )
    model = _model(opt)
    rec = _Recorder()
    x, y = _data()
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0,
              callbacks=[kcb.LossScaleMonitor(), rec])  # fmt: skip
    assert rec.epoch_logs[0]["loss_scale"] == 64.0
    assert rec.epoch_logs[0]["skipped_steps"] == 0


def test_monitor_prints_only_on_chief(not_chief, capsys):
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=1024.0)
    model = _model(opt)
    rec = _Recorder()
    x, y = _overflow_data()
    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[kcb.LossScaleMonitor(), rec],
    )
    assert rec.epoch_logs[0]["skipped_steps"] == 1  # still logged on every rank
    assert "overflow" not in capsys.readouterr().out


def test_monitor_bad_verbose():
    with pytest.raises(ValueError, match="verbose"):
        kcb.LossScaleMonitor(verbose=5)


# --------------------------------------------------------------------------- chief-only


class _Counter(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def set_model(self, model):
        self.calls.append("set_model")
        super().set_model(model)

    def on_train_begin(self, logs=None):
        self.calls.append("train_begin")

    def on_epoch_end(self, epoch, logs=None):
        self.calls.append("epoch_end")

    def on_train_batch_end(self, batch, logs=None):
        self.calls.append("batch_end")


def test_chief_only_forwards_on_chief():
    x, y = _data()
    inner = _Counter()
    _model().fit(x, y, batch_size=BATCH, epochs=2, callbacks=[kcb.chief_only(inner)], verbose=0)
    assert inner.calls.count("epoch_end") == 2
    assert inner.calls.count("batch_end") == 2 * STEPS
    assert inner.calls[:2] == ["set_model", "train_begin"]


def test_chief_only_silent_on_other_ranks(not_chief, tmp_path):
    x, y = _data()
    inner = _Counter()
    csv = tmp_path / "log.csv"
    model = _model()
    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=2,
        verbose=0,
        callbacks=[kcb.chief_only(inner), kcb.ChiefOnly(keras.callbacks.CSVLogger(str(csv)))],
    )
    assert inner.calls == []
    assert not csv.exists()


def test_chief_only_progbar_is_recognised_by_keras(capsys, monkeypatch):
    x, y = _data()
    model = _model()
    cb = kcb.ChiefOnly(keras.callbacks.ProgbarLogger())
    assert isinstance(cb, keras.callbacks.ProgbarLogger)
    model.fit(x, y, batch_size=BATCH, epochs=2, callbacks=[cb], verbose=1)
    assert capsys.readouterr().out.count("Epoch 1/2") == 1  # one bar, not two
    monkeypatch.setattr(kmp.distributed, "is_chief", lambda: False)
    model.fit(x, y, batch_size=BATCH, epochs=2, callbacks=[cb], verbose=1)
    assert "Epoch 1/2" not in capsys.readouterr().out  # Keras added no bar of its own


def test_chief_only_bad_input():
    with pytest.raises(TypeError, match="Callback instance"):
        kcb.chief_only(lambda logs: None)
    with pytest.raises(TypeError, match="not an instance"):
        kcb.ChiefOnly(keras.callbacks.CSVLogger)
    with pytest.raises(TypeError, match="History"):
        kcb.chief_only(keras.callbacks.History())


# --------------------------------------------------------------------------- checkpoints


def test_atomic_checkpoint_keeps_newest_and_latest_finds_it(tmp_path):
    x, y = _data()
    model = _model(keras.optimizers.Adam(0.01))
    ckpt = kcb.AtomicCheckpoint(tmp_path / "ck", keep=2)
    assert kcb.latest_checkpoint(tmp_path / "ck") == kcb.Checkpoint(None, 0)
    model.fit(x, y, batch_size=BATCH, epochs=4, callbacks=[ckpt], verbose=0)
    files = sorted(os.listdir(tmp_path / "ck"))
    assert files == ["ckpt-0003.keras", "ckpt-0004.keras"]
    latest = kcb.latest_checkpoint(tmp_path / "ck")
    assert latest == kcb.Checkpoint(str(tmp_path / "ck" / "ckpt-0004.keras"), 4)
    assert ckpt.latest() == latest
    restored = keras.saving.load_model(latest.path)
    for a, b in zip(model.get_weights(), restored.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(restored.optimizer.iterations) == 4 * STEPS
    # Resume from it: epochs continue from 4, and pruning keeps the two newest.
    restored.fit(
        x, y, batch_size=BATCH, epochs=5, initial_epoch=latest.epoch, callbacks=[ckpt], verbose=0
    )
    assert sorted(os.listdir(tmp_path / "ck")) == ["ckpt-0004.keras", "ckpt-0005.keras"]


def test_atomic_checkpoint_leaves_no_partial_file(tmp_path, monkeypatch):
    x, y = _data()
    model = _model()
    ckpt = kcb.AtomicCheckpoint(tmp_path, keep=3)
    model.fit(x, y, batch_size=BATCH, epochs=1, callbacks=[ckpt], verbose=0)
    good = (tmp_path / "ckpt-0001.keras").read_bytes()

    def broken_save(self, filepath, *args, **kwargs):
        with open(filepath, "wb") as f:
            f.write(b"PK\x03\x04 half a zip")
        raise OSError("disk full")

    monkeypatch.setattr(keras.Model, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        model.fit(x, y, batch_size=BATCH, epochs=2, initial_epoch=1, callbacks=[ckpt], verbose=0)
    assert sorted(os.listdir(tmp_path)) == ["ckpt-0001.keras"]  # no temp, no partial epoch 2
    assert (tmp_path / "ckpt-0001.keras").read_bytes() == good
    assert kcb.latest_checkpoint(tmp_path).epoch == 1


def test_atomic_save_never_exposes_a_partial_file(tmp_path):
    target = tmp_path / "w.keras"
    target.write_bytes(b"old")

    def save(path):
        with open(path, "wb") as f:
            f.write(b"new-but-incomplete")
        assert target.read_bytes() == b"old"  # the final name is untouched while writing
        with open(path, "ab") as f:
            f.write(b"+rest")

    kcb.atomic_save(target, save)
    assert target.read_bytes() == b"new-but-incomplete+rest"
    assert os.listdir(tmp_path) == ["w.keras"]


def test_atomic_checkpoint_best_only_weights_and_templates(tmp_path):
    x, y = _data()
    model = _model(keras.optimizers.SGD(0.05))
    template = str(tmp_path / "m-{epoch:02d}-{loss:.4f}.weights.h5")
    ckpt = kcb.AtomicCheckpoint(
        template, save_weights_only=True, save_best_only=True, monitor="loss"
    )
    rec = _Recorder()
    model.fit(x, y, batch_size=BATCH, epochs=3, callbacks=[rec, ckpt], verbose=0)
    losses = [e["loss"] for e in rec.epoch_logs]
    best = [i + 1 for i, v in enumerate(losses) if v == min(losses[: i + 1])]
    found = kcb.latest_checkpoint(tmp_path, os.path.basename(template))
    assert found.epoch == best[-1]
    assert len(os.listdir(tmp_path)) == len(best)
    model2 = _model(seed=7)
    model2.load_weights(found.path)
    assert ckpt.last_saved == found.path


def test_atomic_checkpoint_writes_nothing_on_other_ranks(not_chief, tmp_path):
    x, y = _data()
    _model().fit(
        x,
        y,
        batch_size=BATCH,
        epochs=2,
        verbose=0,
        callbacks=[kcb.AtomicCheckpoint(tmp_path / "ck")],
    )
    assert not (tmp_path / "ck").exists()


def test_atomic_checkpoint_bad_input(tmp_path):
    with pytest.raises(ValueError, match=r"\.weights\.h5"):
        kcb.AtomicCheckpoint(tmp_path / "a-{epoch}.keras", save_weights_only=True)
    with pytest.raises(ValueError, match=r"\.keras"):
        kcb.AtomicCheckpoint(tmp_path / "a-{epoch}.h5")
    with pytest.raises(ValueError, match="keep"):
        kcb.AtomicCheckpoint(tmp_path, keep=0)
    with pytest.raises(ValueError, match=r"\{epoch\}"):
        kcb.AtomicCheckpoint(tmp_path / "best.keras", keep=2)
    with pytest.raises(ValueError, match="mode"):
        kcb.AtomicCheckpoint(tmp_path, mode="up")
    with pytest.raises(ValueError, match="save_freq"):
        kcb.AtomicCheckpoint(tmp_path, save_freq=0)
    with pytest.raises(ValueError, match=r"\{epoch\}"):
        kcb.latest_checkpoint(tmp_path, "best.keras")


def test_latest_checkpoint_ignores_temp_and_foreign_files(tmp_path):
    for name in [
        "ckpt-0002.keras",
        "ckpt-0010.weights.h5",
        ".tmp-abc-ckpt-0011.keras",
        "notes.txt",
        "ckpt-x.keras",
    ]:
        (tmp_path / name).write_bytes(b"x")
    assert kcb.latest_checkpoint(tmp_path) == kcb.Checkpoint(
        str(tmp_path / "ckpt-0010.weights.h5"), 10
    )
    assert kcb.latest_checkpoint(tmp_path, "ckpt-{epoch:04d}.keras").epoch == 2


# --------------------------------------------------------------------------- defaults / configs


def test_default_callbacks_order_and_types(tmp_path):
    early = keras.callbacks.EarlyStopping(patience=2)
    cbs = kcb.default_callbacks(
        warmup_epochs=2,
        checkpoint_dir=tmp_path / "ck",
        tensorboard_dir=tmp_path / "tb",
        csv_path=tmp_path / "log.csv",
        extra=[early],
    )
    types = [type(c) for c in cbs]
    assert types[:4] == [
        kcb.BroadcastInitialState,
        kcb.MetricAverage,
        kcb.LossScaleMonitor,
        kcb.LearningRateWarmup,
    ]
    assert cbs[4] is early
    assert isinstance(cbs[5], kcb.AtomicCheckpoint)
    assert isinstance(cbs[6].callback, keras.callbacks.TensorBoard)
    assert isinstance(cbs[7].callback, keras.callbacks.CSVLogger)
    assert [type(c) for c in kcb.default_callbacks()] == [
        kcb.BroadcastInitialState,
        kcb.MetricAverage,
        kcb.LossScaleMonitor,
    ]
    with pytest.raises(TypeError, match="extra"):
        kcb.default_callbacks(extra=["EarlyStopping"])


def test_default_callbacks_train_end_to_end(tmp_path):
    x, y = _data()
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05))
    model = _model(opt)
    cbs = kcb.default_callbacks(
        warmup_epochs=1,
        target_lr=0.05,
        checkpoint_dir=tmp_path / "ck",
        csv_path=tmp_path / "log.csv",
        verbose=0,
    )
    hist = model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=2,
        validation_data=(x, y),
        callbacks=cbs,
        verbose=kcb.verbosity(0),
    )
    assert {"loss", "val_loss", "loss_scale", "skipped_steps", "learning_rate"} <= set(hist.history)
    header = (tmp_path / "log.csv").read_text().splitlines()[0]
    assert "loss_scale" in header and "val_loss" in header
    assert kcb.latest_checkpoint(tmp_path / "ck").epoch == 2


def test_get_config_round_trips(tmp_path):
    for cb in [
        kcb.BroadcastInitialState(root=0),
        kcb.MetricAverage(),
        kcb.LearningRateWarmup(3, target_lr=0.1, steps_per_epoch=10),
        kcb.LossScaleMonitor(verbose=0, batch_logs=False),
        kcb.AtomicCheckpoint(tmp_path, keep=2),
    ]:
        clone = type(cb)(**cb.get_config())
        assert clone.get_config() == cb.get_config()


# --------------------------------------------------------------------------- two real processes


@requires_horovod
@pytest.mark.distributed
def test_callbacks_across_two_processes(tmp_path):
    """One horovodrun job: broadcast, metric averaging, warm-up, monitor, chief-only writing."""
    results = run_workers("worker_cb_all.py", out_dir=tmp_path, timeout=240)
    r0, r1 = results
    # Ranks built different weights and optimizer state, and were identical after the broadcast.
    assert r0["diff_before"] > 0 and r0["opt_diff_before"] > 0
    assert r0["diff_after"] == 0.0 and r1["diff_after"] == 0.0
    assert r0["opt_diff_after"] == 0.0 and r1["opt_diff_after"] == 0.0
    assert r0["n_opt_vars"] >= 5  # iterations, learning rate, Adam moments (2 per variable)
    # Metric averaging: the raw per-rank metrics differ, the averaged ones are their mean.
    for epoch in range(len(r0["raw"])):
        raw0, raw1 = r0["raw"][epoch], r1["raw"][epoch]
        avg0, avg1 = r0["avg"][epoch], r1["avg"][epoch]
        assert raw0["loss"] != raw1["loss"]
        assert avg0 == avg1
        for key in ("loss", "val_loss", "mae"):
            assert avg0[key] == pytest.approx((raw0[key] + raw1[key]) / 2, rel=1e-12, abs=0)
    assert r0["history_loss"] == r1["history_loss"] == [a["loss"] for a in r0["avg"]]
    # Rank 1 started with loss scale 4096, rank 0 with 1024: the broadcast made it 1024 everywhere.
    assert [a["loss_scale"] for a in r1["avg"]] == [1024.0] * 3
    # Warm-up from 0.01 / 2 to 0.01 over the first epoch (4 batches), on both ranks.
    expected_lrs = [0.005 + 0.005 * b / 4 for b in range(4)] + [0.01] * 8
    for r in results:
        assert r["lrs"] == pytest.approx(expected_lrs, rel=1e-6)
    # Only the chief wrote checkpoints and logs.
    assert r0["ckpt_files"] == ["ckpt-0002.keras", "ckpt-0003.keras"]
    assert r1["ckpt_files"] == []
    assert r0["csv_exists"] and not r1["csv_exists"]
    assert r0["verbosity"] == "auto" and r1["verbosity"] == 0
    # The chief's CSV log holds the averaged metrics.
    assert r0["csv_last_loss"] == pytest.approx(r0["avg"][-1]["loss"], rel=1e-9)
