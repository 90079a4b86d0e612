"""kmp.callbacks.broadcast: BroadcastInitialState in one process (two ranks: test_defaults)."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import kmp.distributed
from kmp import callbacks as kcb
from tests.callbacks._helpers import make_model


def test_broadcast_single_process_builds_optimizer_and_changes_nothing():
    model = make_model(keras.optimizers.Adam(0.01))
    before = [np.array(w) for w in model.get_weights()]
    cb = kcb.BroadcastInitialState()
    cb.set_model(model)
    assert not model.optimizer.built
    cb.on_train_begin()
    assert model.optimizer.built
    names = [v.path for v in cb.state_variables()]
    assert any("iteration" in n for n in names)  # optimizer state is included
    assert len(names) == len(model.weights) + len(model.optimizer.variables)
    for a, b in zip(before, model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_broadcast_bad_input():
    with pytest.raises(ValueError, match="root"):
        kcb.BroadcastInitialState(root=-1)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])  # not compiled
    cb = kcb.BroadcastInitialState()
    cb.set_model(model)
    with pytest.raises(ValueError, match="compile"):
        cb.on_train_begin()


@pytest.mark.parametrize("bad", ["x", True, 1.0, None])
def test_broadcast_root_of_the_wrong_type(bad):
    with pytest.raises(TypeError, match=r"BroadcastInitialState\(root\).*integer.*root=0"):
        kcb.BroadcastInitialState(root=bad)


def test_broadcast_root_accepts_numpy_ints():
    assert kcb.BroadcastInitialState(root=np.int64(1)).root == 1


def test_broadcast_root_beyond_the_world(monkeypatch):
    monkeypatch.setattr(kmp.distributed, "size", lambda: 2)
    monkeypatch.setattr(
        kmp.distributed, "broadcast_variables", lambda *a, **k: pytest.fail("no broadcast")
    )
    cb = kcb.BroadcastInitialState(root=2)
    cb.set_model(make_model())
    with pytest.raises(ValueError, match=r"only 2 ranks run: use a root between 0 and 1"):
        cb.on_train_begin()
