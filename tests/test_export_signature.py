"""kmp.export with several inputs and outputs: named, fed from the sample, every output compared.

The model takes a dict (float features and integer token ids, as a KerasHub task takes
``token_ids`` and ``padding_mask``) and returns a dict of two heads; each format's file is
run in its runtime and every output compared with float32 Keras. The pure parts
(:mod:`kmp.exporting.signature`) are tested on their own.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

from kmp.exporting import export
from kmp.exporting.signature import align_outputs, feed, name_outputs, signature_of
from tests.test_export import pytestmark as _export_marks

pytestmark = _export_marks
SUFFIX = {"saved_model": "", "onnx": ".onnx", "litert": ".tflite"}


@pytest.fixture(scope="module")
def two_in_two_out():
    """``{"features": float [b, 6], "token_ids": int32 [b, seq]}`` -> ``{"label", "score"}``."""
    keras.utils.set_random_seed(0)
    features = keras.Input((6,), name="features")
    ids = keras.Input((None,), dtype="int32", name="token_ids")
    pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(50, 8)(ids))
    joined = keras.layers.Concatenate()([keras.layers.Dense(8)(features), pooled])
    hidden = keras.layers.Dense(32, activation="relu")(joined)
    outputs = {
        "score": keras.layers.Dense(1, name="score")(hidden),
        "label": keras.layers.Dense(4, activation="softmax", name="label")(hidden),
    }
    return keras.Model({"token_ids": ids, "features": features}, outputs)


@pytest.fixture(scope="module")
def sample():
    rng = np.random.default_rng(0)
    return {
        "features": rng.normal(size=(16, 6)).astype("float64"),  # served as float32
        "token_ids": rng.integers(0, 50, size=(16, 9)),  # int64, served as int32
    }


def test_the_signature_names_every_input_and_output(two_in_two_out, sample):
    sig = signature_of(two_in_two_out, None)
    assert sig.structure == "dict"
    assert {(s.name, s.shape, s.dtype) for s in sig.inputs} == {
        ("features", (None, 6), "float32"),
        ("token_ids", (None, None), "int32"),  # the sequence length stays free
    }
    fed = feed(sample, sig)
    assert {k: v.dtype.name for k, v in fed.items()} == {
        "features": "float32",
        "token_ids": "int32",
    }
    outputs = name_outputs(two_in_two_out(sig.pack(list(fed.values()))))
    assert list(outputs) == ["label", "score"]  # sorted, as Keras and TensorFlow flatten
    assert outputs["label"].shape == (16, 4) and outputs["score"].shape == (16, 1)
    # Under JAX the free sequence length is fixed to the sample's (the batch stays free).
    fixed = {s.name: s.shape for s in sig.with_lengths(fed).inputs}
    assert fixed == {"features": (None, 6), "token_ids": (None, 9)}
    # A single-input model takes its batch as it is, in a list or under any one name.
    one = signature_of(keras.Sequential([keras.Input((6,)), keras.layers.Dense(2)]), None)
    assert one.names == ("inputs",) and one.structure == "single"
    x = sample["features"]
    for given in (x, [x], {"image": x}):
        assert np.array_equal(feed(given, one)["inputs"], x.astype("float32"))
    # A tuple in the model's input order feeds the same arrays.
    in_order = tuple(sample[name] for name in sig.names)
    assert all(np.array_equal(feed(in_order, sig)[n], fed[n]) for n in sig.names)


def test_align_outputs_by_name_else_in_order():
    a, b = np.zeros(1), np.ones(1)
    assert align_outputs(["x", "y"], ["y", "x"], [b, a])["x"] is not None
    assert align_outputs(["x", "y"], ["y", "x"], [b, a])["y"][0] == 1
    assert align_outputs(["x", "y"], ["Identity:0", "Identity_1:0"], [a, b])["y"][0] == 1
    with pytest.raises(ValueError, match=r"returned 1 outputs, the Keras model 2"):
        align_outputs(["x", "y"], ["x"], [a])


@pytest.mark.parametrize("fmt", list(SUFFIX))
def test_every_input_fed_and_every_output_compared(two_in_two_out, sample, fmt, tmp_path):
    result = export(
        two_in_two_out, tmp_path / f"m{SUFFIX[fmt]}", fmt, "float16", sample=sample,
        verbose=False,
    )  # fmt: skip
    assert list(result.outputs) == ["label", "score"]
    assert result.comparison == result.outputs["label"]
    assert result.input_dtype in ("float32, int32", "int32, float32")
    assert result.output_dtype == "float32"
    for name, measured in result.outputs.items():
        assert measured.samples == 16
        assert 0 < measured.max_abs_diff < 2e-2, name  # float16 weights: small, not zero
    assert result.outputs["label"].top1_agreement >= 0.9
    assert result.outputs["score"].top1_agreement is None  # one value: no classes
    text = str(result)
    assert "2 outputs" in text and "output 'score'" in text
    assert set(result.to_dict()["outputs"]) == {"label", "score"}


def test_bad_samples_say_which_input(two_in_two_out, sample, tmp_path):
    path = tmp_path / "m.onnx"
    with pytest.raises(ValueError, match=r"missing: \['token_ids'\]"):
        export(two_in_two_out, path, "onnx", sample={"features": sample["features"]})
    with pytest.raises(ValueError, match=r"unknown: \['ids'\]"):
        export(two_in_two_out, path, "onnx", sample={**sample, "ids": sample["token_ids"]})
    floats = {**sample, "token_ids": sample["token_ids"] + 0.5}
    with pytest.raises(ValueError, match=r"input 'token_ids' takes int32, the sample gives float"):
        export(two_in_two_out, path, "onnx", sample=floats)
    with pytest.raises(TypeError, match=r"holds strings.*preprocessor"):
        export(two_in_two_out, path, "onnx", sample={**sample, "token_ids": ["a b"] * 16})
    with pytest.raises(ValueError, match=r"takes 2 inputs .* one ndarray"):
        export(two_in_two_out, path, "onnx", sample=sample["features"])
    wide = {**sample, "features": np.zeros((16, 7))}
    with pytest.raises(ValueError, match=r"input 'features' takes shape \(None, 6\)"):
        export(two_in_two_out, path, "onnx", sample=wide)
    short = {**sample, "token_ids": sample["token_ids"][:3]}
    with pytest.raises(ValueError, match=r"different batch sizes"):
        export(two_in_two_out, path, "onnx", sample=short)
    assert not path.exists()
