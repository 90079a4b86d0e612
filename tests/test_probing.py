"""kmp.probe: the float32 pass, what it finds, and what kmp.keep_float32 does with it.

Runs on the TensorFlow backend here and on JAX through tests/test_backends.py.
"""

from __future__ import annotations

import json
import math

import keras
import numpy as np
import pytest

import kmp
from kmp.probing.stats import FLOAT16_MAX, ValueStats, recommend_loss_scale

BACKEND = keras.backend.backend()


def _digits(n: int = 64) -> tuple[np.ndarray, np.ndarray]:
    from kmp.datasets import digits

    x, y = digits.load_arrays()  # 8x8 images, pixel values 0..255 as they come
    return x[:n].reshape(n, 64).astype("float32"), y[:n]


def _overflowing_model() -> keras.Model:
    """A digits MLP on raw pixels whose 'hot' layer sums them x 100: past 65504 in float16.

    The LayerNormalization after it (pre-norm style) then reads inf and makes NaN.
    """
    inputs = keras.Input((64,))
    h = keras.layers.Dense(32, name="hot", kernel_initializer=keras.initializers.Constant(100.0))(
        inputs
    )
    h = keras.layers.LayerNormalization(name="norm")(h)
    outputs = keras.layers.Dense(10, name="head")(h)
    model = kmp.float32_outputs(keras.Model(inputs, outputs, name="hot_mlp"))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    # The initial scale sits below the head's gradients at 2**15, which on some runs (the
    # head's random start) overflowed once: the test is about the hot layer's forward pass.
    optimizer = kmp.wrap_optimizer(keras.optimizers.SGD(0.01), initial_scale=2.0**10)
    model.compile(optimizer=optimizer, loss=loss)
    return model


# ------------------------------------------------------------------------ pure stats


def test_value_stats_count_underflow_and_overflow_exactly():
    values = np.array([0.0, 2.0**-30, 2.0**-25, 2.0**-24, 1.0, 70000.0, -1e5, np.inf])
    s = ValueStats().add(values)
    assert (s.count, s.zeros, s.nonfinite, s.nonzero) == (8, 1, 1, 6)
    assert s.max_abs == 1e5 and s.min_nonzero == 2.0**-30
    assert s.over_float16 == 2 and s.overflows_float16() == pytest.approx(2 / 6)
    assert s.lost_to_underflow(1.0) == pytest.approx(2 / 6)  # 2**-30 and 2**-25
    assert s.lost_to_underflow(2.0) == pytest.approx(1 / 6)  # 2**-25 * 2 = 2**-24 stays
    assert s.lost_to_underflow(2.0**6) == 0.0
    assert s.overflows_float16(2.0) == pytest.approx(2 / 6)
    assert s.bfloat16_error_max < 2.0**-8 and s.bfloat16_error_mean >= 0
    json.dumps(s.to_dict())


def test_the_loss_scale_rule_grows_on_underflow_up_to_the_probes_scale():
    """The rule's early growth and kmp.probe's recommended scale draw the same line."""
    from kmp import loss_scale as ls

    rule = ls.LossScale(underflow_patience=1, growth_interval=10**6)
    starved = np.bool_(True)
    rng = np.random.default_rng(0)
    for peak in 10.0 ** rng.uniform(-6, 3, size=200):  # the largest gradient at scale 1
        for scale in 2.0 ** np.arange(0, 24, 3):
            state = ls.ScaleState(np.float32(scale), np.int64(0), np.int64(0), np.int64(0))
            stats = ls.GradientStats(np.float32(0.5), np.float32(peak * scale))
            grown = ls.update(rule, state, starved, stats, xp=np).scale > scale
            assert grown == (recommend_loss_scale([peak]) >= 2 * scale), (peak, scale)


def test_recommend_loss_scale_leaves_a_margin_and_respects_bounds():
    assert recommend_loss_scale([1.0]) == 2.0**12  # 65504 / 8 = 8188 -> 4096
    assert recommend_loss_scale([1e-6, 0.5]) == 2.0**13
    scale = recommend_loss_scale([3e-3])
    assert 3e-3 * scale * 8 <= FLOAT16_MAX < 3e-3 * scale * 2 * 8
    assert recommend_loss_scale([1e9]) == 1.0  # never below min_scale
    assert recommend_loss_scale([1e-12]) == 2.0**24  # never above max_scale
    assert recommend_loss_scale([1e-12], max_scale=1000.0) == 512.0
    assert recommend_loss_scale([]) == 2.0**24


# ----------------------------------------------------------------------- the probe


def test_probe_names_the_overflowing_layer_first_and_keep_float32_makes_fit_finite():
    kmp.enable("mixed_float16")
    x, y = _digits()
    model = _overflowing_model()
    before = model.evaluate(x, y, verbose=0)
    assert not math.isfinite(before)  # the hot layer overflows float16

    report = kmp.probe(model, x, y)
    assert report.overflowing[0].name == "hot"
    assert report.keep_float32[:2] == ["hot", "norm"] and "65504" in report.reasons["hot"]
    assert report.reasons["norm"].startswith("its inputs reach")
    assert report.overflowing[0].outputs.max_abs > FLOAT16_MAX
    assert math.isfinite(report.loss)

    changed = kmp.keep_float32(model, *report.keep_float32)
    assert {"hot", "norm"} <= set(changed)
    assert model.get_layer("hot").compute_dtype == "float32"
    history = model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert math.isfinite(history.history["loss"][-1])
    assert int(model.optimizer.skipped_steps) == 0


def test_probe_finds_gradients_below_float16_and_its_scale_trains_without_skips():
    kmp.enable("mixed_float16")
    x, y = _digits()
    x = x / 255.0
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(10)],
        name="tiny_loss",
    )
    model = kmp.float32_outputs(model)
    base = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def tiny(y_true, y_pred):  # a loss 1e-9 of the usual: every gradient below 2**-24
        return 1e-9 * base(y_true, y_pred)

    report = kmp.probe(model, x, y, loss=tiny)
    kernels = [v for v in report.variables if v.name.endswith("kernel")]
    assert all(v.gradient.lost_to_underflow(1.0) > 0.5 for v in kernels)
    scale = report.recommended_loss_scale
    assert scale >= 2.0**20
    assert all(v.gradient.lost_to_underflow(scale) <= 0.01 for v in kernels)
    assert len(report.underflowing(1.0)) >= len(report.variables)
    assert all(frac <= 0.01 for _, frac in report.underflowing(scale))  # a few tiny ones
    assert report.keep_float32 == []

    opt = kmp.wrap_optimizer(keras.optimizers.SGD(1e6), initial_scale=scale)
    model.compile(optimizer=opt, loss=tiny)
    start = [np.array(w) for w in model.get_weights()]
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert int(opt.skipped_steps) == 0 and float(opt.loss_scale) == scale
    assert all(
        not np.array_equal(a, np.array(b)) for a, b in zip(start, model.get_weights(), strict=True)
    )


def test_probe_leaves_policy_weights_and_state_as_they_were():
    kmp.enable("mixed_bfloat16")
    inputs = keras.Input((64,))
    h = keras.layers.Dense(16, name="dense")(inputs)
    h = keras.layers.BatchNormalization(name="norm")(h)
    h = keras.layers.Dropout(0.5, name="drop")(h)
    model = kmp.float32_outputs(keras.Model(inputs, keras.layers.Dense(10, name="out")(h)))
    x, y = _digits(32)
    dtypes = {layer.name: layer.compute_dtype for layer in model.layers}
    values = [np.array(v.numpy(), copy=True) for v in model.variables]
    report = kmp.probe(model, x, y, loss="sparse_categorical_crossentropy")
    assert {layer.name: layer.compute_dtype for layer in model.layers} == dtypes
    assert dtypes["dense"] == "bfloat16"
    for before, var in zip(values, model.variables, strict=True):
        np.testing.assert_array_equal(before, var.numpy(), err_msg=var.path)
    assert "call" not in model.get_layer("dense").__dict__  # the recording wrapper is gone
    assert keras.config.dtype_policy().name == "mixed_bfloat16"
    names = [n.name for n in report.layers]
    assert names[:3] == ["dense", "norm", "drop"]
    by_name = {n.name: n for n in report.layers}
    assert by_name["dense"].compute_dtype == "bfloat16"
    assert by_name["dense"].outputs.bfloat16_error_mean > 0
    assert report.keep_float32 == []  # bfloat16 has float32's range
    assert {v.layer for v in report.variables} >= {"dense", "norm", "out"}


def test_probe_report_prints_serialises_and_plots():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    kmp.enable("mixed_float16")
    x, y = _digits(32)
    report = kmp.probe(_overflowing_model(), x, y)
    text = str(report)
    assert "recommended initial loss scale" in text and "hot" in text and "keep in float32" in text
    data = json.loads(report.to_json())
    assert data["keep_float32"]["hot"].startswith("outputs reach")
    assert data["recommended_loss_scale"] == report.recommended_loss_scale
    assert {layer["name"] for layer in data["layers"]} >= {"hot", "norm", "head"}
    assert report.seconds > 0
    fig = report.plot()
    assert fig.axes and fig.axes[0].get_yscale() == "log"


def test_probe_a_transformer_end_to_end():
    """A causal transformer: nested attention sublayers recorded, every gradient measured."""
    kmp.enable("mixed_float16")
    tokens = keras.Input((16,), dtype="int32")
    h = keras.layers.Embedding(256, 32, name="embed")(tokens)
    h = keras.layers.MultiHeadAttention(2, 16, name="attention")(h, h, use_causal_mask=True)
    h = keras.layers.LayerNormalization(name="norm")(h)
    model = kmp.float32_outputs(keras.Model(tokens, keras.layers.Dense(256, name="logits")(h)))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 256, (4, 17)).astype("int32")
    report = kmp.probe(
        model,
        ids[:, :-1],
        ids[:, 1:],
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    names = {n.name for n in report.layers}
    assert {"embed", "attention", "norm", "logits"} <= names
    nested = [n for n in names if n.startswith("attention/")]
    assert {"attention/query", "attention/key", "attention/value"} <= set(nested)
    assert len(report.variables) == len(model.trainable_variables)
    assert all(v.gradient.count > 0 for v in report.variables if "key/bias" not in v.name)
    assert math.isclose(report.loss, math.log(256), rel_tol=0.2)


def test_probe_a_keras_hub_model():
    pytest.importorskip("keras_hub")
    from tests import _zoo

    kmp.enable("mixed_float16")
    model = kmp.float32_outputs(_zoo.gpt2_causal_lm())
    x, y = _zoo.lm_batch(np.random.default_rng(0))
    model(x)
    report = kmp.probe(
        model, x, y, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    assert any("attention" in n.name for n in report.layers)
    assert report.recommended_loss_scale >= 1.0
    assert model.backbone.compute_dtype == "float16"


def test_probe_bad_inputs_are_clear_errors():
    x, y = _digits(8)
    with pytest.raises(TypeError, match="Keras 3 model"):
        kmp.probe("model", x, y)
    unbuilt = keras.Sequential([keras.layers.Dense(3)])
    with pytest.raises(ValueError, match="not built"):
        kmp.probe(unbuilt, x, y, loss="mse")
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
    with pytest.raises(ValueError, match="needs a loss"):
        kmp.probe(model, x, y)
    with pytest.raises(ValueError, match="does not fit"):
        kmp.probe(model, x[:, :10], y, loss="sparse_categorical_crossentropy")
    with pytest.raises(ValueError, match="min_scale"):
        kmp.probe(model, x, y, loss="mse", min_scale=4.0, max_scale=2.0)
    with pytest.raises(TypeError, match="loss must be"):
        kmp.probe(model, x, y, loss=3)
    with pytest.raises(ValueError, match="y is None"):
        kmp.probe(model, x, loss="mse")
