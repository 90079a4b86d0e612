import subprocess
import sys

import keras
import numpy as np
import pytest

import kmp
from kmp.hardware import GPU, Hardware


@pytest.mark.parametrize(
    "load",
    [
        "import kmp; m = kmp.load_model(p)",
        "import keras, kmp.saving; m = keras.saving.load_model(p)",
    ],
    ids=["kmp.load_model", "keras.saving.load_model"],
)
def test_load_model_in_a_fresh_process(tmp_path, load):
    """kmp's loader, or Keras's after the one import that registers every kmp class."""
    kmp.enable("mixed_float16", hardware=Hardware(gpus=(GPU("v100", (7, 0)),)))
    model = kmp.float32_outputs(
        keras.Sequential(
            [
                keras.Input((4,)),
                keras.layers.Dense(4, name="d"),
                keras.layers.Dense(3, activation="softmax"),
            ]
        )
    )
    kmp.keep_float32(model, "d")
    model.compile(optimizer=kmp.wrap_optimizer(keras.optimizers.SGD(0.1)), loss="mse")
    model.fit(np.ones((8, 4), "float32"), np.ones((8, 3), "float32"), verbose=0)
    path = tmp_path / "m.keras"
    kmp.save_model(model, path)
    code = (
        f"import sys; p = sys.argv[1]; {load}; o = m.optimizer; "
        "print(type(m.layers[-1]).__name__, type(o).__name__, int(o.iterations), o.loss_scale, "
        "type(m.get_layer('d').dtype_policy).__name__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    head, opt, steps, scale, kept = out.stdout.split()[-5:]
    assert head == "Float32Output" and opt == "DistributedLossScaleOptimizer"
    assert (int(steps), float(scale)) == (1, model.optimizer.loss_scale)  # the state came back
    assert kept == "KeptFloat32"


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="No saved model"):
        kmp.load_model(tmp_path / "nope.keras")
