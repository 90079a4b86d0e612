"""The core (policies, float32 outputs, audit) runs on Keras's JAX backend too.

Keras fixes its backend per process, so the core test modules are run again
in a child pytest with ``KERAS_BACKEND=jax``, less the tests marked
``backend_agnostic`` (no code path of theirs differs by backend beyond what the
rest of their module reruns: the KerasHub variety, most of the optimizer
variety, byte counts).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.suites import JAX_RERUN

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("KERAS_BACKEND", "tensorflow") == "jax", reason="already on the JAX backend"
)
def test_core_tests_pass_on_jax_backend():
    pytest.importorskip("jax")
    env = {**os.environ, "KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            *JAX_RERUN,
            "-m",
            "not distributed and not backend_agnostic",
            "-k",
            "not cli",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-8000:] + r.stderr[-4000:]
    assert " passed" in r.stdout and " failed" not in r.stdout
    # The child really ran on JAX.
    probe = subprocess.run(
        [sys.executable, "-c", "import keras; print(keras.backend.backend())"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert probe.stdout.strip().splitlines()[-1] == "jax"
