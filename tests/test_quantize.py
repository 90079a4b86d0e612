"""kmp.quantize: per-layer errors measured on a batch, the threshold, Keras's refusals, reloads.

Runs on the TensorFlow backend; one test reruns a quantize, save and reload on JAX.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import keras
import numpy as np
import pytest

import kmp
from kmp.quantizing import QuantizeReport, quantize, selection
from kmp.quantizing.layer_errors import relative_error

ROOT = Path(__file__).resolve().parents[1]


def _digits() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    sk_datasets = pytest.importorskip("sklearn.datasets")
    bunch = sk_datasets.load_digits()
    x = (bunch.data / 16.0).astype("float32")
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], bunch.target[order]
    return x[:1400], y[:1400], x[1400:], y[1400:]


def _mlp(name: str = "mlp") -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(128, activation="relu", name="hidden1"),
            keras.layers.Dropout(0.1, name="drop"),
            keras.layers.Dense(128, activation="relu", name="hidden2"),
            keras.layers.LayerNormalization(name="norm"),
            keras.layers.Dense(10, name="logits"),
        ],
        name=name,
    )


@pytest.fixture(scope="module")
def trained() -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """The weights of a digits MLP trained a few epochs, and the held-out batch."""
    x_train, y_train, x_val, y_val = _digits()
    model = _mlp()
    model.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(x_train, y_train, epochs=4, batch_size=64, verbose=0)
    return model.get_weights(), x_val, y_val


def _trained_model(trained) -> keras.Model:
    weights, _, _ = trained
    model = _mlp()
    model.set_weights(weights)
    return model


def _stored_kernel(layer: keras.layers.Layer) -> keras.Variable:
    """The kernel variable as stored (int4 kernels packed two values a byte)."""
    (kernel,) = [w for w in layer.weights if w.name == "kernel"]
    return kernel


def _kernel_dtype(layer: keras.layers.Layer) -> str:
    return keras.backend.standardize_dtype(_stored_kernel(layer).dtype)


def _predict(model: keras.Model, x: np.ndarray) -> np.ndarray:
    return keras.ops.convert_to_numpy(model(x, training=False))


# ------------------------------------------------------------------ quantizing a classifier


def test_int8_quantizes_every_dense_layer_and_keeps_accuracy(trained):
    model = _trained_model(trained)
    _, x_val, y_val = trained
    report = quantize(model, "int8", (x_val, y_val))

    assert isinstance(report, QuantizeReport) and report.mode == "int8"
    assert report.threshold == selection.DEFAULT_THRESHOLDS["int8"]
    assert report.quantized == ("hidden1", "hidden2", "logits")
    for name in report.quantized:
        layer = model.get_layer(name)
        assert _kernel_dtype(layer) == "int8"
        assert layer.dtype_policy.name == "int8_from_float32"
    # Every quantized layer's error was measured, finite, small and under the threshold.
    for name in report.quantized:
        error = report.layer(name).error
        assert 0.0 < error <= report.threshold
    # LayerNormalization holds weights Keras cannot quantize; Dropout holds none (unlisted).
    assert report.kept == {"norm": selection.NOT_QUANTIZABLE}
    assert report.samples == len(x_val)
    # Accuracy before and after on the batch, within one point, and really measured.
    assert report.accuracy_before > 0.85
    assert abs(report.accuracy_change) <= 0.01
    after = float(np.mean(np.argmax(_predict(model, x_val), -1) == y_val))
    assert report.accuracy_after == pytest.approx(after)
    assert 0.0 < report.output_error < 0.05


def test_a_threshold_below_a_layers_error_keeps_it_in_float32(trained):
    model = _trained_model(trained)
    _, x_val, _ = trained
    errors = quantize(_trained_model(trained), "int8", x_val).errors
    worst = max(errors, key=errors.get)
    threshold = (max(errors.values()) + min(errors.values())) / 2  # between the two ends
    report = quantize(model, "int8", x_val, threshold=threshold)

    kept = report.layer(worst)
    assert kept.status == selection.ABOVE_THRESHOLD and not kept.quantized
    assert kept.error == pytest.approx(errors[worst], rel=1e-4)  # the same measurement
    assert "threshold" in kept.detail
    assert _kernel_dtype(model.get_layer(worst)) == "float32"
    assert model.get_layer(worst).quantization_mode is None
    assert set(report.quantized) == {p for p, e in errors.items() if e <= threshold}
    assert report.quantized  # some layer still quantized


def test_threshold_zero_quantizes_nothing_and_leaves_outputs_as_they_were(trained):
    model = _trained_model(trained)
    _, x_val, _ = trained
    before = _predict(model, x_val)
    report = quantize(model, "int8", x_val, threshold=0.0)
    assert report.quantized == () and report.output_error == 0.0
    np.testing.assert_array_equal(_predict(model, x_val), before)
    assert {w.dtype for w in model.weights} == {"float32"}


def test_layers_selects_by_name_and_glob(trained):
    model = _trained_model(trained)
    _, x_val, _ = trained
    report = quantize(model, "int8", x_val, layers=["hidden*"])
    assert report.quantized == ("hidden1", "hidden2")
    assert report.kept["logits"] == selection.NOT_SELECTED
    assert _kernel_dtype(model.get_layer("logits")) == "float32"
    with pytest.raises(ValueError, match="names no layer"):
        quantize(_trained_model(trained), "int8", x_val, layers=["nope"])


def test_int4_and_float8_run_and_int4_errs_more_than_int8(trained):
    _, x_val, y_val = trained
    int8 = quantize(_trained_model(trained), "int8", x_val).errors
    model = _trained_model(trained)
    int4 = quantize(model, "int4", (x_val, y_val), threshold=math.inf)
    assert int4.quantized == ("hidden1", "hidden2", "logits")
    assert model.get_layer("hidden1").dtype_policy.name.startswith("int4/")  # Keras's blocks
    assert _kernel_dtype(model.get_layer("hidden1")) == "int8"  # two int4 values a byte
    assert _stored_kernel(model.get_layer("hidden1")).shape == (64, 64)  # 128 outputs packed
    assert all(int4.errors[p] > int8[p] for p in int8)
    assert abs(int4.accuracy_change) <= 0.03
    model = _trained_model(trained)
    float8 = quantize(model, "float8", x_val, threshold=math.inf)
    assert float8.quantized == ("hidden1", "hidden2", "logits")
    assert model.get_layer("logits").quantization_mode == "float8"
    assert all(0.0 < e < 0.2 for e in float8.errors.values())


# ------------------------------------------------------- what Keras cannot quantize: skipped


class _OwnDense(keras.layers.Dense):
    """A Dense subclass: Keras quantizes exactly its own classes."""


class _WithSpareLayer(keras.Model):
    """A subclassed model holding a Dense layer it never calls (never built)."""

    def __init__(self):
        super().__init__()
        self.used = keras.layers.Dense(4, name="used")
        self.spare = keras.layers.Dense(3, name="spare")

    def build(self, input_shape):
        self.used.build(input_shape)

    def call(self, x):
        return self.used(x)


def test_layers_keras_cannot_quantize_are_reported_not_raised():
    x = np.random.default_rng(0).normal(size=(16, 8)).astype("float32")
    model = keras.Sequential(
        [keras.Input((8,)), _OwnDense(8, name="own"), keras.layers.Dense(4, name="plain")]
    )
    report = quantize(model, "int8", x)
    assert report.quantized == ("plain",)
    own = report.layer("own")
    assert own.status == selection.KERAS_REFUSED and "NotImplementedError" in own.detail
    assert _kernel_dtype(model.get_layer("own")) == "float32"

    spared = _WithSpareLayer()
    spared(x)
    with pytest.raises(ValueError, match="isn't yet built"):  # Keras's own quantize stops
        _WithSpareLayer.quantize(_spare_only(), "int8")
    report = quantize(spared, "int8", x)
    assert report.quantized == ("used",)
    assert report.kept == {"spare": selection.KERAS_REFUSED}
    assert "not built" in report.layer("spare").detail


def _spare_only() -> keras.Model:
    model = _WithSpareLayer()
    model(np.zeros((1, 8), "float32"))
    return model


def test_a_built_layer_the_batch_does_not_reach_stays_unmeasured_and_float():
    x = np.random.default_rng(0).normal(size=(16, 8)).astype("float32")
    model = _WithSpareLayer()
    model(x)
    model.spare.build((None, 5))
    report = quantize(model, "int8", x)
    assert report.kept == {"spare": selection.NOT_REACHED}
    assert report.layer("spare").error is None
    assert _kernel_dtype(model.spare) == "float32"


def test_int8_under_float16_compute_is_refused_with_what_to_do():
    x = np.random.default_rng(0).normal(size=(16, 8)).astype("float32")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # float16 on a CPU: kmp warns it is slow
        with kmp.policy_scope("mixed_float16"):
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, name="d")])
    report = quantize(model, "int8", x)
    assert report.quantized == ()
    assert report.kept == {"d": selection.KERAS_REFUSED}
    assert "policy='float32'" in report.layer("d").detail


# ----------------------------------------------------------------- policies, models, files


def test_a_mixed_bfloat16_model_quantizes_and_keeps_float32_outputs():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 16)).astype("float32")
    with kmp.policy_scope("mixed_bfloat16"):
        model = kmp.float32_outputs(
            keras.Sequential(
                [
                    keras.Input((16,)),
                    keras.layers.Dense(32, name="a"),
                    keras.layers.Dense(4, name="b"),
                ]
            )
        )
    report = quantize(model, "int8", x)
    assert report.quantized == ("a", "b")
    assert model.get_layer("a").dtype_policy.name == "int8_from_mixed_bfloat16"
    assert model(x).dtype == "float32"
    assert report.output_error < 0.05


def test_embedding_and_attention_projections_quantize():
    tokens = keras.Input((12,), dtype="int32")
    h = keras.layers.Embedding(50, 16, name="embed")(tokens)
    h = keras.layers.MultiHeadAttention(2, 8, name="attention")(h, h, use_causal_mask=True)
    logits = keras.layers.Dense(50, name="logits")(h)
    model = keras.Model(tokens, logits)
    x = np.random.default_rng(0).integers(0, 50, size=(8, 12)).astype("int32")
    report = quantize(model, "int8", x)
    assert set(report.quantized) == {
        "embed",
        "attention/query",
        "attention/key",
        "attention/value",
        "attention/attention_output",
        "logits",
    }
    assert {report.layer(p).class_name for p in report.quantized} == {
        "Embedding",
        "EinsumDense",
        "Dense",
    }
    assert report.output_error < 0.05


def test_a_quantized_model_saves_and_reloads_with_the_same_predictions(trained, tmp_path):
    model = _trained_model(trained)
    _, x_val, _ = trained
    quantize(model, "int8", x_val)
    path = tmp_path / "quantized.keras"
    kmp.save_model(model, path)

    reloaded = kmp.load_model(path)
    assert _kernel_dtype(reloaded.get_layer("hidden1")) == "int8"
    np.testing.assert_array_equal(_predict(reloaded, x_val), _predict(model, x_val))
    keras_reloaded = keras.models.load_model(path)
    np.testing.assert_array_equal(_predict(keras_reloaded, x_val), _predict(model, x_val))

    served = kmp.load_model(path, policy="bfloat16")  # a quantized file in another precision
    assert served.get_layer("hidden1").dtype_policy.name == "int8_from_bfloat16"
    assert _kernel_dtype(served.get_layer("hidden1")) == "int8"
    assert relative_error([_predict(served, x_val)], [_predict(model, x_val)]) < 0.05


def test_a_model_trained_then_quantized_reloads_compiled_with_a_fresh_optimizer(tmp_path):
    """Its saved optimizer state is the float model's: left out with a warning, not an error."""
    x_train, y_train, x_val, _ = _digits()
    model = _mlp()
    model.compile(
        optimizer=kmp.wrap_optimizer(keras.optimizers.Adam(3e-3)),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(x_train[:256], y_train[:256], epochs=1, batch_size=64, verbose=0)
    quantize(model, "int8", x_val)
    path = tmp_path / "trained_int8.keras"
    kmp.save_model(model, path)

    with pytest.warns(UserWarning, match="holds a quantized model") as caught:
        reloaded = kmp.load_model(path)
    assert len([w for w in caught if "quantized model" in str(w.message)]) == 1
    assert _kernel_dtype(reloaded.get_layer("hidden1")) == "int8"
    np.testing.assert_array_equal(_predict(reloaded, x_val), _predict(model, x_val))
    assert int(reloaded.optimizer.iterations) == 0  # fresh, and it trains on
    reloaded.fit(x_train[:64], y_train[:64], epochs=1, batch_size=64, verbose=0)
    assert int(reloaded.optimizer.iterations) == 1


def test_a_y_that_is_no_class_labels_just_leaves_accuracy_out():
    x = np.random.default_rng(0).normal(size=(16, 8)).astype("float32")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1, name="regression")])
    report = quantize(model, "int8", (x, x[:, :1]))  # a regression target
    assert report.quantized == ("regression",) and report.accuracy_before is None
    with pytest.raises(ValueError, match="one output per class"):
        quantize(model, "int8", x, labels=x[:, 0])


def test_a_dataset_gives_its_first_batch(trained):
    tf = pytest.importorskip("tensorflow")
    _, x_val, y_val = trained
    dataset = tf.data.Dataset.from_tensor_slices((x_val, y_val)).batch(100)
    report = quantize(_trained_model(trained), "int8", dataset)
    assert report.samples == 100 and report.accuracy_before is not None


def test_the_report_prints_a_table_and_gives_plain_data(trained):
    _, x_val, y_val = trained
    report = quantize(_trained_model(trained), "int8", (x_val, y_val))
    text = str(report)
    assert text.startswith("kmp.quantize int8: 3 of 4 weighted layers quantized")
    assert "accuracy" in text and "not-a-quantizable-class" in text
    for path in ("hidden1", "hidden2", "norm", "logits"):
        assert any(line.startswith(path) for line in text.splitlines())
    data = json.loads(json.dumps(report.to_dict()))
    assert data["quantized"] == ["hidden1", "hidden2", "logits"]
    assert data["layers"][2] == {
        "path": "norm",
        "class": "LayerNormalization",
        "status": selection.NOT_QUANTIZABLE,
        "error": None,
        "detail": "Keras has no quantized LayerNormalization",
    }
    with pytest.raises(KeyError, match="hidden1"):
        report.layer("missing")


# ------------------------------------------------------------------------------ bad input


def test_bad_arguments_raise_before_the_model_changes(trained):
    model = _trained_model(trained)
    _, x_val, y_val = trained
    with pytest.raises(ValueError, match="'int8', 'int4', 'float8'"):
        quantize(model, "int2", x_val)
    with pytest.raises(ValueError, match="GPTQConfig"):
        quantize(model, "gptq", x_val)
    with pytest.raises(TypeError, match="mode"):
        quantize(model, 8, x_val)
    with pytest.raises(TypeError, match=r"keras\.Model"):
        quantize(model.get_layer("hidden1"), "int8", x_val)
    with pytest.raises(ValueError, match="`data` is required"):
        quantize(model, "int8")
    with pytest.raises(TypeError, match="`data`"):
        quantize(model, "int8", "images.npy")
    with pytest.raises(ValueError, match="empty batch"):
        quantize(model, "int8", x_val[:0])
    with pytest.raises(TypeError, match="threshold"):
        quantize(model, "int8", x_val, threshold="5%")
    with pytest.raises(ValueError, match="threshold"):
        quantize(model, "int8", x_val, threshold=-0.1)
    with pytest.raises(ValueError, match="twice"):
        quantize(model, "int8", (x_val, y_val), labels=y_val)
    with pytest.raises(ValueError, match="do not fit"):
        quantize(model, "int8", x_val, labels=y_val[:5])
    with pytest.raises(TypeError, match="layers"):
        quantize(model, "int8", x_val, layers=[3])
    assert {w.dtype for w in model.weights} == {"float32"}  # nothing was quantized


# ------------------------------------------------------------------------- pure decisions


def test_the_decisions_are_pure_and_exact():
    facts = selection.LayerFacts("a/b", "Dense", quantizable=True, built=True, has_weights=True)
    assert selection.screen(facts, "int8") is None
    assert selection.decide(0.05, 0.05) == selection.QUANTIZED
    assert selection.decide(0.0500001, 0.05) == selection.ABOVE_THRESHOLD
    assert selection.decide(math.nan, 1.0) == selection.ABOVE_THRESHOLD
    half = selection.LayerFacts("d", "Dense", True, True, True, compute_dtype="float16")
    assert selection.screen(half, "int8")[0] == selection.KERAS_REFUSED
    assert selection.screen(half, "int4") is None  # Keras refuses float16 for int8 only
    assert selection.is_quantizable_class(keras.layers.EinsumDense)
    assert not selection.is_quantizable_class(keras.layers.Conv2D)
    assert not selection.is_quantizable_class(keras.Sequential)
    assert selection.matches("gpt/block0_mlp_in", "block0_mlp_in", ["block*_mlp_*"])
    assert selection.matches("gpt/block0_mlp_in", "block0_mlp_in", ["gpt/*"])
    assert not selection.matches("gpt/block0_ln", "block0_ln", ["block*_mlp_*"])
    a = np.array([3.0, 4.0], "float32")
    assert relative_error([a * 1.01], [a]) == pytest.approx(0.01)
    assert relative_error([np.zeros(2)], [np.zeros(2)]) == 0.0
    assert relative_error([np.array([np.nan, 0])], [a]) == math.inf


# ---------------------------------------------------------------------------------- JAX


@pytest.mark.skipif(keras.backend.backend() == "jax", reason="already on the JAX backend")
def test_quantize_save_and_reload_on_jax(tmp_path):
    pytest.importorskip("jax")
    script = textwrap.dedent(
        f"""
        import keras, numpy as np, kmp
        from kmp.quantizing import quantize
        assert keras.backend.backend() == "jax"
        x = np.random.default_rng(0).normal(size=(32, 16)).astype("float32")
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, name="a"),
                                  keras.layers.Dense(4, name="b")])
        report = quantize(model, "int8", x)
        assert report.quantized == ("a", "b"), report
        assert report.output_error < 0.05, report
        kmp.save_model(model, {str(tmp_path / "q.keras")!r})
        loaded = kmp.load_model({str(tmp_path / "q.keras")!r})
        np.testing.assert_array_equal(np.asarray(loaded(x)), np.asarray(model(x)))
        print("ok", report.output_error)
        """
    )
    env = {**os.environ, "KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu"}
    run = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.startswith("ok ")
