"""kmp.elastic.KerasState: commit, restore, sync and reset of a Keras 3 job (one process)."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import kmp
from kmp.elastic import KerasState


def compiled(policy="float32", scale_lr=True, lr=0.01):
    kmp.enable(policy)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    opt = kmp.wrap_optimizer(keras.optimizers.Adam(lr), scale_lr=scale_lr)
    model.compile(opt, "mse")
    return model


def values(variables):
    return [np.array(keras.ops.convert_to_numpy(v)) for v in variables]


def test_restore_rolls_back_weights_optimizer_and_counters():
    model = compiled("mixed_float16")
    state = KerasState(model, best=[1.0])
    committed = values(model.variables) + values(model.optimizer.variables)
    x, y = np.ones((8, 4)), np.ones((8, 3))
    model.fit(x, y, epochs=1, verbose=0)
    opt = model.optimizer
    opt.skipped_steps_counter.assign(5)
    opt.dynamic_scale.assign(2.0)
    state.epoch, state.samples_done = 3, 96
    state.best.append(2.0)
    state.restore()
    now = values(model.variables) + values(model.optimizer.variables)
    assert all(np.array_equal(a, b) for a, b in zip(committed, now, strict=True))
    assert (opt.skipped_steps, opt.loss_scale) == (0, 32768.0)
    assert (state.epoch, state.samples_done, state.best) == (0, 0, [1.0])


def test_commit_moves_the_restore_point():
    model = compiled()
    state = KerasState(model)
    model.fit(np.ones((8, 4)), np.ones((8, 3)), epochs=1, verbose=0)
    state.epoch = 1
    state.commit()
    after = values(model.variables)
    model.fit(np.ones((8, 4)), np.zeros((8, 3)), epochs=1, verbose=0)
    state.restore()
    assert all(np.array_equal(a, b) for a, b in zip(after, values(model.variables), strict=True))
    assert state.epoch == 1 and state.commits == 1


def test_the_optimizer_is_built_so_its_state_is_held():
    model = compiled()
    assert not model.optimizer.built
    state = KerasState(model)
    assert model.optimizer.built
    paths = {v.path for v in state._variables}
    assert any(p.endswith("/loss_scale") for p in paths)  # the scale and its counters
    assert any(p.endswith("/skipped_steps") for p in paths)
    assert any(p.endswith("iteration") for p in paths)


def test_reset_rescales_the_learning_rate_and_drops_traced_functions(monkeypatch):
    model = compiled(lr=0.01)  # one process: lr_scale 1
    model.fit(np.ones((8, 4)), np.ones((8, 3)), epochs=1, verbose=0)
    assert model.train_function is not None
    state = KerasState(model)
    monkeypatch.setattr(kmp.distributed, "size", lambda: 3)
    calls = []
    state.register_reset_callbacks([lambda: calls.append(1)])
    state.on_reset()
    inner = model.optimizer.inner_optimizer
    assert model.optimizer.lr_scale == 3.0
    assert float(inner.learning_rate.numpy()) == pytest.approx(0.03)
    assert model.train_function is None and calls == [1]
    # A failure before the next commit rolls the factor back with the rate.
    state.restore()
    assert model.optimizer.lr_scale == 1.0
    assert float(inner.learning_rate.numpy()) == pytest.approx(0.01)


def test_a_schedule_is_rescaled_by_its_factor(monkeypatch):
    kmp.enable("float32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    sched = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    model.compile(kmp.wrap_optimizer(keras.optimizers.SGD(sched), scale_lr=True), "mse")
    state = KerasState(model)
    monkeypatch.setattr(kmp.distributed, "size", lambda: 2)
    state.on_reset()
    lr = model.optimizer.inner_optimizer._learning_rate
    assert isinstance(lr, kmp.learning_rate.ScaledLearningRate) and lr.factor == 2.0
    assert float(lr(0)) == pytest.approx(0.2)


def test_without_scale_lr_the_rate_stays(monkeypatch):
    model = compiled(scale_lr=False, lr=0.01)
    state = KerasState(model)
    monkeypatch.setattr(kmp.distributed, "size", lambda: 4)
    state.on_reset()
    assert float(model.optimizer.inner_optimizer.learning_rate.numpy()) == pytest.approx(0.01)


def test_host_updates_raise_on_a_newer_notification(monkeypatch):
    from horovod.common.exceptions import HostsUpdatedInterrupt
    from horovod.runner.elastic.worker import HostUpdateResult

    state = KerasState(compiled())
    monkeypatch.setattr(kmp.distributed, "uses_horovod", lambda: True)
    monkeypatch.setattr(kmp.distributed, "broadcast_object", lambda obj, root=0: obj)
    state.check_host_updates()  # nothing announced
    state.on_hosts_updated(5.0, HostUpdateResult.removed)
    with pytest.raises(HostsUpdatedInterrupt) as info:
        state.commit()
    assert info.value.skip_sync  # only removed: every rank holds the same commit
    state.on_hosts_updated(4.0, HostUpdateResult.added)  # older than the last one seen
    state.check_host_updates()


def test_bad_arguments_are_refused_before_anything_runs():
    with pytest.raises(TypeError, match=r"keras\.Model"):
        KerasState("model")
    with pytest.raises(ValueError, match="compile"):
        KerasState(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]))
    model = compiled()
    with pytest.raises(ValueError, match="keeps history itself"):
        KerasState(model, epoch=1, history=[])
    with pytest.raises(ValueError, match="epoch"):
        KerasState(model, epoch=-1)
    with pytest.raises(TypeError):
        KerasState(model, batch=1.5)
    with pytest.raises(TypeError, match="callable"):
        KerasState(model).register_reset_callbacks([3])
