"""kmp.xla.jit_gradients: XLA for forward and backward, the optimizer outside it."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import kmp
from kmp.xla import jit_gradients, step_jit_compile


def _model(seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(3),
            keras.layers.Activation("softmax", dtype="float32"),
        ]
    )


def _data(n: int = 64) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 6)).astype("float32")
    return x, (x[:, 0] > 0).astype("int32") + (x[:, 1] > 0).astype("int32")


def _compiled(model: keras.Model, **kwargs) -> keras.Model:
    model.compile(
        optimizer=kmp.wrap_optimizer(keras.optimizers.Adam(1e-2), **kwargs),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
        jit_compile=False,
    )
    return model


def _xla_traces(model: keras.Model) -> int:
    """How often the XLA-compiled part of the step was traced (0: never used)."""
    compiled = model.train_step.xla_function
    assert compiled._jit_compile is True
    return compiled.experimental_get_tracing_count()


def test_training_matches_the_step_without_xla():
    x, y = _data()
    plain = _compiled(_model())
    fast = jit_gradients(_compiled(_model()))
    h1 = plain.fit(x, y, batch_size=16, epochs=3, verbose=0, shuffle=False)
    h2 = fast.fit(x, y, batch_size=16, epochs=3, verbose=0, shuffle=False)
    for a, b in zip(plain.get_weights(), fast.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4)
    np.testing.assert_allclose(h1.history["loss"], h2.history["loss"], rtol=1e-4)
    assert h2.history["loss"][-1] < h2.history["loss"][0]
    assert "accuracy" in h2.history
    assert _xla_traces(fast) >= 1  # the step ran through the XLA function
    assert not hasattr(plain.train_step, "xla_function")


def test_an_overflowing_step_is_still_skipped():
    x, y = _data(32)
    x[16:] = 1e30  # the second batch overflows float16
    with kmp.policy_scope("mixed_float16"):
        model = jit_gradients(_compiled(_model()))
        start = model.get_weights()
        model.fit(x[:16], y[:16], batch_size=16, epochs=1, verbose=0)
        after_good = model.get_weights()
        model.fit(x[16:], y[16:], batch_size=16, epochs=1, verbose=0)
    opt = model.optimizer
    assert opt.skipped_steps == 1 and opt.loss_scale == 2.0**14
    assert any(np.abs(a - b).max() > 0 for a, b in zip(start, after_good, strict=True))
    for a, b in zip(after_good, model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_bad_models_are_refused_before_anything_is_traced():
    with pytest.raises(TypeError, match="compiled Keras 3 model"):
        jit_gradients(lambda x: x)
    with pytest.raises(ValueError, match="Compile the model first"):
        jit_gradients(_model())
    model = _model()
    model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    with pytest.raises(ValueError, match="jit_compile=False"):
        jit_gradients(model)


def test_jit_gradients_is_reachable_from_kmp():
    assert kmp.xla.jit_gradients is jit_gradients


def test_step_jit_compile_is_one_rule_per_backend():
    assert step_jit_compile("tensorflow") is False  # Horovod's ops: no XLA kernels
    assert step_jit_compile("jax") is True  # else Keras runs each JAX step op by op
    assert step_jit_compile() is (keras.backend.backend() == "jax")
    with pytest.raises(TypeError, match="backend name"):
        step_jit_compile(3)


def test_fused_gives_the_functions_result_compiled_into_one_xla_call():
    import tensorflow as tf

    from kmp.xla import fused

    add_twice = fused(lambda a, b, scale: keras.ops.add(keras.ops.multiply(a, scale), b))
    weight = keras.Variable(np.ones(4, "float32"))  # variables are read, not traced by identity
    out = add_twice(weight, np.arange(4, dtype="float32"), -2.0)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(out), [-2.0, -1.0, 0.0, 1.0])
    graph = (
        tf.function(lambda x: add_twice(x, x, 1.0))
        .get_concrete_function(tf.TensorSpec([4], tf.float32))
        .graph
    )
    compiled = [
        op
        for op in graph.get_operations()
        if "_XlaMustCompile" in op.node_def.attr and op.node_def.attr["_XlaMustCompile"].b
    ]
    assert len(compiled) == 1  # one call, compiled whole, inside the caller's graph
