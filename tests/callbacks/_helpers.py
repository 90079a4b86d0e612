"""Shared helpers for the kmp.callbacks tests: small data, a small model, a log recorder.

Imported as ``from tests.callbacks._helpers import ...``.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import kmp.distributed

STEPS = 4  # batches per epoch in the small fits
BATCH = 8


def make_data(n: int = STEPS * BATCH, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5]], dtype="float32")).astype("float32")
    return x, y


def make_model(optimizer: keras.optimizers.Optimizer | None = None, seed: int = 1) -> keras.Model:
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    model.compile(optimizer=optimizer or keras.optimizers.SGD(0.01), loss="mse")
    return model


class Recorder(keras.callbacks.Callback):
    """Records the learning rate at each batch start and copies of the logs."""

    def __init__(self):
        super().__init__()
        self.lrs: list[float] = []
        self.batch_logs: list[dict] = []
        self.epoch_logs: list[dict] = []

    def on_train_batch_begin(self, batch, logs=None):
        self.lrs.append(float(np.asarray(self.model.optimizer.learning_rate)))

    def on_train_batch_end(self, batch, logs=None):
        self.batch_logs.append(dict(logs or {}))

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_logs.append(dict(logs or {}))


def pretend_not_chief(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend to be rank 1 of 2 (for a module's ``not_chief`` fixture)."""
    monkeypatch.setattr(kmp.distributed, "rank", lambda: 1)
    monkeypatch.setattr(kmp.distributed, "is_chief", lambda: False)
