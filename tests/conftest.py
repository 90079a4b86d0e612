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

# The longest test modules of phase 1 (their whole time, fixtures included, on 2 workers:
# a clean-clone run on the AVX2 machine, less the tests of BESIDE_CLUSTER), run first, so
# that under pytest-xdist (launch/test.sh: `--dist loadscope --no-loadscope-reorder`) no long
# module starts last while the other worker idles. Only the order changes; a module missing
# from the list runs after these, in collection order.
LONGEST_FIRST = (
    "tests/test_zoo.py",  # 451 s: keras.applications and KerasHub models
    "tests/test_train.py",  # 380 s: launch/train.py jobs
    "tests/test_bench.py",  # 351 s: kmp bench --quick
    "tests/test_master_weights.py",  # 240 s
    "tests/test_scaling_optimizer.py",  # 196 s
    "tests/distributed/test_jax_engine.py",  # 152 s
    "tests/distributed/test_sparse.py",  # 127 s
    "tests/test_data.py",  # 107 s
)

# Tests that run in phase 2 of launch/test.sh, in a pytest session of their own beside the
# multi-host tests, instead of in phase 1: a module path (its tests not marked `distributed`)
# or a test's node id (with its parameters, or without: all of them). The multi-host tests
# wait on sshd, rendezvous and timeouts and leave more than a core idle (0.82 of 2 used on
# average, measured); these are long tests of one computing process, which keeps pace with
# nobody. Rank processes stay in phase 1: ranks that wait for each other lose the most on
# crowded cores (the whole of phase 1 beside the multi-host tests took 10 minutes longer,
# measured). Times: their call in phase 1 of a clean-clone run (2 workers, AVX2 machine).
BESIDE_CLUSTER = (
    "tests/test_backends.py",  # 323 s: the core tests again, in one child pytest on JAX
    "tests/test_bench.py::test_gpu_resnet50_quick_runs_on_jax_cpu",  # 125 s
    "tests/test_notebooks.py::test_notebook_runs[05_transformers]",  # 110 s
    "tests/test_bench.py::test_probe_bench_quick_times_both_backends",  # 46 s
)
BESIDE_CLUSTER_MARK = "beside_cluster"


def _module(item) -> str:
    return item.nodeid.split("::", 1)[0]


def _beside_cluster(item) -> bool:
    if item.get_closest_marker("distributed"):
        return False
    test = item.nodeid.split("[", 1)[0]  # the node id without its parameters
    return bool({_module(item), test, item.nodeid} & set(BESIDE_CLUSTER))


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    """Put the modules of LONGEST_FIRST first, in its order; keep every other order. Mark the
    tests BESIDE_CLUSTER names ``beside_cluster``."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    # list.sort is stable: items of the same rank (all the others) keep their order.
    items.sort(key=lambda item: rank.get(_module(item), len(rank)))
    for item in items:
        if _beside_cluster(item):
            item.add_marker(BESIDE_CLUSTER_MARK)


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
