"""kmp.export: every format and precision written, run in its own runtime, and measured.

Two real classifiers on scikit-learn's handwritten digits (a CNN on 16x16 upsampled scans,
trained under mixed_float16, and a float32 MLP, each with ~100k-200k weights so that the
weights dominate the file sizes) and a tiny language model. The numbers asserted are the
ones the export measured in TensorFlow, onnxruntime and the LiteRT interpreter.
"""

from __future__ import annotations

import json
import os
import sys

import keras
import numpy as np
import pytest

import kmp
from kmp._imports import is_available
from kmp._outputs import log_probabilities
from kmp.exporting import export, plan_export
from kmp.exporting.comparison import compare
from kmp.exporting.unsupported import blame_layer, litert_failed_ops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVE_MODULES = ("tf2onnx", "onnx", "onnxruntime", "onnxconverter_common", "ai_edge_litert")
_MISSING = [m for m in SERVE_MODULES if not is_available(m)]
if _MISSING and os.environ.get("CI"):  # CI installs them (launch/setup.sh): a skip would hide
    raise RuntimeError(f"{_MISSING} missing: launch/setup.sh installs requirements-serve.txt")
pytestmark = [
    # The CNN trains under mixed_float16 on a CPU on purpose (kmp warns that it is slow there).
    pytest.mark.filterwarnings("ignore:Policy 'mixed_float16' computes in float16"),
    pytest.mark.skipif(
        bool(_MISSING), reason=f"{_MISSING} not installed: pip install -r requirements-serve.txt"
    ),
]

SUFFIX = {"saved_model": "", "onnx": ".onnx", "litert": ".tflite"}
# Largest absolute difference of a softmax probability from float32 Keras, by weight dtype.
BOUND = {"float32": 1e-5, "float16": 5e-3, "bfloat16": 3e-2}


@pytest.fixture(scope="module")
def digits():
    from sklearn.datasets import load_digits

    data = load_digits()
    images = np.kron(data.images, np.ones((2, 2))).astype("float32") / 16.0  # 16x16
    labels = data.target.astype("int64")
    order = np.random.default_rng(0).permutation(len(labels))
    train, test = order[:1400], order[1400:1656]
    return images[train, ..., None], labels[train], images[test, ..., None], labels[test]


@pytest.fixture(scope="module")
def mixed_cnn(digits):
    """A CNN trained 2 epochs under mixed_float16 (float32 head), ~105k weights."""
    x, y, _, _ = digits
    keras.utils.set_random_seed(0)
    with kmp.policy_scope("mixed_float16"):
        model = kmp.float32_outputs(
            keras.Sequential(
                [
                    keras.Input((16, 16, 1)),
                    keras.layers.Conv2D(32, 3, activation="relu", name="conv"),
                    keras.layers.MaxPooling2D(),
                    keras.layers.Flatten(),
                    keras.layers.Dense(64, activation="relu", name="hidden"),
                    keras.layers.Dense(10, activation="softmax", name="classes"),
                ]
            )
        )
        model.compile(keras.optimizers.Adam(3e-3), "sparse_categorical_crossentropy")
        model.fit(x, y, epochs=2, batch_size=64, verbose=0)
    return model


@pytest.fixture(scope="module")
def mlp(digits):
    """A float32 MLP trained 2 epochs, ~166k weights."""
    x, y, _, _ = digits
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((16, 16, 1)),
            keras.layers.Flatten(),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )
    model.compile(keras.optimizers.Adam(1e-3), "sparse_categorical_crossentropy")
    model.fit(x, y, epochs=2, batch_size=64, verbose=0)
    return model


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("exports")


@pytest.fixture(scope="module")
def exports(mixed_cnn, mlp, digits, out):
    """Every (model, format, precision) exported once and verified on 256 test digits."""
    _, _, x_test, y_test = digits
    done = {}
    for name, model in (("cnn", mixed_cnn), ("mlp", mlp)):
        for fmt in SUFFIX:
            for precision in ("float32", "float16"):
                path = out / f"{name}_{precision}{SUFFIX[fmt]}"
                done[name, fmt, precision] = export(
                    model, path, fmt, precision, sample=x_test, labels=y_test, verbose=False
                )
    done["cnn", "saved_model", "bfloat16"] = export(
        mixed_cnn, out / "cnn_bfloat16", "saved_model", "bfloat16", sample=x_test,
        labels=y_test, verbose=False,
    )  # fmt: skip
    return done


CASES = [(m, f, p) for m in ("cnn", "mlp") for f in SUFFIX for p in ("float32", "float16")]


@pytest.mark.parametrize("key", [*CASES, ("cnn", "saved_model", "bfloat16")], ids=str)
def test_every_export_runs_in_its_runtime_close_to_float32_keras(exports, key):
    r = exports[key]
    _, fmt, precision = key
    assert os.path.exists(r.path) and r.format == fmt and r.precision == precision
    assert (
        r.runtime == {"saved_model": "TensorFlow", "onnx": "onnxruntime", "litert": "LiteRT"}[fmt]
    )
    assert (r.input_dtype, r.output_dtype) == ("float32", "float32")
    assert r.samples == 256
    assert r.max_abs_diff <= BOUND[precision], r
    assert r.max_rel_diff >= r.max_abs_diff  # probabilities are at most 1
    assert r.top1_agreement >= 0.99
    assert r.float32_accuracy > 0.85  # trained: the agreement is about real predictions
    assert abs(r.accuracy - r.float32_accuracy) <= 0.01
    assert r.perplexity is None
    assert r.size_bytes > 0


@pytest.mark.parametrize("model", ["cnn", "mlp"])
@pytest.mark.parametrize("fmt", ["onnx", "litert"])
def test_float16_files_are_at_most_052_of_float32(exports, model, fmt):
    half, full = exports[model, fmt, "float16"], exports[model, fmt, "float32"]
    assert half.size_ratio <= 0.52
    assert half.float32_size_bytes == pytest.approx(full.size_bytes, rel=0.01)


def test_saved_model_holds_each_weight_once_in_its_precision(exports, mixed_cnn):
    import tensorflow as tf

    params = mixed_cnn.count_params()
    for precision, nbytes in (("float32", 4), ("float16", 2), ("bfloat16", 2)):
        folder = exports["cnn", "saved_model", precision].path
        reader = tf.train.load_checkpoint(os.path.join(folder, "variables", "variables"))
        shapes, dtypes = reader.get_variable_to_shape_map(), reader.get_variable_to_dtype_map()
        weights = {k: v for k, v in shapes.items() if k != "_CHECKPOINTABLE_OBJECT_GRAPH"}
        assert sum(int(np.prod(s)) for s in weights.values()) == params  # once, not twice
        assert {dtypes[k].name for k in weights} == {precision}
        assert exports["cnn", "saved_model", precision].size_bytes > params * nbytes


def test_half_files_store_half_weights(exports):
    import onnx
    from ai_edge_litert.interpreter import Interpreter

    graph = onnx.load(exports["mlp", "onnx", "float16"].path).graph
    big = [t for t in graph.initializer if np.prod(t.dims) > 1000]
    assert big and {t.data_type for t in big} == {onnx.TensorProto.FLOAT16}
    tensors = Interpreter(model_path=exports["mlp", "litert", "float16"].path)
    big = [t for t in tensors.get_tensor_details() if np.prod(t["shape"]) > 1000]
    assert np.float16 in {t["dtype"] for t in big}


def test_the_mixed_model_is_left_as_it_was(exports, mixed_cnn):
    assert mixed_cnn.get_layer("conv").dtype_policy.name == "mixed_float16"
    assert {str(w.dtype) for w in mixed_cnn.weights} == {"float32"}


def test_the_result_prints_and_serialises(exports, capsys, mlp, digits, out):
    r = exports["mlp", "onnx", "float16"]
    text = str(r)
    assert "verified in onnxruntime on 256 inputs" in text
    assert f"{r.size_ratio:.3f} of float32's" in text and "top-1 agreement" in text
    assert json.loads(json.dumps(r.to_dict()))["size_ratio"] == pytest.approx(r.size_ratio)
    again = export(mlp, out / "printed.onnx", "onnx", sample=digits[2][:8])
    assert str(again) in capsys.readouterr().out


def test_a_language_model_reports_perplexity(out):
    keras.utils.set_random_seed(0)
    lm = keras.Sequential(
        [
            keras.Input((12,), dtype="int32"),
            keras.layers.Embedding(64, 32),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(64),  # next-token logits over a vocabulary of 64
        ]
    )
    tokens = np.random.default_rng(1).integers(0, 64, size=(32, 13))
    r = export(
        lm, out / "lm.onnx", "onnx", "float16", sample=tokens[:, :-1], labels=tokens[:, 1:],
        verbose=False,
    )  # fmt: skip
    assert r.input_dtype == "int32" and r.output_dtype == "float32"
    assert r.float32_perplexity == pytest.approx(64, rel=0.1)  # untrained: about uniform
    assert r.perplexity_diff < 1e-3 and r.accuracy is None
    assert r.top1_agreement >= 0.95  # of the 32 x 12 next tokens


def test_overwrite_replaces_only_when_asked(mlp, digits, out):
    path = out / "again.tflite"
    path.write_bytes(b"old")
    with pytest.raises(ValueError, match=r"already exists.*overwrite=True"):
        export(mlp, path, "litert", sample=digits[2][:4], verbose=False)
    assert path.read_bytes() == b"old"
    r = export(mlp, path, "litert", sample=digits[2][:4], overwrite=True, verbose=False)
    assert r.size_bytes == path.stat().st_size > 1000
    assert [p.name for p in out.iterdir() if p.name.startswith(".kmp-export-")] == []


def test_a_layer_the_format_cannot_hold_is_named(out):
    class InverseErf(keras.layers.Layer):
        def call(self, x):
            return keras.ops.erfinv(keras.ops.tanh(x))

    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(8), InverseErf(name="inverse_erf"),
         keras.layers.Dense(2)]
    )  # fmt: skip
    x = np.ones((2, 8), "float32")
    for fmt, name in (("onnx", "ONNX"), ("litert", "LiteRT")):
        path = out / f"erf{SUFFIX[fmt]}"
        with pytest.raises(
            ValueError, match=rf"{name} cannot hold layer 'inverse_erf' \(InverseErf\).*Erfinv"
        ):
            export(model, path, fmt, sample=x, verbose=False)
        assert not path.exists()
    r = export(model, out / "erf", "saved_model", sample=x, verbose=False)
    assert r.max_abs_diff < 1e-5  # TensorFlow holds any TensorFlow op


def test_a_mixed_model_that_cannot_be_copied_to_float32_says_why(out):
    class Doubles(keras.layers.Layer):  # not registered: the float32 copy cannot load it
        def call(self, x):
            return x * 2

    with kmp.policy_scope("mixed_bfloat16"):
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4), Doubles()])
    with pytest.raises(ValueError, match=r"in float32 and could not.*'Doubles'.*serializable"):
        export(model, out / "doubles.onnx", "onnx", sample=np.ones((2, 4)))
    assert not (out / "doubles.onnx").exists()


def test_a_missing_runtime_names_the_install_command(monkeypatch, mlp, out):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import fails
    with pytest.raises(ImportError, match=r"onnxruntime.*requirements-serve.txt"):
        export(mlp, out / "none.onnx", "onnx", sample=np.zeros((1, 16, 16, 1)))
    assert not (out / "none.onnx").exists()
    # Without verification the runtime is not needed.
    r = export(mlp, out / "unverified.onnx", "onnx", verify=False, verbose=False)
    assert not r.verified and r.max_abs_diff is None and "not verified" in str(r)


def test_bad_requests_fail_before_anything_is_written(mlp, out):
    x = np.zeros((1, 16, 16, 1), "float32")
    with pytest.raises(ValueError, match=r"unknown format 'pytorch'.*'saved_model', 'onnx'"):
        export(mlp, out / "m", "pytorch", sample=x)
    with pytest.raises(ValueError, match=r"unknown precision 'int8'.*'float16'"):
        export(mlp, out / "m", precision="int8", sample=x)
    with pytest.raises(ValueError, match=r"no bfloat16 weights.*format='saved_model'"):
        export(mlp, out / "m.onnx", "onnx", "bfloat16", sample=x)
    with pytest.raises(ValueError, match=r"ends with '.tflite'.*m.tflite'"):
        export(mlp, out / "m.onnx", "litert", sample=x)
    with pytest.raises(ValueError, match=r"pass sample="):
        export(mlp, out / "m", "saved_model")
    with pytest.raises(TypeError, match=r"keras.Model"):
        export("model.keras", out / "m", sample=x)
    with pytest.raises(TypeError, match=r"format must be a string"):
        export(mlp, out / "m", 3, sample=x)
    assert not (out / "m").exists() and not (out / "m.onnx").exists()


def test_wrong_labels_are_refused(mlp, out):
    with pytest.raises(ValueError, match=r"labels of shape \(3,\) do not fit"):
        export(mlp, out / "l", sample=np.zeros((2, 16, 16, 1)), labels=[0, 1, 2])


def test_plan_routes_and_the_backend():
    assert plan_export("tflite", "float16", "m.tflite").half_pass == "tflite_float16"
    onnx = plan_export("onnx", "float16", "m.onnx")
    assert onnx.keras_policy == "float32" and onnx.runtime == "onnxruntime"
    assert {m for m, _ in onnx.modules} == {
        "tensorflow", "tf2onnx", "onnx", "onnxconverter_common", "onnxruntime"
    }  # fmt: skip
    unverified = plan_export("onnx", "float32", "m.onnx", verify=False)
    assert "onnxruntime" not in {m for m, _ in unverified.modules}
    assert plan_export("tf_saved_model", "bfloat16", "m").keras_policy == "bfloat16"
    with pytest.raises(RuntimeError, match=r"tensorflow backend.*'jax'.*KERAS_BACKEND=tensorflow"):
        plan_export("onnx", "float32", "m.onnx", backend="jax")
    with pytest.raises(RuntimeError, match=r"litert files under the tensorflow backend.*'torch'"):
        plan_export("litert", "float32", "m.tflite", backend="torch")
    from_jax = plan_export("saved_model", "float16", "m", backend="jax")
    assert from_jax.runtime == "TensorFlow" and not from_jax.free_lengths
    assert plan_export("saved_model", "float16", "m").free_lengths
    with pytest.raises(ValueError, match=r"SavedModel is a folder"):
        plan_export("saved_model", "float32", "m.keras")


def test_compare_measures_on_known_numbers():
    ref = np.array([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]])
    got = np.array([[0.6, 0.3, 0.1], [0.1, 0.1, 0.8]])
    c = compare(ref, got, labels=[0, 2])
    assert c.max_abs_diff == pytest.approx(0.1) and c.max_rel_diff == pytest.approx(0.5)
    assert c.top1_agreement == 1.0 and c.accuracy == c.float32_accuracy == 1.0
    tiny = compare(np.array([[1.0, 1e-9]]), np.array([[1.0, 2e-9]]))
    assert tiny.max_rel_diff == pytest.approx(1e-6)  # divided by the floor, 1e-3 of 1.0
    uniform = np.zeros((2, 5, 8))  # logits: perplexity 8
    lm = compare(uniform, uniform + np.eye(8)[None, None, 0] * 1e-3, labels=np.ones((2, 5), int))
    assert lm.float32_perplexity == pytest.approx(8) and 0 < lm.perplexity_diff < 1e-3
    probs = np.full((1, 4), 0.25)
    assert np.allclose(log_probabilities(probs), np.log(0.25))  # read as probabilities
    with pytest.raises(ValueError, match=r"no classes"):
        compare(np.ones((3, 1)), np.ones((3, 1)), labels=[0, 0, 0])
    ids = np.array([[5, 9, 2, 0], [1, 1, 1, 1]], np.int32)  # token ids: equal or not
    c = compare(ids, np.where(ids == 9, 3, ids))
    assert c.identical == 7 / 8 and c.top1_agreement is None and c.max_abs_diff == 6
    assert compare(ids > 1, ids > 1).identical == 1.0  # a mask
    assert compare(ref, got).identical is None  # floats: measured by differences
    with pytest.raises(ValueError, match=r"no classes"):
        compare(ids, ids, labels=[0, 1])  # ids are no classes


def test_blame_finds_the_innermost_layer():
    paths = ["dense", "block", "block/attention", "block/norm", "dense_1"]
    assert blame_layer(["model_1/block_1/attention_2/Erfinv"], paths) == "block/attention"
    assert blame_layer(["model/dense_1/MatMul"], paths) == "dense_1"  # exact name first
    assert blame_layer(["other/Erfinv"], paths) is None
    message = (
        'loc(fused["Erfinv:", "seq/odd_1/Erfinv@__inference_f_1"] at '
        'fused["StatefulPartitionedCall:", "x@y"])'
    )
    assert litert_failed_ops(message) == [("Erfinv", "seq/odd_1/Erfinv")]


def test_the_serving_packages_are_pinned_and_installed_by_setup():
    with open(os.path.join(ROOT, "requirements-serve.txt")) as f:
        pins = {line.split("==")[0] for line in f if "==" in line and not line.startswith("#")}
    assert pins == {"tf2onnx", "onnx", "onnxruntime", "onnxconverter-common", "ai-edge-litert"}
    with open(os.path.join(ROOT, "launch", "setup.sh")) as f:
        assert "requirements-serve.txt" in f.read()


@pytest.mark.parametrize("precision", ["float32", "float16"])
def test_a_model_over_the_limit_keeps_its_tensors_beside_the_file(
    monkeypatch, mlp, digits, out, precision
):
    # The limit lowered to 100 kB (the MLP holds 660 kB of float32 weights): the same
    # route as a model over 2 GiB, whose one protobuf could not hold it.
    import onnx

    from kmp.exporting import onnx_route

    monkeypatch.setattr(onnx_route, "EXTERNAL_DATA_BYTES", 100_000)
    _, _, x_test, y_test = digits
    path = out / f"large_{precision}.onnx"
    r = export(mlp, path, "onnx", precision, sample=x_test, labels=y_test, verbose=False)
    data = out / f"large_{precision}.onnx.data"
    assert data.stat().st_size > 0.9 * (330_000 if precision == "float16" else 660_000)
    assert path.stat().st_size < 20_000  # the graph alone: the tensors are in the data file
    assert r.size_bytes == path.stat().st_size + data.stat().st_size
    graph = onnx.load(str(path), load_external_data=False)
    assert all(t.data_location == onnx.TensorProto.EXTERNAL for t in graph.graph.initializer
               if len(t.dims) == 2)  # fmt: skip
    assert r.top1_agreement == 1.0 and r.max_abs_diff < BOUND[precision]
    if precision == "float16":
        assert r.size_ratio < 0.52
    # Replaced together: both files are the new export's.
    again = export(mlp, path, "onnx", "float32", sample=x_test, overwrite=True, verbose=False)
    assert again.size_bytes == path.stat().st_size + data.stat().st_size
    assert not [p for p in os.listdir(out) if p.startswith(".kmp-export")]
