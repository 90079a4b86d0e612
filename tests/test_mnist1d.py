"""mnist1d (kmp.datasets.mnist1d, kmp.datasets.memory) and the paper's CNN and GRU in launch/."""

from __future__ import annotations

import importlib.util
import random

import keras
import numpy as np
import pytest

from tests._support import ROOT

pytest.importorskip("mnist1d")

from kmp.datasets import memory, mnist1d


def test_the_papers_split_generated_offline_and_deterministic():
    x, y = mnist1d.load_arrays("train")
    x_test, y_test = mnist1d.load_arrays("test")
    assert x.shape == (4000, 40) and x_test.shape == (1000, 40)
    assert y.shape == (4000,) and y_test.shape == (1000,)
    assert x.dtype == np.float32 and y.dtype == np.int32
    assert set(np.unique(y)) == set(range(10))
    # Procedural from seed 42: generating again (not the cache) gives the same signals.
    mnist1d._generate.cache_clear()
    np.testing.assert_array_equal(mnist1d.load_arrays("train")[0], x)


def test_generating_leaves_the_callers_random_state_alone():
    mnist1d._generate.cache_clear()
    np.random.seed(7)
    random.seed(7)
    expected = (np.random.random(), random.random())
    np.random.seed(7)
    random.seed(7)
    mnist1d.load_arrays("test")
    assert (np.random.random(), random.random()) == expected


def test_rank_shards_and_dtype():
    spec = memory.shard_spec("mnist1d", "train", batch_size=50, size=2)
    assert (spec.steps_per_epoch, spec.dropped_per_epoch, spec.num_classes) == (40, 0, 10)
    assert spec.image_shape == (40,)
    x, y = next(iter(memory.load("mnist1d", "train", batch_size=50, rank=1, size=2,
                                 dtype="bfloat16")))  # fmt: skip
    assert x.shape == (50, 40) and x.dtype == "bfloat16" and y.dtype == "int32"
    with pytest.raises(ValueError, match="takes no seq_len"):
        memory.arrays("mnist1d", "train", seq_len=8)
    with pytest.raises(ValueError, match="'train' and 'test'"):
        mnist1d.load_arrays("dev")


def _workloads():
    """launch/workloads.py (the reference script's models), loaded from its file."""
    spec = importlib.util.spec_from_file_location("kmp_w", ROOT / "launch" / "workloads.py")
    workloads = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(workloads)
    return workloads


def test_the_papers_cnn():
    import kmp

    workloads = _workloads()
    keras.config.set_dtype_policy("mixed_bfloat16")
    model = kmp.float32_outputs(workloads.build("mnist1d_cnn", (40,), 10, "bfloat16"))
    # Conv1d(1, 25, 5, stride 2, padding 1), then two Conv1d(25, 25, 3, ...): 40 -> 19 -> 10 -> 5.
    assert [model.get_layer(f"conv{i}").output.shape[1:] for i in (1, 2, 3)] == [
        (19, 25), (10, 25), (5, 25)
    ]  # fmt: skip
    assert model.count_params() == (5 * 25 + 25) + 2 * (3 * 25 * 25 + 25) + (125 * 10 + 10)
    assert model.get_layer("conv1").compute_dtype == "bfloat16"
    out = model(np.zeros((3, 40), "float32"))
    assert out.dtype == "float32" and out.shape == (3, 10)


def test_the_papers_gru_trains_under_float16_with_the_underflow_rule():
    """The recurrent baseline: its size, float16 inside, float32 out, kmp's rule reading it."""
    import kmp

    workloads = _workloads()
    keras.config.set_dtype_policy("mixed_float16")
    model = kmp.float32_outputs(workloads.build("mnist1d_gru", (40,), 10, "float32"))
    # Per direction: 3 gates x 6 units x (1 input + 6 recurrent) + Keras's 2 x 18 biases.
    gru = 3 * 6 * (1 + 6) + 2 * 3 * 6
    assert model.count_params() == 2 * gru + (40 * 12 * 10 + 10)
    assert model.get_layer("bigru").compute_dtype == "float16"
    opt = kmp.wrap_optimizer(keras.optimizers.Adam(1e-2))
    model.compile(opt, "sparse_categorical_crossentropy")
    x, y = mnist1d.load_arrays("train")
    model.fit(x[:200], y[:200], batch_size=100, epochs=1, verbose=0)
    assert opt.loss_scale_rule.measures_underflow
    assert 0.0 <= opt.underflow_share < 1.0 and opt.loss_scale >= 2.0**14
    assert model(x[:3]).dtype == "float32"
