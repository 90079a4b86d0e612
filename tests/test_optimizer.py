"""kmp.wrap_optimizer (kmp/optimizer.py and the face, kmp/_dispatch.py): checks, re-wrapping, modes.

What the optimizer it returns does in a step is tests/test_scaling_optimizer.py's; the
settings object is tests/test_optimizer_settings.py's.
"""

from __future__ import annotations

import json
import sys
import types

import keras
import pytest

import kmp
import kmp.distributed as dist
from kmp.distributed.collectives import check_averaging_runtime
from kmp.optimizer import DistributedLossScaleOptimizer, ScaledLearningRate, wrap_optimizer
from tests._training import model_for

# ----------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ("adam", r"Keras 3 optimizer instance such as keras\.optimizers\.Adam"),
        (3, "Keras 3 optimizer instance"),
        (None, "Keras 3 optimizer instance"),
        (
            keras.optimizers.Adam,
            r"class Adam; call it first: kmp\.wrap_optimizer\(Adam\(\.\.\.\)\)",
        ),
    ],
)
def test_not_an_optimizer(bad, match):
    with pytest.raises(TypeError, match=match):
        wrap_optimizer(bad)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"compression": "zip"}, ValueError, r"Unknown compression 'zip'.*'fp16'"),
        ({"compression": "int8"}, ValueError, "Unknown compression"),
        ({"loss_scale": "dyn"}, ValueError, r"Unknown loss_scale 'dyn'.*'dynamic'"),
        ({"loss_scale": 0}, ValueError, r"positive finite number.*None to turn loss scaling off"),
        ({"loss_scale": -8.0}, ValueError, "positive finite number"),
        ({"loss_scale": float("inf")}, ValueError, "positive finite number"),
        ({"loss_scale": float("nan")}, ValueError, "positive finite number"),
        ({"loss_scale": True}, TypeError, "loss_scale must be"),
        ({"loss_scale": [2.0]}, TypeError, "loss_scale must be"),
        ({"initial_scale": 0}, ValueError, "`initial_scale` must be a positive finite number"),
        ({"initial_scale": -1.0}, ValueError, "initial_scale"),
        ({"initial_scale": float("inf")}, ValueError, "initial_scale"),
        ({"growth_interval": 0}, ValueError, "`growth_interval` must be a positive integer"),
        ({"growth_interval": 2.5}, TypeError, "growth_interval"),
        ({"growth_interval": True}, TypeError, "growth_interval"),
        ({"backward_passes_per_step": 0}, ValueError, "`backward_passes_per_step` must be a pos"),
        ({"backward_passes_per_step": -2}, ValueError, "backward_passes_per_step"),
        ({"backward_passes_per_step": 2.0}, TypeError, "backward_passes_per_step"),
        ({"scale_lr": "yes"}, TypeError, "`scale_lr` must be True or False"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        wrap_optimizer(keras.optimizers.SGD(), **kwargs)


def test_horovod_optimizer_is_refused():
    fake = type("_DistributedOptimizer", (keras.optimizers.Adam,), {"__module__": "horovod._keras"})
    with pytest.raises(ValueError, match=r"Horovod's DistributedOptimizer.*plain Keras optimizer"):
        wrap_optimizer(fake())


def test_horovod_optimizer_inside_keras_loss_scaling_is_refused():
    fake = type("_DistributedOptimizer", (keras.optimizers.Adam,), {"__module__": "horovod._keras"})
    with pytest.raises(ValueError, match="Horovod's DistributedOptimizer"):
        wrap_optimizer(keras.optimizers.LossScaleOptimizer(fake()))


def test_inner_loss_scale_factor_is_refused():
    with pytest.raises(ValueError, match=r"loss_scale_factor=64.*pass loss_scale=64"):
        wrap_optimizer(keras.optimizers.SGD(loss_scale_factor=64.0))


def test_many_ranks_need_the_tensorflow_backend(monkeypatch):
    monkeypatch.setattr(dist, "size", lambda: 2)
    monkeypatch.setattr(keras.backend, "backend", lambda: "jax")
    with pytest.raises(RuntimeError, match="only on the TensorFlow backend"):
        wrap_optimizer(keras.optimizers.SGD())


def test_tf_distribute_strategy_is_refused_with_many_ranks():
    import tensorflow as tf

    with (
        tf.distribute.MirroredStrategy(["/cpu:0"]).scope(),
        pytest.raises(RuntimeError, match=r"do not also use a tf\.distribute strategy"),
    ):
        check_averaging_runtime(2)


def test_tf_keras_optimizer_goes_to_the_keras2_path(monkeypatch):
    calls = {}

    def fake_wrap(optimizer, settings=None, **kwargs):
        calls.update(kwargs, optimizer=optimizer, settings=settings)
        return "wrapped by keras2"

    monkeypatch.setitem(
        sys.modules, "kmp.compat.keras2", types.SimpleNamespace(wrap_optimizer=fake_wrap)
    )
    legacy = type("Adam", (), {"__module__": "tf_keras.src.optimizers.adam"})()
    out = kmp.wrap_optimizer(legacy, loss_scale=128.0, compression="fp16", scale_lr=True)
    assert out == "wrapped by keras2"
    assert calls["optimizer"] is legacy
    assert calls["loss_scale"] == 128.0 and calls["compression"] == "fp16" and calls["scale_lr"]
    assert "backward_passes_per_step" not in calls  # only what the caller gave
    # The core itself knows Keras 3 only, and says where a tf-keras optimizer goes.
    with pytest.raises(TypeError, match=r"tf-keras.*kmp\.compat\.keras2"):
        wrap_optimizer(legacy)


# --------------------------------------------------------- idempotence


def test_wrapping_twice_returns_the_same_optimizer():
    opt = wrap_optimizer(keras.optimizers.Adam(), compression="fp16", growth_interval=10)
    assert wrap_optimizer(opt) is opt
    assert wrap_optimizer(opt, compression="fp16", growth_interval=10) is opt
    with pytest.raises(ValueError, match=r"already wrapped.*compression='bf16'.*inner_optimizer"):
        wrap_optimizer(opt, compression="bf16")


def test_rewrapping_with_a_different_explicit_setting_is_an_error_even_the_default():
    opt = wrap_optimizer(keras.optimizers.Adam(), growth_interval=500, hysteresis=2)
    assert wrap_optimizer(opt) is opt  # nothing given: nothing to compare
    assert wrap_optimizer(opt, growth_interval=500) is opt
    # 2000 is the default, but it was given and differs from 500: not silently kept.
    with pytest.raises(ValueError, match=r"growth_interval=2000 \(it has 500\)"):
        wrap_optimizer(opt, growth_interval=2000)
    with pytest.raises(ValueError, match=r"hysteresis=1 \(it has 2\)"):
        wrap_optimizer(opt, hysteresis=1)
    with pytest.raises(ValueError, match="`max_scale` must be a positive"):
        wrap_optimizer(opt, max_scale=-1.0)  # a bad value is still a bad value


def test_rewrapping_judges_only_what_is_given():
    opt = wrap_optimizer(keras.optimizers.SGD(), loss_scale="force_dynamic",
                         min_scale=2.0**16, initial_scale=2.0**17)  # fmt: skip
    assert wrap_optimizer(opt, min_scale=2.0**16) is opt  # not judged against the defaults
    assert wrap_optimizer(opt, loss_scale=" Force_Dynamic ") is opt  # names are normalised


def test_knobs_reach_the_rule_and_the_settings():
    keras.config.set_dtype_policy("mixed_float16")
    opt = wrap_optimizer(
        keras.optimizers.SGD(),
        initial_scale=64,
        growth_interval=5,
        growth_factor=4,
        backoff_factor=0.25,
        min_scale=2,
        max_scale=2**10,
        hysteresis=3,
    )
    rule = opt.loss_scale_rule
    assert (rule.kind, rule.initial_scale, rule.growth_interval) == ("dynamic", 64.0, 5)
    assert (rule.growth_factor, rule.backoff_factor, rule.hysteresis) == (4.0, 0.25, 3)
    assert (rule.min_scale, rule.max_scale) == (2.0, 1024.0)
    assert opt.settings.hysteresis == 3 and opt.settings.loss_scale == "dynamic"
    cfg = json.loads(json.dumps(keras.saving.serialize_keras_object(opt)))
    assert keras.saving.deserialize_keras_object(cfg).loss_scale_rule == rule


def test_keras_loss_scale_optimizer_is_unwrapped_and_rewrapped():
    adam = keras.optimizers.Adam()
    lso = keras.optimizers.LossScaleOptimizer(adam, initial_scale=256.0, dynamic_growth_steps=7)
    opt = wrap_optimizer(lso)
    assert isinstance(opt, DistributedLossScaleOptimizer)
    assert opt.inner_optimizer is adam
    assert (opt.initial_scale, opt.dynamic_growth_steps) == (256.0, 7)
    assert (
        wrap_optimizer(keras.optimizers.LossScaleOptimizer(adam), initial_scale=8.0).initial_scale
        == 8.0
    )


def test_a_backed_off_keras_scale_is_brought_into_range():
    keras.config.set_dtype_policy("mixed_float16")
    lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(), initial_scale=0.25)
    assert wrap_optimizer(lso).loss_scale == 1.0  # kmp's floor, not an error
    big = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(), initial_scale=2.0**30)
    assert wrap_optimizer(big).loss_scale == 2.0**24


def test_compile_does_not_wrap_a_second_time():
    keras.config.set_dtype_policy("mixed_float16")
    model = model_for("mixed_float16")
    opt = wrap_optimizer(keras.optimizers.Adam())
    model.compile(optimizer=opt, loss="mse", auto_scale_loss=True)
    assert model.optimizer is opt
    plain = model_for("mixed_float16")
    plain.compile(optimizer=keras.optimizers.Adam(), loss="mse")
    assert type(plain.optimizer) is keras.optimizers.LossScaleOptimizer  # Keras's own, for contrast


# ---------------------------------------------------- loss-scale modes


@pytest.mark.parametrize(
    ("policy", "loss_scale", "mode", "scale"),
    [
        ("float32", "dynamic", "none", 1.0),
        ("mixed_bfloat16", "dynamic", "none", 1.0),
        ("mixed_float16", "dynamic", "dynamic", 2.0**15),
        ("float32", "force_dynamic", "dynamic", 2.0**15),
        ("mixed_float16", 512, "static", 512.0),
        ("mixed_float16", None, "none", 1.0),
    ],
)
def test_mode_follows_policy_and_argument(policy, loss_scale, mode, scale):
    keras.config.set_dtype_policy(policy)
    opt = wrap_optimizer(keras.optimizers.SGD(), loss_scale=loss_scale)
    assert opt.loss_scale_mode == mode
    assert opt.loss_scale == scale
    assert opt.skipped_steps == 0


def test_mode_is_decided_at_wrap_time_not_on_first_read():
    opt = wrap_optimizer(keras.optimizers.SGD())  # float32 policy now: no scaling
    keras.config.set_dtype_policy("mixed_float16")  # changing the policy later changes nothing
    assert opt.loss_scale_mode == "none"
    keras.config.set_dtype_policy("float32")
    keras.config.set_dtype_policy("mixed_float16")
    opt = wrap_optimizer(keras.optimizers.SGD())  # wrapped under float16: dynamic
    keras.config.set_dtype_policy("float32")
    assert opt.loss_scale_mode == "dynamic"
    assert opt.loss_scale == 2.0**15


# ------------------------------------------------------------ scale_lr


def test_scale_lr_multiplies_by_the_world_size(monkeypatch):
    monkeypatch.setattr(dist, "size", lambda: 4)
    opt = wrap_optimizer(keras.optimizers.SGD(0.01), scale_lr=True)
    assert float(opt.learning_rate.numpy()) == pytest.approx(0.04)
    assert wrap_optimizer(opt, scale_lr=True) is opt
    assert float(opt.learning_rate.numpy()) == pytest.approx(0.04)  # not scaled twice
    again = DistributedLossScaleOptimizer.from_config(opt.get_config())
    assert float(again.learning_rate.numpy()) == pytest.approx(0.04)
    sched = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    opt2 = wrap_optimizer(keras.optimizers.SGD(sched), scale_lr=True)
    assert isinstance(opt2.inner_optimizer._learning_rate, ScaledLearningRate)
    assert float(opt2.inner_optimizer._learning_rate(0)) == pytest.approx(0.4)


def test_scale_lr_in_one_process_changes_nothing():
    opt = wrap_optimizer(keras.optimizers.SGD(0.01), scale_lr=True)
    assert float(opt.learning_rate.numpy()) == pytest.approx(0.01)
