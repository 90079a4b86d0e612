"""kmp.compat.keras2: the tf-keras (Keras 2) path, in one process and on two real ranks."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from kmp.compat import keras2
from tests._support import ROOT, requires_horovod, run_workers

tf_keras = pytest.importorskip("tf_keras", reason="tf-keras is not installed")


@pytest.fixture(autouse=True)
def _restore_tf_keras_policy():
    yield
    tf_keras.mixed_precision.set_global_policy("float32")


@pytest.fixture
def one_process(monkeypatch):
    """A process not started by a launcher: kmp.distributed is a world of one."""
    from kmp._launcher_env import LAUNCH_SIZE_VARS
    from kmp.distributed.world import _reset_for_tests

    for var in LAUNCH_SIZE_VARS:
        monkeypatch.delenv(var, raising=False)
    _reset_for_tests()
    yield
    _reset_for_tests()


# ------------------------------------------------------------------ detection


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, False), ("1", True), ("true", True), ("True", True), ("0", False), ("yes", False)],
)
def test_is_legacy_keras_follows_tensorflows_rule(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("TF_USE_LEGACY_KERAS", raising=False)
    else:
        monkeypatch.setenv("TF_USE_LEGACY_KERAS", value)
    assert keras2.is_legacy_keras() is expected


def test_is_legacy_keras_needs_tf_keras_installed(monkeypatch):
    import importlib.util

    monkeypatch.setenv("TF_USE_LEGACY_KERAS", "1")
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "tf_keras" else real(name)
    )
    assert keras2.is_legacy_keras() is False


def test_keras_module_for():
    import keras

    assert keras2.keras_module_for(tf_keras.optimizers.SGD()) is tf_keras
    assert keras2.keras_module_for(keras.optimizers.SGD()) is keras


# ------------------------------------------------------------------ policy


@pytest.mark.parametrize("name", ["mixed_float16", "mixed_bfloat16", "float32"])
def test_set_global_policy_on_tf_keras(name):
    policy = keras2.set_global_policy(name, keras_module=tf_keras)
    assert policy.name == name == tf_keras.mixed_precision.global_policy().name
    assert tf_keras.layers.Dense(2).compute_dtype == name.removeprefix("mixed_")


def test_set_global_policy_is_the_same_call_for_keras3():
    import keras

    policy = keras2.set_global_policy("mixed_bfloat16", keras_module=keras)
    assert keras.config.dtype_policy().name == "mixed_bfloat16" == policy.name
    assert tf_keras.mixed_precision.global_policy().name == "float32"  # untouched


def test_set_global_policy_defaults_to_tf_keras_under_legacy_keras(monkeypatch):
    import tensorflow as tf

    assert tf.keras.layers is not None  # tf.keras resolves now, before the variable is set
    monkeypatch.setenv("TF_USE_LEGACY_KERAS", "1")
    keras2.set_global_policy("mixed_float16")
    assert tf_keras.mixed_precision.global_policy().name == "mixed_float16"


@pytest.mark.parametrize("name", ["auto", "fp16"])
def test_set_global_policy_bad_name(name):
    with pytest.raises(ValueError, match=r"Unknown dtype policy.*kmp\.enable"):
        keras2.set_global_policy(name, keras_module=tf_keras)
    with pytest.raises(TypeError, match="must be a string"):
        keras2.set_global_policy(16, keras_module=tf_keras)


# ------------------------------------------------------------------ wrap_optimizer (one process)


def test_float16_wraps_in_loss_scale_optimizer(one_process):
    keras2.set_global_policy("mixed_float16", keras_module=tf_keras)
    opt = keras2.wrap_optimizer(
        tf_keras.optimizers.Adam(0.01), initial_scale=256, growth_interval=50
    )
    assert isinstance(opt, tf_keras.mixed_precision.LossScaleOptimizer)
    assert opt.dynamic and float(opt.initial_scale) == 256.0
    assert opt.dynamic_growth_steps == 50
    assert isinstance(opt.inner_optimizer, tf_keras.optimizers.Adam)


def test_float16_model_trains_with_the_wrapped_optimizer(one_process):
    import numpy as np

    keras2.set_global_policy("mixed_float16", keras_module=tf_keras)
    model = tf_keras.Sequential(
        [tf_keras.layers.Dense(4, input_shape=(3,)), tf_keras.layers.Dense(1, dtype="float32")]
    )
    opt = keras2.wrap_optimizer(tf_keras.optimizers.SGD(0.1), initial_scale=8)
    model.compile(optimizer=opt, loss="mse")
    before = model.get_weights()[0].copy()
    x = np.ones((8, 3), "float32")
    model.fit(x, np.zeros((8, 1), "float32"), epochs=1, batch_size=8, verbose=0)
    assert model.layers[0].compute_dtype == "float16"
    assert model.layers[0].kernel.dtype == "float32"
    assert not np.allclose(model.get_weights()[0], before)
    assert model.optimizer is opt and int(opt.iterations.numpy()) == 1


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_no_loss_scaling_outside_float16(one_process, policy):
    keras2.set_global_policy(policy, keras_module=tf_keras)
    sgd = tf_keras.optimizers.SGD()
    assert keras2.wrap_optimizer(sgd) is sgd
    forced = keras2.wrap_optimizer(sgd, loss_scale="force_dynamic")
    assert isinstance(forced, tf_keras.mixed_precision.LossScaleOptimizer) and forced.dynamic


def test_fixed_and_no_loss_scale(one_process):
    keras2.set_global_policy("mixed_float16", keras_module=tf_keras)
    fixed = keras2.wrap_optimizer(tf_keras.optimizers.SGD(), loss_scale=128)
    assert not fixed.dynamic and float(fixed.loss_scale) == 128.0
    sgd = tf_keras.optimizers.SGD()
    assert keras2.wrap_optimizer(sgd, loss_scale=None) is sgd


def test_loss_scale_optimizer_is_rewrapped(one_process):
    keras2.set_global_policy("mixed_float16", keras_module=tf_keras)
    inner = tf_keras.optimizers.SGD()
    opt = keras2.wrap_optimizer(tf_keras.mixed_precision.LossScaleOptimizer(inner), initial_scale=4)
    assert type(opt.inner_optimizer) is type(inner) and float(opt.initial_scale) == 4.0
    assert opt.inner_optimizer.get_config() == inner.get_config()


def test_legacy_tf_keras_optimizer_is_accepted(one_process):
    keras2.set_global_policy("mixed_float16", keras_module=tf_keras)
    opt = keras2.wrap_optimizer(tf_keras.optimizers.legacy.SGD(0.1))
    assert isinstance(opt, tf_keras.mixed_precision.LossScaleOptimizer)


def test_scale_lr(one_process):
    sgd = tf_keras.optimizers.SGD(0.1)
    keras2.wrap_optimizer(sgd, scale_lr=True)  # one process: unchanged
    assert float(sgd.learning_rate.numpy()) == pytest.approx(0.1)
    # The one rule of kmp.learning_rate, with tf-keras's schedule type and no wrapper.
    from kmp.learning_rate import scaled_learning_rate

    def scale(opt, factor):
        raw = getattr(opt, "_learning_rate", None)
        opt.learning_rate = scaled_learning_rate(
            raw if raw is not None else opt.learning_rate,
            factor,
            schedule_type=tf_keras.optimizers.schedules.LearningRateSchedule,
        )

    scale(sgd, 4)
    assert float(sgd.learning_rate.numpy()) == pytest.approx(0.4)
    sched = tf_keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)
    with pytest.raises(ValueError, match="cannot scale the learning-rate schedule"):
        scale(tf_keras.optimizers.SGD(sched), 2)
    with pytest.raises(ValueError, match="cannot scale the learning-rate schedule"):
        scale(tf_keras.optimizers.legacy.SGD(sched), 2)
    legacy = tf_keras.optimizers.legacy.SGD(0.1)
    scale(legacy, 2)
    assert float(legacy.learning_rate) == pytest.approx(0.2)


def test_broadcast_callback_in_one_process_does_nothing(one_process):
    cb = keras2.broadcast_callback(0)
    assert type(cb) is tf_keras.callbacks.Callback


# ------------------------------------------------------------------ bad input


def test_keras3_optimizer_is_sent_to_kmp_wrap_optimizer(one_process):
    import keras

    with pytest.raises(TypeError, match=r"use kmp\.wrap_optimizer"):
        keras2.wrap_optimizer(keras.optimizers.Adam())


def test_bad_wrap_arguments(one_process):
    sgd = tf_keras.optimizers.SGD()
    with pytest.raises(TypeError, match="takes a tf_keras optimizer"):
        keras2.wrap_optimizer("sgd", keras_module=tf_keras)
    for bad in (-1, 0, float("nan")):
        with pytest.raises(ValueError, match="`loss_scale` must be a positive finite"):
            keras2.wrap_optimizer(sgd, loss_scale=bad)
    with pytest.raises(ValueError, match="Unknown loss_scale 'static'"):
        keras2.wrap_optimizer(sgd, loss_scale="static")
    with pytest.raises(TypeError, match="loss_scale must be"):
        keras2.wrap_optimizer(sgd, loss_scale=True)
    with pytest.raises(ValueError, match="initial_scale"):
        keras2.wrap_optimizer(sgd, initial_scale=0)
    with pytest.raises(ValueError, match="growth_interval"):
        keras2.wrap_optimizer(sgd, growth_interval=0)
    with pytest.raises(ValueError, match="compression='bf16' is not available"):
        keras2.wrap_optimizer(sgd, compression="bf16")
    with pytest.raises(ValueError, match="bucket_bytes=4096 is not available on the tf-keras"):
        keras2.wrap_optimizer(sgd, bucket_bytes=4096)
    with pytest.raises(TypeError, match="bucket_bytes"):
        keras2.wrap_optimizer(sgd, bucket_bytes="4k")
    with pytest.raises(ValueError, match="Unknown compression"):
        keras2.wrap_optimizer(sgd, compression="zip")
    with pytest.raises(TypeError, match="compression must be"):
        keras2.wrap_optimizer(sgd, compression=3)
    with pytest.raises(ValueError, match="`backward_passes_per_step` must be"):
        keras2.wrap_optimizer(sgd, backward_passes_per_step=0)
    with pytest.raises(ValueError, match="needs Horovod's gradient aggregation"):
        keras2.wrap_optimizer(sgd, backward_passes_per_step=2)
    with pytest.raises(TypeError, match="scale_lr"):
        keras2.wrap_optimizer(sgd, scale_lr=1)
    # The knobs tf-keras has fixed: the same check as kmp.wrap_optimizer, then a clear refusal.
    with pytest.raises(ValueError, match="growth_factor"):
        keras2.wrap_optimizer(sgd, growth_factor=0.5)
    for knob, value in (("growth_factor", 3.0), ("min_scale", 2.0), ("hysteresis", 2)):
        with pytest.raises(ValueError, match=rf"cannot do {knob}=.*tf-keras uses"):
            keras2.wrap_optimizer(sgd, loss_scale="force_dynamic", **{knob: value})
    with pytest.raises(ValueError, match=r"max_scale.*no upper bound"):
        keras2.wrap_optimizer(sgd, max_scale=2.0**20)
    # Its own values are accepted.
    keras2.wrap_optimizer(sgd, loss_scale="force_dynamic", growth_factor=2.0, hysteresis=1)


def test_kmp_wrap_optimizer_dispatches_tf_keras_optimizers(one_process):
    import kmp

    keras2.set_global_policy("mixed_float16", keras_module=tf_keras)
    opt = kmp.wrap_optimizer(tf_keras.optimizers.SGD(), initial_scale=64)
    assert isinstance(opt, tf_keras.mixed_precision.LossScaleOptimizer)
    assert float(opt.initial_scale) == 64.0


# ------------------------------------------------------------------ fresh processes


def test_kmp_enable_sets_tf_keras_policy_under_legacy_keras():
    code = textwrap.dedent(
        """
        import json, kmp, tf_keras
        import tensorflow as tf
        choice = kmp.enable("mixed_bfloat16")
        print(json.dumps({
            "choice": choice.name,
            "tf_keras": tf_keras.mixed_precision.global_policy().name,
            "tf.keras is tf_keras": tf.keras.layers.Dense is tf_keras.layers.Dense,
            "dense": tf.keras.layers.Dense(2).compute_dtype,
        }))
        """
    )
    env = {**os.environ, "TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "3"}
    env.pop("KMP_POLICY", None)
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {
        "choice": "mixed_bfloat16",
        "tf_keras": "mixed_bfloat16",
        "tf.keras is tf_keras": True,
        "dense": "bfloat16",
    }


@requires_horovod
@pytest.mark.distributed
@pytest.mark.slow  # one horovodrun job: ~40 s on 2 idle cores, more under load
def test_tf_keras_ranks_stay_identical_in_float32_and_mixed_float16():
    r0, r1 = run_workers("worker_keras2_sync.py", timeout=240)
    for r in (r0, r1):
        assert r["legacy"] and r["tf_keras_is_tf_keras"]
    for policy, compute in (("float32", "float32"), ("mixed_float16", "float16")):
        p0, p1 = r0[policy], r1[policy]
        for p in (p0, p1):
            assert p["max_diff"] == 0.0, (policy, p)  # allgathered weights are identical
            assert p["finite"] and p["inner_is_horovod"]
            assert p["compute_dtype"] == compute and p["variable_dtype"] == "float32"
            assert p["iterations"] == 6
        assert p0["checksum"] == p1["checksum"]
    f32, f16 = r0["float32"], r0["mixed_float16"]
    assert not f32["is_loss_scale_optimizer"] and f32["optimizer"][0] == "horovod._keras"
    # Loss scaling outermost: LossScaleOptimizer(hvd.DistributedOptimizer(SGD)).
    assert f16["is_loss_scale_optimizer"]
    assert f16["inner"] == ["horovod._keras", "SGD"]
    # Rank 1 alone overflowed float16 on one batch: both ranks skipped it, halving 1024.
    assert r0["mixed_float16"]["loss_scale"] == r1["mixed_float16"]["loss_scale"] == 512.0


def test_rewrapping_keeps_a_tf_keras_scale_and_interval(one_process):
    keras2.set_global_policy("mixed_float16", keras_module=tf_keras)
    lso = tf_keras.mixed_precision.LossScaleOptimizer(
        tf_keras.optimizers.SGD(), initial_scale=512, dynamic_growth_steps=9
    )
    opt = keras2.wrap_optimizer(lso)
    assert float(opt.initial_scale) == 512.0 and opt.dynamic_growth_steps == 9
    assert keras2.wrap_optimizer(lso, growth_interval=3).dynamic_growth_steps == 3
