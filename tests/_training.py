"""Small Keras models and data for the optimizer tests (tests/test_*optimizer*.py)."""

from __future__ import annotations

import keras
import numpy as np


def data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype("float32")
    y = (x[:, :4].argmax(1)).astype("int32")
    return x, y


def model_for(policy, seed=1):
    keras.config.set_dtype_policy(policy)
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(4),
            keras.layers.Activation("softmax", dtype="float32"),
        ]
    )


def fit(model, opt, x, y, *, batch=16, epochs=1, callbacks=None):
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", jit_compile=False)
    model.fit(x, y, batch_size=batch, epochs=epochs, verbose=0, shuffle=False, callbacks=callbacks)
    return model


def max_diff(a, b):
    pairs = zip(a, b, strict=True)
    return max(float(np.max(np.abs(np.asarray(u) - np.asarray(v)))) for u, v in pairs)


class Weights(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.rows = [self.model.get_weights()]

    def on_train_batch_end(self, batch, logs=None):
        self.rows.append(self.model.get_weights())
