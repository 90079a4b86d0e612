"""``tf.keras.mixed_precision``, experimental and current names, beside ``kmp.enable``.

The original (the seed document, section 3)::

    policy = tf.keras.mixed_precision.experimental.Policy('mixed_float16')
    tf.keras.mixed_precision.experimental.set_policy(policy)
    model = tf.keras.Sequential([...])
    model.compile(optimizer='adam', loss='sparse_categorical_crossentropy', metrics=['accuracy'])

What kmp changes, and what a user gets today:

* The experimental names are gone: with TensorFlow 2.21 ``tf.keras`` is Keras 3, and
  ``tf.keras.mixed_precision.experimental`` raises ``AttributeError``. This script shows the
  error, then carries on.
* The current names work: ``tf.keras.mixed_precision.Policy('mixed_float16')`` and
  ``set_global_policy(policy)``. Keras then wraps ``'adam'`` in its own ``LossScaleOptimizer``;
  the softmax must be put in float32 by hand (``dtype='float32'``).
* kmp: ``kmp.enable("mixed_float16")`` sets the same global policy (``kmp.enable()`` alone
  picks one for the hardware, and under ``TF_USE_LEGACY_KERAS=1`` sets tf-keras's too);
  ``kmp.float32_outputs(model)`` puts the head in float32; ``kmp.wrap_optimizer`` gives dynamic
  loss scaling, which in a job of several ranks (``kmp.distributed.init()`` first) also
  averages the gradients over them.

Run it with ``python examples/tf_keras_mixed_precision.py`` (a few seconds on a CPU, where
float16 is slow: ``kmp.enable`` warns so, silenced here); its last line sums it up.
"""

from __future__ import annotations

import os

os.environ["KERAS_BACKEND"] = "tensorflow"  # a TensorFlow example, whatever is set

import warnings

import keras
import numpy as np
import tensorflow as tf

import kmp


def data() -> tuple[np.ndarray, np.ndarray]:
    """64 examples of 8 features, 3 classes."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    return x, (x[:, :3].argmax(axis=1)).astype("int32")


def experimental_names() -> str:
    """The original's two lines; return what happened."""
    try:
        policy = tf.keras.mixed_precision.experimental.Policy("mixed_float16")
        tf.keras.mixed_precision.experimental.set_policy(policy)
    except AttributeError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "set"


def fit(model: keras.Model, optimizer: object) -> tuple[str, float]:
    """Compile as the original does, fit 2 short epochs; return the optimizer class and loss."""
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    x, y = data()
    history = model.fit(x, y, epochs=2, batch_size=16, verbose=0)
    return type(model.optimizer).__name__, float(history.history["loss"][-1])


def body(head_dtype: str | None = None) -> list[keras.layers.Layer]:
    """The layers of the original's ``[...]``: a hidden layer and a softmax head."""
    head = keras.layers.Dense(3, activation="softmax", dtype=head_dtype)
    return [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), head]


def main() -> dict:
    """Try the three spellings; return what each gave."""
    result = {"experimental": experimental_names()}
    print(f"experimental names: {result['experimental']}")

    # The current names: the policy, then the float32 head by hand.
    policy = tf.keras.mixed_precision.Policy("mixed_float16")
    tf.keras.mixed_precision.set_global_policy(policy)
    keras.utils.set_random_seed(0)
    model = tf.keras.Sequential(body(head_dtype="float32"))
    result["current"] = (tf.keras.mixed_precision.global_policy().name, *fit(model, "adam"))
    print(f"current names: policy {result['current'][0]}, optimizer {result['current'][1]}")
    tf.keras.mixed_precision.set_global_policy("float32")

    # kmp.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "float16 on a CPU is slow": known here
        choice = kmp.enable("mixed_float16")
    keras.utils.set_random_seed(0)
    model = kmp.float32_outputs(keras.Sequential(body()))
    opt = kmp.wrap_optimizer(keras.optimizers.Adam())
    name, loss = fit(model, opt)
    result["kmp"] = {
        "policy": choice.name,
        "optimizer": name,
        "loss_scale": opt.loss_scale,
        "output_dtype": str(model.outputs[0].dtype),
        "hidden_dtype": model.layers[0].compute_dtype,
        "loss": loss,
    }
    k = result["kmp"]
    print(
        f"kmp: policy {k['policy']} (hidden layer computes in {k['hidden_dtype']}, output "
        f"{k['output_dtype']}), optimizer {k['optimizer']}, loss scale {k['loss_scale']:g}, "
        f"loss {k['loss']:.3f}",
        flush=True,
    )
    return result


if __name__ == "__main__":
    main()
