"""Shared fixtures: every test starts from Keras's default policy; a launcher test script.

Helpers shared by many tests (the repository root, fake GPUs, the multi-process runner) are in
tests/_support.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Keep TensorFlow quiet in every process the tests start.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


@pytest.fixture
def script(tmp_path) -> Path:
    """A training script for launcher tests: it exists and prints one line."""
    path = tmp_path / "train.py"
    path.write_text("print('hello')\n")
    return path


@pytest.fixture(autouse=True)
def _reset_keras_global_state(monkeypatch):
    """Every test starts and ends with Keras's default float32 policy and no KMP_POLICY."""
    import keras

    monkeypatch.delenv("KMP_POLICY", raising=False)
    keras.config.set_dtype_policy("float32")
    yield
    keras.config.set_dtype_policy("float32")
    keras.backend.clear_session(free_memory=False)  # the full gc it does by default costs ~1 s
