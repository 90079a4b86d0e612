"""A step that never scaled its loss is refused (kmp/scale_guard.py), on both backends.

The steps are written as keras.io teaches them ("Customizing what happens in fit()" for
TensorFlow and JAX, the DCGAN example, "Writing a training loop from scratch"), with the one
line kmp asks for (``optimizer.scale_loss``) switched on or off.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import kmp
from kmp.scale_guard import STALE_SCALE, UNSCALED, judge, stale_scale

TF = keras.backend.backend() == "tensorflow"
# float16 on a CPU is slow, and kmp says so; these tests want its numerics.
pytestmark = pytest.mark.filterwarnings("ignore:Policy 'mixed_float16' computes in float16")
on_tf = pytest.mark.skipif(not TF, reason="a tf.GradientTape step")


@pytest.mark.parametrize(
    ("pending", "trusted", "verdict"),
    [
        (True, False, None),  # scaled, then applied
        (False, False, UNSCALED),  # never scaled
        (False, True, None),  # scaled in another compiled function once: unseen since
    ],
)
def test_judge(pending, trusted, verdict):
    assert judge(scaling=True, pending=pending, trusted=trusted) == verdict
    assert judge(scaling=False, pending=pending, trusted=trusted) is None  # nothing to judge


def test_stale_scale():
    jax_traced = {"backend": "jax", "dynamic": True, "traced": True}
    assert stale_scale(**jax_traced, in_state=False) == STALE_SCALE
    assert stale_scale(**jax_traced, in_state=True) is None  # Keras's trainer's way
    assert stale_scale(**{**jax_traced, "traced": False}, in_state=False) is None  # stateful
    assert stale_scale(**{**jax_traced, "dynamic": False}, in_state=False) is None  # a constant
    assert stale_scale(**{**jax_traced, "backend": "tensorflow"}, in_state=False) is None


def digits(n=512):
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return (x[:n] / 16.0).astype("float32"), y[:n].astype("int32")


def tf_step_model(scale: bool, apply_gradients: bool = False) -> type:
    import tensorflow as tf

    class CustomModel(keras.Model):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(y=y, y_pred=y_pred)
                target = self.optimizer.scale_loss(loss) if scale else loss
            grads = tape.gradient(target, self.trainable_variables)
            if apply_gradients:
                self.optimizer.apply_gradients(zip(grads, self.trainable_variables, strict=True))
            else:
                self.optimizer.apply(grads, self.trainable_variables)
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss)
                else:
                    metric.update_state(y, y_pred)
            return {m.name: m.result() for m in self.metrics}

    return CustomModel


def jax_step_model(scale: bool, scope: bool = True) -> type:
    import jax

    class CustomModel(keras.Model):
        def compute_loss_and_updates(self, trainable, non_trainable, optimizer_vars, x, y):
            y_pred, non_trainable = self.stateless_call(trainable, non_trainable, x, training=True)
            loss = self.compute_loss(x, y, y_pred)
            if scale and scope:
                mapping = list(zip(self.optimizer.variables, optimizer_vars, strict=True))
                with keras.StatelessScope(state_mapping=mapping):
                    loss = self.optimizer.scale_loss(loss)
            elif scale:
                loss = self.optimizer.scale_loss(loss)
            return loss, non_trainable

        def train_step(self, state, data):
            trainable, non_trainable, optimizer_vars, metrics_vars = state
            x, y = data
            grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
            (loss, non_trainable), grads = grad_fn(trainable, non_trainable, optimizer_vars, x, y)
            trainable, optimizer_vars = self.optimizer.stateless_apply(
                optimizer_vars, grads, trainable
            )
            return {"loss": loss}, (trainable, non_trainable, optimizer_vars, metrics_vars)

    return CustomModel


def custom_model(cls: type) -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((64,))
    hidden = keras.layers.Dense(32, activation="relu")(inputs)
    outputs = keras.layers.Activation("softmax", dtype="float32")(keras.layers.Dense(10)(hidden))
    return cls(inputs, outputs)


def fit_custom(cls: type, policy: str, epochs: int = 1, jit_compile: bool | str = "auto"):
    kmp.enable(policy)
    model = custom_model(cls)
    opt = kmp.wrap_optimizer(keras.optimizers.SGD(0.3))
    model.compile(opt, "sparse_categorical_crossentropy", jit_compile=jit_compile)
    x, y = digits()
    model.fit(x, y, batch_size=32, epochs=epochs, verbose=0)
    return model, opt, float((model.predict(x, verbose=0).argmax(-1) == y).mean())


def keras_io_step(scale: bool, **kwargs) -> type:
    return tf_step_model(scale, **kwargs) if TF else jax_step_model(scale)


@pytest.mark.parametrize("apply_gradients", [False, True], ids=["apply", "apply_gradients"])
def test_a_keras_io_train_step_that_never_scales_is_refused(apply_gradients):
    if apply_gradients and not TF:
        pytest.skip("JAX steps apply through stateless_apply")
    cls = keras_io_step(False, apply_gradients=apply_gradients) if TF else keras_io_step(False)
    with pytest.raises(RuntimeError, match=r"never called its scale_loss\(\)") as caught:
        fit_custom(cls, "mixed_float16")
    assert "scale_loss(loss)" in str(caught.value)  # it shows the line to add


def test_the_same_step_scaling_its_loss_trains_like_float32():
    _, opt, mixed = fit_custom(keras_io_step(True), "mixed_float16", epochs=4)
    assert opt.loss_scale_mode == "dynamic" and opt.loss_scale >= 2.0**15
    _, _, exact = fit_custom(keras_io_step(True), "float32", epochs=4)
    assert mixed > 0.9 and abs(mixed - exact) <= 0.01  # 0.955 both, measured


def test_without_scaling_nothing_is_judged():
    _, opt, _ = fit_custom(keras_io_step(False), "mixed_bfloat16")
    assert opt.loss_scale_mode == "none" and int(opt.iterations) == 16


@on_tf
def test_an_xla_compiled_step_is_refused_while_traced():
    with pytest.raises(RuntimeError, match="never called its scale_loss"):
        fit_custom(keras_io_step(False), "mixed_float16", jit_compile=True)


@pytest.mark.skipif(TF, reason="a JAX stateless step")
def test_a_jax_step_reading_the_scale_outside_its_state_is_refused():
    with pytest.raises(RuntimeError, match="frozen when the step was traced"):
        fit_custom(jax_step_model(True, scope=False), "mixed_float16")


@on_tf
def test_a_gan_judges_each_optimizer_on_its_own():
    import tensorflow as tf

    class GAN(keras.Model):  # keras.io's DCGAN, small
        def __init__(self, scale_generator: bool):
            super().__init__()
            self.d = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, dtype="float32")])
            self.g = keras.Sequential([keras.Input((2,)), keras.layers.Dense(4)])
            self.scale_generator = scale_generator

        def compile(self, d_optimizer, g_optimizer):
            super().compile()
            self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer

        def train_step(self, real):
            bce = keras.losses.BinaryCrossentropy(from_logits=True)
            noise = tf.random.normal((tf.shape(real)[0], 2))
            with tf.GradientTape() as tape:
                fake, real_logits = self.g(noise), self.d(real)
                d_loss = bce(tf.ones_like(real_logits), real_logits) + bce(
                    tf.zeros_like(real_logits), self.d(fake)
                )
                d_scaled = self.d_optimizer.scale_loss(d_loss)
            grads = tape.gradient(d_scaled, self.d.trainable_weights)
            self.d_optimizer.apply_gradients(zip(grads, self.d.trainable_weights, strict=True))
            with tf.GradientTape() as tape:
                logits = self.d(self.g(noise))
                g_loss = bce(tf.ones_like(logits), logits)
                if self.scale_generator:
                    g_loss = self.g_optimizer.scale_loss(g_loss)
            grads = tape.gradient(g_loss, self.g.trainable_weights)
            self.g_optimizer.apply_gradients(zip(grads, self.g.trainable_weights, strict=True))
            return {"d_loss": d_loss}

    kmp.enable("mixed_float16")
    real = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    for scale_generator in (False, True):
        gan = GAN(scale_generator)
        d_opt = kmp.wrap_optimizer(keras.optimizers.Adam(1e-3, name="discriminator_adam"))
        g_opt = kmp.wrap_optimizer(keras.optimizers.Adam(1e-3, name="generator_adam"))
        gan.compile(d_opt, g_opt)
        if not scale_generator:
            with pytest.raises(RuntimeError, match="around 'generator_adam' was asked"):
                gan.fit(real, batch_size=16, epochs=1, verbose=0)
            continue
        gan.fit(real, batch_size=16, epochs=1, verbose=0)
        assert int(d_opt.iterations) == int(g_opt.iterations) == 4


@on_tf
def test_a_custom_loop_is_judged_on_its_first_step_and_may_scale_in_a_tf_function():
    import tensorflow as tf

    kmp.enable("mixed_float16")
    model = custom_model(keras.Model)
    opt = kmp.wrap_optimizer(keras.optimizers.SGD(0.05))
    x, y = digits(64)
    loss_fn = keras.losses.SparseCategoricalCrossentropy()
    before = model.get_weights()
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    with pytest.raises(RuntimeError, match="never called its scale_loss"):
        opt.apply(grads, model.trainable_variables)
    for a, b in zip(model.get_weights(), before, strict=True):
        np.testing.assert_array_equal(a, b)  # refused before anything moved

    @tf.function
    def scaled_grads(x, y):  # scaled where the user computes gradients, applied eagerly
        with tf.GradientTape() as tape:
            scaled = opt.scale_loss(loss_fn(y, model(x, training=True)))
        return tape.gradient(scaled, model.trainable_variables)

    for _ in range(3):  # traced once: later steps are trusted, not refused
        opt.apply(scaled_grads(x, y), model.trainable_variables)
    assert int(opt.iterations) == 3 and opt.skipped_steps == 0
