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
# XLA's CPU backend compiles without LLVM's optimisations in every process the tests start
# (unless XLA_FLAGS is set): the tests check what kmp computes, which this does not change
# (no fast-math either way), not how fast XLA's code runs. Most of the JAX tests' time is
# compiling: the JAX rerun of the core tests took 128 CPU-s instead of 176, the ResNet-50
# JAX-CPU bench 79 instead of 100 (measured side by side).
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")

# The longest test modules (their whole time, fixtures included, in phase 1 of a clean-clone
# run of 678b02e: 2 workers, AVX2 machine, 2026-12-03), run first, so that under pytest-xdist
# (launch/test.sh: `--dist loadscope --no-loadscope-reorder`) no long module starts last while
# the other worker idles. Modules within about 20 s of each other keep their earlier order
# (less than one run's spread). Only the order changes; a module missing from the list runs
# after these, in collection order.
LONGEST_FIRST = (
    "tests/test_bench.py",  # 568 s: kmp bench --quick, the ResNet-50 JAX-CPU and probe benches
    "tests/test_zoo.py",  # 374 s: keras.applications and KerasHub models
    "tests/test_train.py",  # 326 s: launch/train.py jobs
    "tests/test_backends.py",  # 210 s: the core tests again on JAX (launch/test.sh: the matrix)
    "tests/test_master_weights.py",  # 197 s
    "tests/test_notebooks.py",  # 212 s
    "tests/test_scaling_optimizer.py",  # 198 s
    "tests/distributed/test_jax_engine.py",  # 168 s
    "tests/distributed/test_sparse.py",  # 147 s
    "tests/test_resume.py",  # 130 s: 2-rank resume jobs on both engines, a killed job
    "tests/test_data.py",  # 64 s
    "tests/test_docs.py",  # 49 s (measured alone, machine loaded): mkdocs build, docs' code
)


# KMP_TEST_ORDER=reverse runs the collected tests in the reverse order instead (modules
# and the tests within each): a test that passes only because another ran first, in the
# same process, fails one of the two ways (`-n 0`: all of them in one process).
ORDERS = ("longest-first", "reverse")


def order_items(items: list, order: str) -> None:
    """Sort pytest's items in place: LONGEST_FIRST's modules first or everything reversed."""
    if order not in ORDERS:
        raise pytest.UsageError(f"KMP_TEST_ORDER={order!r}: use one of {', '.join(ORDERS)}.")
    if order == "reverse":
        items.reverse()
        return
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    # list.sort is stable: items of the same rank (all the others) keep their order.
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


def pytest_collection_modifyitems(config, items):
    """Order the run as KMP_TEST_ORDER says (default: LONGEST_FIRST's modules first)."""
    order_items(items, os.environ.get("KMP_TEST_ORDER", "longest-first"))


@pytest.fixture
def script(tmp_path) -> Path:
    """A training script for launcher tests: it exists and prints one line."""
    path = tmp_path / "train.py"
    path.write_text("print('hello')\n")
    return path


@pytest.fixture(autouse=True)
def _reset_keras_global_state(monkeypatch):
    """Every test starts and ends with Keras's default float32 policy, no KMP_POLICY, no
    test-harness variable (KMP_TEST_ORDER, ...) and outside any SLURM allocation."""
    import keras

    monkeypatch.delenv("KMP_POLICY", raising=False)
    for key in ("KMP_TEST_ORDER", "KMP_TEST_WORKERS"):
        # The harness's own settings, read before any test runs: `kmp launch` forwards
        # every KMP_* variable, and no test may see how the suite was ordered.
        monkeypatch.delenv(key, raising=False)
    for key in ("SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURM_STEP_ID"):
        # Run inside a SLURM job, `kmp launch -np N` would start its ranks with srun.
        monkeypatch.delenv(key, raising=False)
    keras.config.set_dtype_policy("float32")
    yield
    keras.config.set_dtype_policy("float32")
    keras.backend.clear_session(free_memory=False)  # the full gc it does by default costs ~1 s
