import keras
import numpy as np
import pytest

import kmp
from kmp.hardware import GPU, Hardware
from kmp.layers import Float32Output

GPU_HW = Hardware(gpus=(GPU("v100", (7, 0)),))


def sequential(activation="softmax"):
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(3, activation=activation),
        ],
        name="seq",
    )


def test_float32_output_layer_casts_and_activates_in_float32():
    kmp.enable("mixed_float16", hardware=GPU_HW)
    layer = Float32Output("softmax")
    assert layer.compute_dtype == "float32"
    logits = keras.ops.convert_to_tensor(np.array([[1.0, 2.0, 3.0]], "float16"))
    out = layer(logits)
    assert out.dtype == "float32"
    np.testing.assert_allclose(keras.ops.sum(out, axis=-1), [1.0], rtol=1e-6)


def test_float32_output_config_round_trip():
    layer = Float32Output("sigmoid", name="head")
    clone = Float32Output.from_config(layer.get_config())
    assert clone.name == "head"
    assert clone.dtype_policy.name == "float32"
    assert keras.activations.serialize(clone.activation) == "sigmoid"


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_sequential_softmax_is_computed_in_float32_from_logits(policy):
    kmp.enable(policy, hardware=GPU_HW)
    model = sequential()
    fixed = kmp.float32_outputs(model)
    assert fixed.outputs[0].dtype == "float32"
    # The Dense head now produces logits and Float32Output applies the softmax.
    head = fixed.layers[-1]
    assert isinstance(head, Float32Output)
    assert keras.activations.serialize(head.activation) == "softmax"
    assert keras.activations.serialize(fixed.get_layer("dense_1").activation) == "linear"
    x = np.random.default_rng(0).normal(size=(4, 6)).astype("float32")
    # Same weights: the probabilities match the original model's up to low-precision rounding.
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(fixed(x)),
        keras.ops.convert_to_numpy(model(x)).astype("float32"),
        atol=2e-2,
    )
    # The original model is not modified.
    assert keras.activations.serialize(model.layers[-1].activation) == "softmax"
    assert kmp.audit(fixed).ok


def test_functional_with_activation_layer_is_replaced():
    kmp.enable("mixed_float16", hardware=GPU_HW)
    inp = keras.Input((5,))
    h = keras.layers.Dense(1, name="logit")(inp)
    out = keras.layers.Activation("sigmoid", name="prob")(h)
    model = keras.Model(inp, out)
    fixed = kmp.float32_outputs(model)
    names = [layer.name for layer in fixed.layers]
    assert "prob" not in names and "prob_float32" in names
    assert fixed.outputs[0].dtype == "float32"
    np.testing.assert_array_equal(
        fixed.get_layer("logit").get_weights()[0], model.get_layer("logit").get_weights()[0]
    )


def test_multi_output_functional():
    kmp.enable("mixed_bfloat16", hardware=GPU_HW)
    inp = keras.Input((4,))
    h = keras.layers.Dense(8)(inp)
    a = keras.layers.Dense(3, activation="softmax", name="cls")(h)
    b = keras.layers.Dense(1, name="reg")(h)
    fixed = kmp.float32_outputs(keras.Model(inp, [a, b]))
    assert [str(t.dtype) for t in fixed.outputs] == ["float32", "float32"]
    assert kmp.audit(fixed).ok


def test_idempotent():
    kmp.enable("mixed_float16", hardware=GPU_HW)
    once = kmp.float32_outputs(sequential())
    assert kmp.float32_outputs(once) is once


def test_float32_model_is_returned_unchanged():
    model = sequential()
    assert kmp.float32_outputs(model) is model


def test_subclassed_model_gets_a_clear_error():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.d = keras.layers.Dense(2)

        def call(self, x):
            return self.d(x)

    net = Net()
    net(np.ones((1, 3), "float32"))
    with pytest.raises(TypeError, match="Float32Output"):
        kmp.float32_outputs(net)


def test_non_model_gets_a_clear_error():
    with pytest.raises(TypeError, match="Sequential or Functional"):
        kmp.float32_outputs(keras.layers.Dense(3))


def test_unbuilt_sequential_gets_a_clear_error():
    with pytest.raises(ValueError, match="input shape"):
        kmp.float32_outputs(keras.Sequential([keras.layers.Dense(2)]))


def test_saved_model_with_float32_output_loads(tmp_path):
    kmp.enable("mixed_bfloat16", hardware=GPU_HW)
    fixed = kmp.float32_outputs(sequential())
    path = tmp_path / "m.keras"
    fixed.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded.layers[-1], Float32Output)
    x = np.ones((2, 6), "float32")
    np.testing.assert_allclose(loaded(x), fixed(x))
