import json
import subprocess
import sys

import keras
import pytest

import kmp
from kmp.hardware import GPU, Hardware

GPU_HW = Hardware(gpus=(GPU("a100", (8, 0)),))


def softmax_model():
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(3, activation="softmax"),
        ],
        name="planted",
    )


def test_flags_planted_float16_softmax_output():
    kmp.enable("mixed_float16", hardware=GPU_HW)
    report = kmp.audit(softmax_model())
    assert not report.ok
    assert {"low-precision-activation", "low-precision-output"} <= report.codes()
    assert all(f.severity == "error" for f in report.errors)
    text = str(report)
    assert "NOT OK" in text and "float16" in text and "dense_1" in text


def test_passes_model_with_float32_outputs():
    kmp.enable("mixed_float16", hardware=GPU_HW)
    report = kmp.audit(kmp.float32_outputs(softmax_model()))
    assert report.ok, str(report)
    assert report.findings == ()
    row = {r.name: r for r in report.rows}["dense"]
    assert (row.compute_dtype, row.variable_dtype, row.output_dtype) == (
        "float16",
        "float32",
        "float16",
    )


def test_pure_float16_variables_are_an_error():
    keras.config.set_dtype_policy("float16")
    report = kmp.audit(softmax_model())
    assert "low-precision-variables" in report.codes()


def test_policy_mismatch_is_flagged():
    model = softmax_model()  # built under float32
    kmp.enable("mixed_bfloat16", hardware=GPU_HW)  # too late for this model
    report = kmp.audit(model)
    assert "policy-mismatch" in report.codes()
    mismatch = next(f for f in report.findings if f.code == "policy-mismatch")
    assert "call kmp.enable() before building the model" in mismatch.message
    assert report.ok  # a warning, not an error


def test_low_precision_custom_normalization_warns():
    @keras.saving.register_keras_serializable(package="kmp_tests")
    class MyNormalization(keras.layers.Layer):
        def call(self, x):
            mean = keras.ops.mean(x, axis=-1, keepdims=True)
            return x - mean

    kmp.enable("mixed_float16", hardware=GPU_HW)
    inp = keras.Input((4,))
    x = MyNormalization()(keras.layers.Dense(4)(inp))
    x = keras.layers.BatchNormalization()(x)  # upcasts internally: not flagged
    out = kmp.layers.Float32Output()(x)
    report = kmp.audit(keras.Model(inp, out))
    flagged = [f.layer for f in report.findings if f.code == "low-precision-norm"]
    assert len(flagged) == 1 and "my_normalization" in flagged[0]


def test_large_float32_layer_costs_speed_warning():
    kmp.enable("mixed_bfloat16", hardware=GPU_HW)
    inp = keras.Input((512,))
    x = keras.layers.Dense(512, dtype="float32", name="big")(inp)
    out = kmp.layers.Float32Output()(keras.layers.Dense(2)(x))
    report = kmp.audit(keras.Model(inp, out))
    assert [f.layer for f in report.findings if f.code == "float32-large-layer"] == ["big"]


def test_nested_models_are_walked():
    kmp.enable("mixed_float16", hardware=GPU_HW)
    inner = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4)], name="inner")
    inp = keras.Input((4,))
    out = keras.layers.Dense(2, activation="softmax", name="head")(inner(inp))
    report = kmp.audit(keras.Model(inp, out))
    assert "inner/dense" in {r.name for r in report.rows}
    assert not report.ok


def test_report_to_dict_is_json():
    kmp.enable("mixed_float16", hardware=GPU_HW)
    data = json.loads(json.dumps(kmp.audit(softmax_model()).to_dict()))
    assert data["ok"] is False and data["global_policy"] == "mixed_float16"
    assert {f["code"] for f in data["findings"]} >= {"low-precision-output"}


def test_bad_inputs():
    with pytest.raises(TypeError, match="Keras model"):
        kmp.audit("model.keras")
    with pytest.raises(ValueError, match="not built"):
        kmp.audit(keras.Sequential([keras.layers.Dense(1)]))


def _kmp(*args):
    return subprocess.run(
        [sys.executable, "-m", "kmp.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_cli_audit_exit_codes(tmp_path):
    kmp.enable("mixed_float16", hardware=GPU_HW)
    bad = softmax_model()
    good = kmp.float32_outputs(bad)
    bad.save(tmp_path / "bad.keras")
    good.save(tmp_path / "good.keras")
    (tmp_path / "notes.txt").write_text("hi")
    r = _kmp("audit", str(tmp_path / "bad.keras"))
    assert r.returncode == 1, r.stderr
    assert "low-precision-output" in r.stdout
    r = _kmp("audit", "--json", str(tmp_path / "good.keras"))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ok"] is True
    r = _kmp("audit", str(tmp_path / "missing.keras"))
    assert r.returncode == 2 and "no such file" in r.stderr
    r = _kmp("audit", str(tmp_path / "notes.txt"))
    assert r.returncode == 2 and "model.save" in r.stderr


def test_summary_is_the_table_for_small_models_and_short_for_large_ones():
    kmp.enable("mixed_bfloat16", hardware=GPU_HW)
    model = softmax_model()
    report = kmp.audit(model)
    assert report.summary() == str(report)
    short = report.summary(max_rows=1)
    lines = short.splitlines()
    assert lines[0] == str(report).splitlines()[0]  # the verdict
    assert lines[1].startswith(f"{len(report.rows)} layers: ") and "compute in bfloat16" in lines[1]
    assert "------" not in short  # no table
    assert all(f.code in short for f in report.findings)
