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


@keras.saving.register_keras_serializable(package="kmp_tests")
class Net(keras.Model):
    """A subclassed model: two Dense layers, logits out, in Python code."""

    def __init__(self, units=3, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.head = keras.layers.Dense(units)

    def call(self, x):
        return self.head(self.hidden(x))

    def get_config(self):
        return {**super().get_config(), "units": self.units}


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_subclassed_model_gets_float32_outputs_in_place(policy, tmp_path):
    kmp.enable(policy, hardware=GPU_HW)
    net = Net(name="net")
    x = np.random.default_rng(0).normal(size=(4, 6)).astype("float32")
    before = keras.ops.convert_to_numpy(net(x))
    assert str(before.dtype) in ("float16", "bfloat16")
    assert not kmp.layers.has_float32_outputs(net)

    fixed = kmp.float32_outputs(net)
    assert fixed is net  # changed in place: same object, layers and weights
    assert isinstance(net, Net) and type(net).__name__ == "Net"
    assert kmp.layers.has_float32_outputs(net)
    assert net.head.compute_dtype == keras.config.dtype_policy().compute_dtype  # still 16-bit
    out = keras.ops.convert_to_numpy(net(x))
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, before.astype("float32"))  # a cast, nothing else
    assert net.predict(x, verbose=0).dtype == np.float32
    # Twice changes nothing (the class is not wrapped again).
    cls = type(net)
    assert kmp.float32_outputs(net) is net and type(net) is cls

    net.compile(optimizer=kmp.wrap_optimizer(keras.optimizers.SGD(0.1)), loss="mse")
    history = net.fit(x, np.zeros((4, 3), "float32"), epochs=2, batch_size=4, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert history.history["loss"][1] < history.history["loss"][0]

    path = tmp_path / "net.keras"
    net.save(path)
    loaded = kmp.load_model(path)
    assert isinstance(loaded, Net) and kmp.layers.has_float32_outputs(loaded)
    assert loaded.units == 3
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(loaded(x)), keras.ops.convert_to_numpy(net(x))
    )
    assert kmp.audit(loaded).ok


def test_subclassed_float32_model_is_returned_unchanged():
    net = Net()
    net(np.ones((1, 6), "float32"))
    assert kmp.float32_outputs(net) is net
    assert type(net) is Net and not kmp.layers.has_float32_outputs(net)


def test_float32_outputs_casts_only_16bit_floats():
    kmp.enable("mixed_bfloat16", hardware=GPU_HW)

    class TwoOutputs(keras.Model):
        def __init__(self):
            super().__init__()
            self.d = keras.layers.Dense(2)

        def call(self, x):
            logits = self.d(x)
            return {"logits": logits, "ids": keras.ops.argmax(logits, axis=-1)}

    model = kmp.float32_outputs(TwoOutputs())
    out = model(np.ones((3, 4), "float32"))
    assert out["logits"].dtype == "float32"
    assert "int" in str(out["ids"].dtype)


def test_non_model_gets_a_clear_error():
    with pytest.raises(TypeError, match="expects a Keras model"):
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
