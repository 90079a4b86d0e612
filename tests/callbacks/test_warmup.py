"""kmp.callbacks.warmup: LearningRateWarmup."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import kmp.distributed
from kmp import callbacks as kcb
from tests.callbacks._helpers import BATCH, STEPS, Recorder, make_data, make_model


def test_warmup_sets_linear_rate_per_batch():
    x, y = make_data()
    target, start = 0.1, 0.01
    model = make_model(keras.optimizers.SGD(target))
    rec = Recorder()
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
    x, y = make_data()
    model = make_model(keras.optimizers.SGD(0.4))
    rec = Recorder()
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
    x, y = make_data()
    model = make_model(keras.optimizers.SGD(0.2))
    rec = Recorder()
    warm = kcb.LearningRateWarmup(0.5, start_lr=0.0, target_lr=0.2)
    model.fit(x, y, batch_size=BATCH, epochs=1, callbacks=[warm, rec], verbose=0)
    np.testing.assert_allclose(rec.lrs, [0.0, 0.1, 0.2, 0.2], rtol=1e-6, atol=1e-9)
    # A later fit past the warm-up leaves a rate set by someone else alone.
    model.optimizer.learning_rate = 0.05
    rec2 = Recorder()
    model.fit(x, y, batch_size=BATCH, epochs=2, initial_epoch=1, callbacks=[warm, rec2], verbose=0)
    np.testing.assert_allclose(rec2.lrs, [0.05] * STEPS, rtol=1e-6)


def test_warmup_works_through_a_loss_scale_optimizer():
    x, y = make_data()
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    model = make_model(opt)
    rec = Recorder()
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
    model = make_model(keras.optimizers.SGD(sched))
    x, y = make_data()
    with pytest.raises(TypeError, match=r"float learning_rate.*warmup_steps"):
        model.fit(x, y, batch_size=BATCH, callbacks=[kcb.LearningRateWarmup(1)], verbose=0)


def test_warmup_unknown_epoch_length_says_what_to_do():
    cb = kcb.LearningRateWarmup(1)
    cb.set_model(make_model())
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


@pytest.mark.parametrize(
    "kwargs",
    [
        {"warmup_epochs": float("inf")},
        {"warmup_epochs": 1, "target_lr": float("inf")},
        {"warmup_epochs": 1, "verbose": 3},
        {"warmup_epochs": 1, "verbose": -1},
    ],
)
def test_warmup_more_bad_values(kwargs):
    with pytest.raises(ValueError, match="LearningRateWarmup"):
        kcb.LearningRateWarmup(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"warmup_epochs": "5"}, r"LearningRateWarmup\(warmup_epochs\).*number of epochs"),
        ({"warmup_epochs": True}, r"LearningRateWarmup\(warmup_epochs\)"),
        ({"warmup_epochs": None}, r"LearningRateWarmup\(warmup_epochs\)"),
        ({"start_lr": "0.01"}, r"LearningRateWarmup\(start_lr\).*float learning rate"),
        ({"target_lr": True}, r"LearningRateWarmup\(target_lr\)"),
        ({"steps_per_epoch": 2.5}, r"LearningRateWarmup\(steps_per_epoch\).*from fit"),
        ({"steps_per_epoch": "4"}, r"LearningRateWarmup\(steps_per_epoch\)"),
        ({"verbose": "1"}, r"LearningRateWarmup\(verbose\)"),
        ({"verbose": True}, r"LearningRateWarmup\(verbose\)"),
    ],
)
def test_warmup_wrong_types(kwargs, message):
    with pytest.raises(TypeError, match=message):
        kcb.LearningRateWarmup(**{"warmup_epochs": 1, **kwargs})


def test_warmup_accepts_numpy_numbers():
    cb = kcb.LearningRateWarmup(
        np.float32(0.5), target_lr=np.float64(0.1), steps_per_epoch=np.int64(3)
    )
    assert cb.get_config() == {
        "warmup_epochs": 0.5,
        "target_lr": 0.1,
        "start_lr": None,
        "steps_per_epoch": 3,
        "verbose": 0,
    }
    assert type(cb.steps_per_epoch) is int and type(cb.warmup_epochs) is float
