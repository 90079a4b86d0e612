"""kmp.OptimizerSettings (kmp/optimizer_settings.py): one frozen settings object.

Its fields hold the real defaults and their checks; the three wrappers (kmp.wrap_optimizer,
kmp.compat.keras2.wrap_optimizer, kmp.compat.v1.distributed_optimizer) take it and apply
keyword overrides once; the Keras 3 optimizer keeps it and saves it.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmp
from kmp import optimizer_settings
from kmp.compat import keras2
from kmp.compat.v1 import optimizer as v1_optimizer
from kmp.distributed.buckets import DEFAULT_BUCKET_BYTES
from kmp.loss_scale import FLOAT32_MAX, LossScale
from kmp.optimizer import wrap_optimizer
from kmp.optimizer_settings import OptimizerSettings

WRAPPERS = {
    "kmp.wrap_optimizer": kmp.wrap_optimizer,
    "kmp.optimizer.wrap_optimizer": wrap_optimizer,
    "kmp.compat.keras2.wrap_optimizer": keras2.wrap_optimizer,
    "kmp.compat.v1.distributed_optimizer": v1_optimizer.distributed_optimizer,
}
FIELDS = OptimizerSettings.field_names()


def tf1_sgd():
    return tf.compat.v1.train.GradientDescentOptimizer(0.1)


# ------------------------------------------------------------------ the object


def test_the_defaults_are_the_fields_own():
    fields = dataclasses.fields(OptimizerSettings)
    assert tuple(f.name for f in fields) == FIELDS
    assert all(callable(f.metadata["check"]) for f in fields)  # each field has its check
    plain = OptimizerSettings()
    assert plain.changed() == {}
    assert plain.values() == OptimizerSettings.defaults()
    assert plain.loss_scale == "dynamic"
    assert plain.bucket_bytes == DEFAULT_BUCKET_BYTES == 4 * 2**20
    assert plain.initial_scale == LossScale().initial_scale  # the rule's own knobs


@pytest.mark.parametrize("name", list(WRAPPERS))
def test_every_wrapper_takes_settings_and_overrides(name):
    """No wrapper spells the fields out again: settings=, then overrides of its fields."""
    params = inspect.signature(WRAPPERS[name]).parameters
    assert params["settings"].default is None
    assert not set(FIELDS) & set(params), name
    assert [p.kind for p in params.values()][-1] is inspect.Parameter.VAR_KEYWORD


def test_fields_are_checked_and_canonical():
    s = OptimizerSettings(loss_scale=" Force_Dynamic ", compression="FP16", growth_interval=5)
    assert s.changed() == {
        "loss_scale": "force_dynamic",
        "growth_interval": 5,
        "compression": "fp16",
    }
    assert s.bucket_bytes == DEFAULT_BUCKET_BYTES
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.compression = "bf16"


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"loss_scale": "dyn"}, ValueError, r"Unknown loss_scale 'dyn'.*'dynamic'"),
        ({"loss_scale": 0}, ValueError, r"positive finite number.*None to turn loss scaling off"),
        ({"loss_scale": True}, TypeError, "loss_scale must be"),
        ({"loss_scale": [2.0]}, TypeError, "loss_scale must be"),
        ({"initial_scale": -1.0}, ValueError, "`initial_scale` must be a positive finite number"),
        ({"growth_interval": 2.5}, TypeError, "growth_interval"),
        ({"growth_factor": 1.0}, ValueError, r"growth_factor.*2\.0 doubles the scale"),
        ({"backoff_factor": 1.5}, ValueError, r"backoff_factor.*0\.5 halves it"),
        ({"hysteresis": 0}, ValueError, "1 backs off at every overflow"),
        ({"max_scale": 1e39}, ValueError, "float32's normal range"),
        ({"compression": "zip"}, ValueError, r"Unknown compression 'zip'.*'fp16'"),
        ({"compression": 3}, TypeError, "compression must be None, 'fp16' or 'bf16'"),
        ({"backward_passes_per_step": 0}, ValueError, "`backward_passes_per_step` must be a pos"),
        ({"scale_lr": "yes"}, TypeError, "`scale_lr` must be True or False"),
        ({"bucket_bytes": "4k"}, TypeError, "bucket_bytes"),
        ({"sparse_gradients": "scatter"}, ValueError, "sparse_gradients"),
        ({"master_weights": "fp64"}, ValueError, "master_weights"),
        ({"rounding_seed": -1}, ValueError, "rounding_seed"),
    ],
)
def test_bad_fields_are_refused_when_made(kwargs, error, match):
    with pytest.raises(error, match=match):
        OptimizerSettings(**kwargs)
    with pytest.raises(error, match=match):  # an override is checked the same way, once
        kmp.wrap_optimizer(keras.optimizers.SGD(), **kwargs)


def test_an_unknown_field_is_a_type_error():
    with pytest.raises(TypeError, match="bucket_size"):
        OptimizerSettings(bucket_size=1024)
    for wrap, opt in (
        (kmp.wrap_optimizer, keras.optimizers.SGD()),
        (v1_optimizer.distributed_optimizer, tf1_sgd()),
    ):
        with pytest.raises(TypeError, match=r"Unknown optimizer setting\(s\) bucket_size.*growth"):
            wrap(opt, bucket_size=1024)


def test_a_custom_horovod_compressor_is_kept_for_the_tf_keras_path():
    class Custom:
        compress = decompress = staticmethod(lambda t: t)

    assert OptimizerSettings(compression=Custom).compression is Custom
    with pytest.raises(TypeError, match="compression must be None"):
        wrap_optimizer(keras.optimizers.SGD(), compression=Custom)  # Keras 3 cannot send it


def test_a_loss_scale_holds_its_knobs():
    rule = LossScale("dynamic", growth_interval=5)
    assert OptimizerSettings(loss_scale=rule, growth_interval=5).loss_scale is rule  # agrees
    with pytest.raises(ValueError, match=r"growth_interval=7 \(the LossScale has 5\)"):
        OptimizerSettings(loss_scale=rule, growth_interval=7)
    # A LossScale is the rule itself: the policy does not decide it again.
    assert OptimizerSettings(loss_scale=rule).loss_scale_rule("float32") is rule
    assert OptimizerSettings().loss_scale_rule("float32").kind == "none"
    assert OptimizerSettings().loss_scale_rule("float16").kind == "dynamic"


# ----------------------------------------------------- settings with overrides


def test_overrides_replace_fields_once():
    s = OptimizerSettings(compression="fp16", bucket_bytes=None)
    assert s.with_overrides(hysteresis=2).changed() == {
        "compression": "fp16",
        "bucket_bytes": None,
        "hysteresis": 2,
    }
    assert s.with_overrides() is s
    for name, wrap, opt in (
        ("kmp.wrap_optimizer", kmp.wrap_optimizer, keras.optimizers.SGD()),
        ("compat.v1", v1_optimizer.distributed_optimizer, tf1_sgd()),
    ):
        wrapped = wrap(opt, s, bucket_bytes=1024)
        assert wrapped.settings == OptimizerSettings(compression="fp16", bucket_bytes=1024), name
    assert s.bucket_bytes is None  # the caller's object is left as it was


@pytest.mark.parametrize("bad", [{"compression": "fp16"}, "fp16", 3])
def test_settings_must_be_the_settings_class(bad):
    with pytest.raises(TypeError, match=r"settings must be a kmp\.OptimizerSettings"):
        kmp.wrap_optimizer(keras.optimizers.SGD(), settings=bad)
    with pytest.raises(TypeError, match=r"settings must be a kmp\.OptimizerSettings"):
        v1_optimizer.distributed_optimizer(tf1_sgd(), settings=bad)


def test_a_settings_object_wraps_like_the_keywords_and_is_kept():
    keras.config.set_dtype_policy("mixed_float16")
    kwargs = {"compression": "bf16", "growth_interval": 50, "bucket_bytes": None}
    settings = OptimizerSettings(**kwargs)
    by_settings = wrap_optimizer(keras.optimizers.SGD(), settings=settings)
    by_keywords = wrap_optimizer(keras.optimizers.SGD(), **kwargs)
    assert by_settings.settings is settings
    assert by_keywords.settings == settings
    assert by_settings.loss_scale_rule == by_keywords.loss_scale_rule
    assert wrap_optimizer(by_settings, settings=settings) is by_settings
    with pytest.raises(ValueError, match=r"already wrapped.*compression='fp16' \(it has 'bf16'\)"):
        wrap_optimizer(by_settings, compression="fp16")


def test_the_optimizer_saves_its_settings_object():
    rule = LossScale("dynamic", initial_scale=64.0, growth_interval=3)
    for settings in (
        OptimizerSettings(compression="fp16", bucket_bytes=None, rounding_seed=4, scale_lr=True),
        OptimizerSettings(loss_scale=rule, sparse_gradients="dense"),
        OptimizerSettings(loss_scale=8.0),
    ):
        opt = wrap_optimizer(keras.optimizers.SGD(), settings)
        cfg = json.loads(json.dumps(keras.saving.serialize_keras_object(opt)))
        back = keras.saving.deserialize_keras_object(cfg)
        assert back.settings == settings
        assert back.loss_scale_rule == opt.loss_scale_rule


def test_a_kmp_0_1_config_is_refused_with_what_to_do():
    opt = wrap_optimizer(keras.optimizers.SGD())
    cfg = opt.get_config()
    old = {k: v for k, v in cfg.items() if k not in ("settings", "kmp_format", "loss_scale_rule")}
    old.update(loss_scale="dynamic", compression=None, rule=cfg["loss_scale_rule"])
    with pytest.raises(ValueError, match=r"saved by kmp 0\.1.*compile=False"):
        type(opt).from_config(old)


# ----------------------------------------------------------- the three paths


def test_keras3_defaults_are_the_fields():
    keras.config.set_dtype_policy("mixed_float16")
    opt = wrap_optimizer(keras.optimizers.SGD())
    assert opt.settings == OptimizerSettings()
    assert opt.loss_scale_mode == "dynamic"


def test_v1_follows_the_global_policy_like_every_path():
    opt = v1_optimizer.distributed_optimizer(tf1_sgd())
    assert opt.settings == OptimizerSettings()
    assert opt.loss_scale_rule.kind == "none"  # float32 policy: "dynamic" means none
    forced = v1_optimizer.distributed_optimizer(tf1_sgd(), loss_scale="force_dynamic")
    assert forced.loss_scale_rule == LossScale("dynamic")  # with the one set of knobs
    keras.config.set_dtype_policy("mixed_float16")
    assert v1_optimizer.distributed_optimizer(tf1_sgd()).loss_scale_rule == LossScale("dynamic")


def test_v1_refuses_what_only_keras3_does():
    for field, value in (
        ("backward_passes_per_step", 2),
        ("master_weights", "kahan"),
        ("rounding_seed", 3),
    ):
        settings = OptimizerSettings(**{field: value})
        with pytest.raises(ValueError, match=rf"distributed_optimizer cannot do {field}="):
            v1_optimizer.distributed_optimizer(tf1_sgd(), settings=settings)
    ok = OptimizerSettings(backward_passes_per_step=1, master_weights="auto")  # the defaults
    assert v1_optimizer.distributed_optimizer(tf1_sgd(), settings=ok) is not None


def test_v1_takes_a_loss_scale():
    rule = LossScale("static", initial_scale=128.0)
    opt = v1_optimizer.distributed_optimizer(tf1_sgd(), loss_scale=rule)
    assert opt.loss_scale_rule is rule


def test_keras2_takes_the_settings_and_refuses_what_it_cannot_do():
    tf_keras = pytest.importorskip("tf_keras", reason="tf-keras is not installed")
    try:
        keras2.set_global_policy("mixed_float16", keras_module=tf_keras)
        s = OptimizerSettings(initial_scale=256, growth_interval=50)
        opt = keras2.wrap_optimizer(tf_keras.optimizers.Adam(), settings=s)
        assert (float(opt.initial_scale), opt.dynamic_growth_steps) == (256.0, 50)
        # bucket_bytes at its default: tf-keras simply does without (Horovod's layer reduces).
        assert keras2.wrap_optimizer(tf_keras.optimizers.Adam(), settings=OptimizerSettings())
        with pytest.raises(ValueError, match="bucket_bytes=4096 is not available on the tf-keras"):
            keras2.wrap_optimizer(
                tf_keras.optimizers.Adam(), settings=OptimizerSettings(bucket_bytes=4096)
            )
        with pytest.raises(ValueError, match=r"tf-keras path \(kmp\.compat\.keras2\) cannot do"):
            kmp.wrap_optimizer(tf_keras.optimizers.Adam(), master_weights="kahan")
        with pytest.raises(ValueError, match=r"growth_factor=3\.0 \(tf-keras uses 2\.0\)"):
            keras2.wrap_optimizer(tf_keras.optimizers.Adam(), loss_scale=LossScale(growth_factor=3))
        with pytest.raises(ValueError, match="tf-keras's scale has no upper bound"):
            keras2.wrap_optimizer(tf_keras.optimizers.Adam(), loss_scale=LossScale())
        unbounded = LossScale(initial_scale=64.0, max_scale=FLOAT32_MAX)
        with pytest.raises(ValueError, match=r"underflow_threshold=0\.01 \(tf-keras uses None\)"):
            keras2.wrap_optimizer(tf_keras.optimizers.Adam(), loss_scale=unbounded)
        overflow_only = dataclasses.replace(unbounded, underflow_threshold=None)
        opt = keras2.wrap_optimizer(tf_keras.optimizers.Adam(), loss_scale=overflow_only)
        assert opt.dynamic and float(opt.initial_scale) == 64.0
        with pytest.raises(ValueError, match=r"underflow_threshold=0\.02"):
            keras2.wrap_optimizer(tf_keras.optimizers.Adam(), underflow_threshold=0.02)
    finally:
        tf_keras.mixed_precision.set_global_policy("float32")


# ------------------------------------------------------------ a LossScale, Keras 3


def test_wrap_optimizer_takes_a_loss_scale():
    rule = LossScale("dynamic", initial_scale=64.0, growth_interval=3)
    opt = wrap_optimizer(keras.optimizers.SGD(), loss_scale=rule)  # float32 policy: kept
    assert opt.loss_scale_rule == rule and opt.loss_scale_mode == "dynamic"
    assert opt.settings.loss_scale is rule
    assert wrap_optimizer(opt, loss_scale=rule) is opt
    with pytest.raises(ValueError, match=r"already wrapped.*loss_scale=LossScale\(kind='none'"):
        wrap_optimizer(opt, loss_scale=LossScale("none"))
    static = wrap_optimizer(keras.optimizers.SGD(), loss_scale=LossScale("static", initial_scale=8))
    assert (static.loss_scale_mode, static.loss_scale) == ("static", 8.0)


def test_a_loss_scale_replaces_a_keras_loss_scale_optimizers_own():
    lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(), initial_scale=256.0)
    rule = LossScale("dynamic", initial_scale=16.0)
    assert wrap_optimizer(lso, loss_scale=rule).loss_scale_rule == rule


# ------------------------------------------------- Keras's names, without warnings


def test_keras_loss_scale_optimizer_attributes_read_without_warnings():
    keras.config.set_dtype_policy("mixed_float16")
    opt = wrap_optimizer(keras.optimizers.SGD(0.1), growth_interval=2, initial_scale=64.0)
    var = keras.Variable(np.ones(3, "float32"))
    opt.scale_guard.scaled()  # these gradients stand for a scaled loss's
    opt.apply([keras.ops.ones(3)], [var])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # Generic Keras code reads these on any LossScaleOptimizer.
        scale, steps = opt.dynamic_scale, opt.step_counter
        assert (opt.initial_scale, opt.dynamic_growth_steps) == (64.0, 2)
    assert float(scale.numpy()) == opt.loss_scale == 64.0 and int(steps.numpy()) == 1
    opt.scale_guard.scaled()  # these gradients stand for a scaled loss's
    opt.apply([keras.ops.ones(3)], [var])
    assert float(scale.numpy()) == 128.0 and int(steps.numpy()) == 0


# ------------------------------------------------------------------ the face


def test_the_face_takes_settings_and_overrides():
    sig = inspect.signature(kmp.wrap_optimizer)
    assert list(sig.parameters) == ["optimizer", "settings", "overrides"]
    doc = kmp.wrap_optimizer.__doc__
    assert "tf-keras" in doc and "Keras 3" in doc and "OptimizerSettings" in doc


def test_public_names():
    from kmp import _dispatch

    assert kmp.wrap_optimizer is _dispatch.wrap_optimizer
    assert kmp.OptimizerSettings is optimizer_settings.OptimizerSettings
    assert "OptimizerSettings" in kmp.__all__ and "OptimizerSettings" in dir(kmp)
