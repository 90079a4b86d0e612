"""Every script under examples/ runs, as its docstring says, and prints what it promises.

The single-process examples run in a fresh interpreter each; the Horovod TF1 session example
runs on 2 real ranks (through tests/distributed/worker_example.py, which counts ``hvd.init()``
calls: the script's own, and none by kmp, which adopts it). A script added to examples/
without an entry here fails :func:`test_every_example_is_run_by_a_test`.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import pytest

from tests._support import ROOT, requires_horovod, run_workers

EXAMPLES = ROOT / "examples"

# Single-process examples -> the pattern their last line must match.
SINGLE_PROCESS = {
    "tf_keras_mixed_precision.py": (
        r"^kmp: policy mixed_float16 \(hidden layer computes in float16, output float32\), "
        r"optimizer DistributedLossScaleOptimizer, loss scale 32768, loss \d+\.\d+$"
    ),
    "custom_loop_grad_scaler.py": (
        r"^kmp: 6 steps, skipped steps \[(1, )?3\], loss scale after each step .*, "
        r"layers compute in float16, weights finite: True$"
    ),
    "jax_float16_gradient.py": (
        r"^float16 gradients: 10 of 10 are 0 without loss scaling .*; 0 with kmp's scale "
        r"32768 .*; 5 steps: scale 32768 -> 65536 -> 32768 -> 32768 -> 65536, "
        r"skipped steps \[3\]$"
    ),
}
# Examples that run on 2 Horovod ranks.
HOROVOD = ("horovod_tf1_session.py",)


def _examples() -> list[str]:
    return sorted(p.name for p in EXAMPLES.glob("*.py"))


def test_every_example_is_run_by_a_test():
    tested = set(SINGLE_PROCESS) | set(HOROVOD)
    assert set(_examples()) == tested, (
        "Every script in examples/ needs a test in tests/test_examples.py: add it to "
        "SINGLE_PROCESS (with its last line) or HOROVOD, and remove entries whose script is gone."
    )


@pytest.mark.parametrize("name", _examples())
def test_every_example_quotes_its_original_and_is_listed(name):
    doc = ast.get_docstring(ast.parse((EXAMPLES / name).read_text()))
    assert doc and "The original" in doc and "What kmp changes" in doc, name
    assert f"]({name})" in (EXAMPLES / "README.md").read_text(), f"examples/README.md: {name}"


@pytest.mark.parametrize("name", sorted(SINGLE_PROCESS))
def test_single_process_example(name):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("KERAS_BACKEND", None)
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert re.search(SINGLE_PROCESS[name], last), last
    if name == "tf_keras_mixed_precision.py":  # what the experimental names give today
        assert "experimental names: AttributeError:" in proc.stdout, proc.stdout


@requires_horovod
def test_horovod_tf1_session_example_on_two_ranks():
    script = str(EXAMPLES / "horovod_tf1_session.py")
    results = run_workers("worker_example.py", script, np=2, timeout=240)
    for rank, r in enumerate(results):
        assert (r["rank"], r["size"], r["kmp_world"]) == (rank, 2, [rank, 2])
        assert r["hvd_init_calls"] == 1  # the script's own hvd.init(); kmp did not init again
        assert r["engine"] == "horovod" and r["engine_is_the_scripts"] and r["adopted"]
    first, second = results
    assert first["initial"] != second["initial"]  # each rank started from its own variables
    assert first["losses"] != second["losses"]  # and read its own data
    assert first["variables"] == second["variables"] and first["digest"] == second["digest"]
