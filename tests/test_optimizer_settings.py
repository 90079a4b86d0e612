"""kmp.OptimizerSettings (kmp/optimizer_settings.py): one settings object, one set of defaults.

Taken by the three wrappers (kmp.wrap_optimizer, kmp.compat.keras2.wrap_optimizer,
kmp.compat.v1.distributed_optimizer) and the face's honest signature.
"""

from __future__ import annotations

import dataclasses
import inspect
import json

import keras
import pytest
import tensorflow as tf

import kmp
from kmp import optimizer_settings
from kmp._checks import NOT_GIVEN
from kmp.compat import keras2
from kmp.compat.v1 import optimizer as v1_optimizer
from kmp.distributed.buckets import DEFAULT_BUCKET_BYTES
from kmp.loss_scale import FLOAT32_MAX, LossScale
from kmp.optimizer import wrap_optimizer
from kmp.optimizer_settings import DEFAULTS, FIELDS, OptimizerSettings

WRAPPERS = {
    "kmp.optimizer.wrap_optimizer": wrap_optimizer,
    "kmp.compat.keras2.wrap_optimizer": keras2.wrap_optimizer,
    "kmp.compat.v1.distributed_optimizer": v1_optimizer.distributed_optimizer,
}


def tf1_sgd():
    return tf.compat.v1.train.GradientDescentOptimizer(0.1)


# ------------------------------------------------------------------ the object


def test_the_defaults_are_one_set():
    assert FIELDS == tuple(DEFAULTS) == tuple(f.name for f in dataclasses.fields(OptimizerSettings))
    assert OptimizerSettings.DEFAULTS is DEFAULTS
    assert OptimizerSettings().given() == {}
    assert OptimizerSettings().resolved() == DEFAULTS
    assert DEFAULTS["loss_scale"] == "dynamic"
    assert DEFAULTS["bucket_bytes"] == DEFAULT_BUCKET_BYTES == 4 * 2**20
    assert DEFAULTS["initial_scale"] == LossScale().initial_scale  # the rule's own knobs


@pytest.mark.parametrize("name", list(WRAPPERS))
def test_no_wrapper_has_a_default_of_its_own(name):
    """Every field a wrapper takes defaults to 'not given': the value is DEFAULTS'."""
    params = inspect.signature(WRAPPERS[name]).parameters
    assert params["settings"].default is None
    fields = [p for p in params.values() if p.name in FIELDS]
    assert len(fields) >= 10
    assert all(p.default is NOT_GIVEN and p.kind is p.KEYWORD_ONLY for p in fields), name


def test_given_fields_are_checked_and_canonical():
    s = OptimizerSettings(loss_scale=" Force_Dynamic ", compression="FP16", growth_interval=5)
    assert s.given() == {"loss_scale": "force_dynamic", "growth_interval": 5, "compression": "fp16"}
    assert s.resolved()["bucket_bytes"] == DEFAULT_BUCKET_BYTES
    assert repr(s) == (
        "OptimizerSettings(loss_scale='force_dynamic', growth_interval=5, compression='fp16')"
    )
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


def test_an_unknown_field_is_a_type_error():
    with pytest.raises(TypeError, match="bucket_size"):
        OptimizerSettings(bucket_size=1024)


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


# ----------------------------------------------------- settings with keywords


def test_keywords_and_settings_combine_field_by_field():
    s = OptimizerSettings(compression="fp16", growth_interval=500)
    both = OptimizerSettings.combine(s, {"hysteresis": 2, "compression": "FP16", "other": 1})
    assert both.given() == {"growth_interval": 500, "hysteresis": 2, "compression": "fp16"}
    assert OptimizerSettings.combine(s, {"hysteresis": NOT_GIVEN}) is s
    assert OptimizerSettings.combine(None, {"scale_lr": True}).given() == {"scale_lr": True}


def test_a_field_given_both_ways_differently_is_an_error():
    s = OptimizerSettings(compression="fp16", bucket_bytes=None)
    with pytest.raises(
        ValueError, match=r"compression='fp16' in settings and compression='bf16' as a keyword"
    ):
        OptimizerSettings.combine(s, {"compression": "bf16"})
    for name, wrap, opt in (
        ("kmp.wrap_optimizer", kmp.wrap_optimizer, keras.optimizers.SGD()),
        ("compat.v1", v1_optimizer.distributed_optimizer, tf1_sgd()),
    ):
        with pytest.raises(ValueError, match="bucket_bytes=None in settings"):
            wrap(opt, settings=s, bucket_bytes=1024)
        assert wrap(opt, settings=s, bucket_bytes=None) is not None, name


@pytest.mark.parametrize("bad", [{"compression": "fp16"}, "fp16", 3])
def test_settings_must_be_the_settings_class(bad):
    with pytest.raises(TypeError, match=r"settings must be a kmp\.OptimizerSettings"):
        kmp.wrap_optimizer(keras.optimizers.SGD(), settings=bad)
    with pytest.raises(TypeError, match=r"settings must be a kmp\.OptimizerSettings"):
        v1_optimizer.distributed_optimizer(tf1_sgd(), settings=bad)


def test_a_settings_object_wraps_like_the_keywords():
    keras.config.set_dtype_policy("mixed_float16")
    kwargs = {"compression": "bf16", "growth_interval": 50, "bucket_bytes": None}
    by_settings = wrap_optimizer(keras.optimizers.SGD(), settings=OptimizerSettings(**kwargs))
    by_keywords = wrap_optimizer(keras.optimizers.SGD(), **kwargs)
    assert by_settings.settings() == by_keywords.settings()
    assert by_settings.loss_scale_rule == by_keywords.loss_scale_rule
    assert wrap_optimizer(by_settings, settings=OptimizerSettings(**kwargs)) is by_settings


# ----------------------------------------------------------- the three paths


def test_keras3_defaults_are_the_one_set():
    keras.config.set_dtype_policy("mixed_float16")
    opt = wrap_optimizer(keras.optimizers.SGD())
    assert opt.settings() == DEFAULTS
    assert opt.loss_scale_mode == "dynamic"


def test_v1_defaults_are_the_one_set():
    opt = v1_optimizer.distributed_optimizer(tf1_sgd())
    # "dynamic", read for a graph with no policy saying float16: no scaling, as before.
    assert opt.loss_scale_rule.kind == "none"
    assert (opt._bucket_bytes, opt._sparse_gradients, opt._compression) == (
        DEFAULTS["bucket_bytes"],
        DEFAULTS["sparse_gradients"],
        DEFAULTS["compression"],
    )
    given = v1_optimizer.distributed_optimizer(tf1_sgd(), loss_scale="dynamic")
    assert given.loss_scale_rule.kind == "dynamic"  # asked for: float16's dynamic scaling
    assert given.loss_scale_rule == LossScale("dynamic")  # with the one set of knobs


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
        # The one default bucket_bytes is not given here, so tf-keras simply does without.
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
        opt = keras2.wrap_optimizer(tf_keras.optimizers.Adam(), loss_scale=unbounded)
        assert opt.dynamic and float(opt.initial_scale) == 64.0
    finally:
        tf_keras.mixed_precision.set_global_policy("float32")


# ------------------------------------------------------------ a LossScale, Keras 3


def test_wrap_optimizer_takes_a_loss_scale():
    rule = LossScale("dynamic", initial_scale=64.0, growth_interval=3)
    opt = wrap_optimizer(keras.optimizers.SGD(), loss_scale=rule)  # float32 policy: kept
    assert opt.loss_scale_rule == rule and opt.loss_scale_mode == "dynamic"
    assert opt.settings()["loss_scale"] == "force_dynamic"  # the setting that gives it
    assert wrap_optimizer(opt, loss_scale=rule) is opt
    with pytest.raises(ValueError, match=r"already wrapped.*loss_scale=LossScale\(kind='none'"):
        wrap_optimizer(opt, loss_scale=LossScale("none"))
    cfg = json.loads(json.dumps(keras.saving.serialize_keras_object(opt)))
    assert keras.saving.deserialize_keras_object(cfg).loss_scale_rule == rule
    static = wrap_optimizer(keras.optimizers.SGD(), loss_scale=LossScale("static", initial_scale=8))
    assert (static.loss_scale_mode, static.loss_scale, static.settings()["loss_scale"]) == (
        "static",
        8.0,
        8.0,
    )


def test_a_loss_scale_replaces_a_keras_loss_scale_optimizers_own():
    lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(), initial_scale=256.0)
    rule = LossScale("dynamic", initial_scale=16.0)
    assert wrap_optimizer(lso, loss_scale=rule).loss_scale_rule == rule


# ------------------------------------------------------------------ the face


def test_the_face_shows_what_both_paths_take():
    sig = inspect.signature(kmp.wrap_optimizer)
    assert list(sig.parameters) == ["optimizer", "settings", *FIELDS, "path_options"]
    assert all(sig.parameters[k].default is NOT_GIVEN for k in FIELDS)
    assert not hasattr(kmp.wrap_optimizer, "__wrapped__")  # not Keras 3's signature any more
    doc = kmp.wrap_optimizer.__doc__
    assert "tf-keras" in doc and "Keras 3" in doc and "OptimizerSettings" in doc
    # Every field the face shows is one the tf-keras path takes too (or refuses clearly).
    keras2_params = inspect.signature(keras2.wrap_optimizer).parameters
    assert set(FIELDS) <= set(keras2_params)


def test_public_names():
    from kmp import _dispatch

    assert kmp.wrap_optimizer is _dispatch.wrap_optimizer
    assert kmp.OptimizerSettings is optimizer_settings.OptimizerSettings
    assert "OptimizerSettings" in kmp.__all__ and "OptimizerSettings" in dir(kmp)
    assert OptimizerSettings.__doc__ and "combine" in OptimizerSettings.__doc__
