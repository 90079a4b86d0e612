import subprocess
import sys

import keras
import numpy as np
import pytest

import kmp
from kmp.hardware import GPU, Hardware


def test_load_model_in_a_fresh_process(tmp_path):
    kmp.enable("mixed_float16", hardware=Hardware(gpus=(GPU("v100", (7, 0)),)))
    model = kmp.float32_outputs(
        keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])
    )
    model.compile(optimizer=kmp.wrap_optimizer(keras.optimizers.SGD(0.1)), loss="mse")
    model.fit(np.ones((8, 4), "float32"), np.ones((8, 3), "float32"), verbose=0)
    path = tmp_path / "m.keras"
    model.save(path)
    code = (
        "import sys, kmp; m = kmp.load_model(sys.argv[1]); "
        "print(type(m.layers[-1]).__name__, type(m.optimizer).__name__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    head, opt = out.stdout.split()[-2:]
    assert head == "Float32Output"
    assert (
        isinstance(model.optimizer, type(model.optimizer)) and opt == type(model.optimizer).__name__
    )


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="No saved model"):
        kmp.load_model(tmp_path / "nope.keras")
