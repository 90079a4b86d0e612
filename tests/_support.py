"""What many tests share: the repository root, fake GPUs, and a runner for real multi-process jobs.

Imported as ``from tests._support import ...`` (fixtures live in conftest.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).resolve().parent / "distributed"


# ------------------------------------------------------- GPUs on a machine without one


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    name: str
    device_type: str = "GPU"


def gpus(n: int) -> list[FakeDevice]:
    """``n`` described GPUs, as tf.config.list_physical_devices("GPU") would list them."""
    return [FakeDevice(f"/physical_device:GPU:{i}") for i in range(n)]


class FakeTFConfig:
    """Records the tf.config calls; can raise like TensorFlow after initialisation."""

    @dataclasses.dataclass(frozen=True)
    class LogicalDeviceConfiguration:
        memory_limit: int

    def __init__(self, raise_on: str | None = None):
        self.calls: list[tuple] = []
        self.raise_on = raise_on
        outer = self

        class _Experimental:
            def set_memory_growth(self, dev, enable):
                outer._call("set_memory_growth", dev.name, enable)

        self.experimental = _Experimental()

    def _call(self, name, *args):
        if self.raise_on == name:
            raise RuntimeError("Physical devices cannot be modified after being initialized")
        self.calls.append((name, *args))

    def set_visible_devices(self, devices, device_type):
        self._call("set_visible_devices", [d.name for d in devices], device_type)

    def set_logical_device_configuration(self, dev, configs):
        self._call("set_logical_device_configuration", dev.name, configs)


def patch_tf_gpus(monkeypatch: pytest.MonkeyPatch, n: int) -> FakeTFConfig:
    """Make TensorFlow list ``n`` GPUs and record the tf.config calls made on them."""
    import tensorflow as tf

    devs = gpus(n)
    fake = FakeTFConfig()
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda kind=None: list(devs))
    monkeypatch.setattr(tf.config, "set_visible_devices", fake.set_visible_devices)
    monkeypatch.setattr(
        tf.config.experimental, "set_memory_growth", fake.experimental.set_memory_growth
    )
    return fake


def horovodrun_path() -> str | None:
    exe = Path(sys.executable).with_name("horovodrun")
    return str(exe) if exe.exists() else shutil.which("horovodrun")


requires_horovod = pytest.mark.skipif(
    horovodrun_path() is None, reason="Horovod is not installed (run bash launch/setup.sh)"
)


def run_workers(
    script: str | Path,
    *args: str,
    np: int = 2,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    out_dir: Path | None = None,
    engine: str = "horovod",
    launcher: str = "kmp",
) -> list[dict]:
    """Run ``script`` on ``np`` real processes: ``horovodrun --gloo``, or with
    ``engine="jax"`` ``kmp launch --engine jax`` (the JAX engine; no KERAS_BACKEND is
    passed on, the launcher sets it).

    ``launcher``: ``"kmp"`` (``python -m kmp.launching.horovodrun``, as ``kmp launch``
    runs it) or ``"horovodrun"`` (the command itself, with its start-up probe).

    Each worker is expected to write ``$KMP_TEST_OUT/rank{R}.json``; the parsed
    files are returned in rank order. A failing job raises with its output.
    """
    import tempfile

    script = Path(script)
    if not script.is_absolute():
        script = WORKERS / script
    out = Path(out_dir or tempfile.mkdtemp(prefix="kmp-hvd-"))
    out.mkdir(parents=True, exist_ok=True)
    full_env = {
        **os.environ,
        "KMP_TEST_OUT": str(out),
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "OMP_NUM_THREADS": "1",
        **(env or {}),
    }
    if engine == "jax":
        full_env.pop("KERAS_BACKEND", None)
        cmd = [sys.executable, "-m", "kmp.cli", "launch", "--engine", "jax", "-np", str(np)]
    else:
        # kmp launch's way into Horovod's launcher (kmp.launching.horovodrun: no 7-second
        # start-up probe), or the horovodrun command itself (launcher="horovodrun").
        from kmp.launching.horovodrun import MODULE

        head = [horovodrun_path()] if launcher == "horovodrun" else [sys.executable, "-m", MODULE]
        cmd = [*head, "--gloo", "-np", str(np), "-H", f"localhost:{np}"]
        cmd.append(sys.executable)
    cmd += [str(script), *args]
    proc = subprocess.run(
        cmd, env=full_env, capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"{engine} job failed ({proc.returncode}): {' '.join(cmd)}\n"
            f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
        )
    results = []
    for r in range(np):
        path = out / f"rank{r}.json"
        if not path.exists():
            raise AssertionError(f"rank {r} wrote no {path}\n{proc.stdout[-4000:]}")
        results.append(json.loads(path.read_text()))
    return results
