"""kmp.callbacks.monitor: LossScaleMonitor."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from kmp import callbacks as kcb
from tests.callbacks._helpers import BATCH, Recorder, make_data, make_model, pretend_not_chief


@pytest.fixture
def not_chief(monkeypatch):
    """Pretend to be rank 1 of 2."""
    pretend_not_chief(monkeypatch)


def overflow_data() -> tuple[np.ndarray, np.ndarray]:
    """Four batches; the third has inputs so large that the loss overflows float32."""
    x, y = make_data()
    x[2 * BATCH : 3 * BATCH] = 1e30
    return x, y


def test_monitor_keras_loss_scale_optimizer_logs_and_reports_overflow(capsys):
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=1024.0)
    model = make_model(opt)
    rec = Recorder()
    x, y = overflow_data()
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

    model = make_model(_Scaled(0.01))
    mon = kcb.LossScaleMonitor()
    mon.set_model(model)
    mon.on_train_begin()
    logs: dict = {}
    mon.on_train_batch_end(0, logs)
    assert logs == {"loss_scale": 256.0, "skipped_steps": 3, "scale_growths": 0}
    _Scaled.loss_scale, _Scaled.skipped_steps = 128.0, 5
    mon.on_epoch_end(0, logs)
    assert logs == {"loss_scale": 128.0, "skipped_steps": 5, "scale_growths": 0}
    assert "overflow: 2 steps skipped, loss scale lowered to 128" in capsys.readouterr().out
    # Two doublings between reads (no rule to read: Keras's factor 2), and the underflow
    # reading of a rule that measures it.
    _Scaled.loss_scale, _Scaled.underflow_share = 512.0, 0.0125
    mon.on_train_batch_end(1, logs)
    assert logs["scale_growths"] == 2 and mon.growths == 2
    assert logs["underflow_share"] == 0.0125


def test_monitor_with_kmp_wrap_optimizer(capsys):
    optimizer_mod = pytest.importorskip("kmp.optimizer")
    keras.config.set_dtype_policy("mixed_float16")  # "dynamic" scales under float16 only
    opt = optimizer_mod.wrap_optimizer(
        keras.optimizers.SGD(0.01), loss_scale="dynamic", initial_scale=1024.0
    )
    model = make_model(opt)
    rec = Recorder()
    x, y = overflow_data()
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
    model = make_model()
    rec = Recorder()
    x, y = make_data()
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
    model = make_model(opt)
    rec = Recorder()
    x, y = make_data()
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
    model = make_model(opt)
    rec = Recorder()
    x, y = make_data()
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0,
              callbacks=[kcb.LossScaleMonitor(), rec])  # fmt: skip
    assert rec.epoch_logs[0]["loss_scale"] == 64.0
    assert rec.epoch_logs[0]["skipped_steps"] == 0


def test_monitor_prints_only_on_chief(not_chief, capsys):
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=1024.0)
    model = make_model(opt)
    rec = Recorder()
    x, y = overflow_data()
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
    with pytest.raises(TypeError, match="verbose"):
        kcb.LossScaleMonitor(verbose="1")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"on_stuck": "halt"}, ValueError, r"`LossScaleMonitor\(on_stuck\)` must be one of"),
        ({"on_stuck": None}, TypeError, "on_stuck"),
        ({"patience": 0}, ValueError, r"`LossScaleMonitor\(patience\)` must be a positive"),
        ({"patience": 2.0}, TypeError, "patience"),
        ({"batch_logs": 1}, TypeError, "batch_logs"),
    ],
)
def test_monitor_bad_stuck_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        kcb.LossScaleMonitor(**kwargs)


def always_overflowing_fit(monitor, *, batches=12, initial_scale=4.0, **wrap):
    """Fit on inputs that overflow every step, scale starting at 4 (floor 1)."""
    from kmp.optimizer import wrap_optimizer

    keras.config.set_dtype_policy("mixed_float16")
    opt = wrap_optimizer(keras.optimizers.SGD(0.01), initial_scale=initial_scale, **wrap)
    model = make_model(opt)
    rec = Recorder()
    rng = np.random.default_rng(0)
    x = np.full((batches * BATCH, 3), 1e30, "float32")
    y = rng.normal(size=(batches * BATCH, 1)).astype("float32")
    start = [np.array(w) for w in model.get_weights()]
    model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0,
              callbacks=[monitor, rec])  # fmt: skip
    return opt, model, rec, start


def test_stuck_scale_stops_training_after_patience_steps(capsys):
    monitor = kcb.LossScaleMonitor(on_stuck="stop", patience=3)
    opt, model, rec, start = always_overflowing_fit(monitor)
    # Steps 1 and 2 back the scale off 4 -> 2 -> 1 (the floor); steps 3, 4, 5 overflow at
    # the floor: the third of those stops fit, in the first epoch.
    assert monitor.stopped and monitor.stuck_steps == 3
    assert opt.skipped_steps == 5 and opt.loss_scale == 1.0
    assert int(opt.iterations) == 0  # no step was ever applied
    assert len(rec.batch_logs) == 5 and len(rec.epoch_logs) == 1
    for w, w0 in zip(model.get_weights(), start, strict=True):
        np.testing.assert_array_equal(w, w0)
    out = capsys.readouterr().out
    assert "LossScaleMonitor stopped training" in out
    assert "stuck at its minimum (1)" in out and "Lower the learning rate" in out


def test_stuck_scale_warns_once_by_default():
    monitor = kcb.LossScaleMonitor(verbose=0, patience=4)
    with pytest.warns(RuntimeWarning, match=r"stuck at its minimum \(2\).*float32") as got:
        opt, _, rec, _ = always_overflowing_fit(monitor, batches=6, min_scale=2.0)
    assert len([w for w in got if "stuck" in str(w.message)]) == 1  # one run: one warning
    assert not monitor.stopped and len(rec.epoch_logs) == 3  # training went on
    assert opt.skipped_steps == 18 and opt.loss_scale == 2.0
    assert monitor.stuck_steps == 18 - 1  # all but the step that reached the floor


def test_hysteresis_steps_at_the_floor_count_as_stuck():
    monitor = kcb.LossScaleMonitor(verbose=0, on_stuck="stop", patience=2)
    opt, *_ = always_overflowing_fit(monitor, initial_scale=1.0, hysteresis=3)
    assert monitor.stopped and opt.skipped_steps == 2


def test_a_finite_step_resets_the_stuck_count():
    monitor = kcb.LossScaleMonitor(verbose=0)
    monitor._last_scale, monitor._last_skipped = 1.0, 0

    class _Rule:
        dynamic, min_scale = True, 1.0

    class _Opt:
        loss_scale_rule = _Rule()
        loss_scale, skipped_steps, overflow_streak = 1.0, 0, 0

    monitor._optimizer = lambda: _Opt()
    # (skipped so far, the optimizer's overflows in a row) -> stuck steps counted
    for skipped, streak, stuck in ((1, 1, 1), (2, 2, 2), (2, 0, 0), (3, 1, 1), (5, 1, 1)):
        _Opt.skipped_steps, _Opt.overflow_streak = skipped, streak
        monitor._update(None, step=True)
        assert monitor.stuck_steps == stuck, (skipped, streak)


def test_stuck_detection_with_gradient_accumulation():
    """Micro-batches that end no window neither count nor reset the stuck steps."""
    monitor = kcb.LossScaleMonitor(verbose=0, on_stuck="stop", patience=2)
    opt, *_ = always_overflowing_fit(monitor, batches=24, backward_passes_per_step=2)
    # Windows 1, 2 back off 4 -> 2 -> 1; windows 3 and 4 overflow at the floor: stop.
    assert monitor.stopped and opt.skipped_steps == 4 and opt.loss_scale == 1.0


def test_a_floor_float32_cannot_hold_exactly_is_still_the_floor():
    monitor = kcb.LossScaleMonitor(verbose=0, on_stuck="stop", patience=2)
    opt, *_ = always_overflowing_fit(monitor, initial_scale=0.4, min_scale=0.1)
    assert monitor.stopped and opt.loss_scale == pytest.approx(0.1)
