"""kmp.elastic.run: failures roll back and reset, host changes reset, bugs are raised."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmp
from kmp.elastic import CommitCallback, KerasState, fit, run
from kmp.elastic.data import epoch_order
from kmp.elastic.run import is_horovod_failure


@pytest.mark.parametrize(
    "exc,expected",
    [
        (
            tf.errors.UnknownError(None, None, "{{node HorovodGroupedAllreduce_grads_0}} failed"),
            True,
        ),
        (tf.errors.UnavailableError(None, None, "Horovod has been shut down."), True),
        (
            tf.errors.InternalError(None, None, "[gloo/transport/tcp/pair.cc] Connection closed"),
            True,
        ),
        (tf.errors.InvalidArgumentError(None, None, "Incompatible shapes: [3] vs. [4]"), False),
        (ValueError("horovod in a plain error is a bug of the script"), False),
    ],
)
def test_only_collective_failures_count(exc, expected):
    assert is_horovod_failure(exc) is expected


def test_horovod_internal_error_counts():
    from horovod.common.exceptions import HorovodInternalError

    assert is_horovod_failure(HorovodInternalError("lost a rank"))


class FakeNotifications:
    def __init__(self):
        self.listeners = []

    def init(self):
        pass

    def register_listener(self, s):
        self.listeners.append(s)

    def remove_listener(self, s):
        self.listeners.remove(s)


@pytest.fixture
def elastic_world(monkeypatch):
    """A world that Horovod 'runs', with restart counted and collectives as identities."""
    import horovod.common.elastic as hvd_elastic

    fake = FakeNotifications()
    monkeypatch.setattr(hvd_elastic, "notification_manager", fake)
    monkeypatch.setattr(kmp.distributed, "uses_horovod", lambda: True)
    monkeypatch.setattr(kmp.distributed, "broadcast_object", lambda obj, root=0: obj)
    monkeypatch.setattr(kmp.distributed, "broadcast_variables", lambda v, root=0: None)
    restarts = []
    monkeypatch.setattr(kmp.distributed, "restart", lambda: restarts.append(1))
    return fake, restarts


def small_state():
    kmp.enable("float32")
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(kmp.wrap_optimizer(keras.optimizers.SGD(0.1)), "mse")
    return KerasState(model)


def test_a_failed_collective_restores_the_commit_and_runs_again(elastic_world):
    fake, restarts = elastic_world
    state = small_state()
    calls = []

    @run
    def train(s):
        calls.append(s.epoch)
        if len(calls) == 1:
            s.epoch = 7  # progress that was never committed
            assert fake.listeners == [s]
            raise tf.errors.UnknownError(None, None, "HorovodGroupedAllreduce: peer lost")
        return "done"

    assert train(state) == "done"
    assert calls == [0, 0]  # the second call started from the commit, not from epoch 7
    assert restarts == [1] and state.resets == 1 and fake.listeners == []
    kinds = [e["event"] for e in state.events]
    assert kinds == ["failure", "restored", "reset"]


def test_hosts_updated_resets_without_rolling_back(elastic_world):
    from horovod.common.exceptions import HostsUpdatedInterrupt

    _, restarts = elastic_world
    state = small_state()
    seen = []

    @run
    def train(s):
        seen.append(s.epoch)
        if len(seen) == 1:
            s.epoch = 2
            s.commit()
            raise HostsUpdatedInterrupt(False)
        return s.epoch

    assert train(state) == 2 and restarts == [1]


def test_a_bug_is_raised_not_retried(elastic_world):
    _, restarts = elastic_world

    @run
    def train(s):
        raise KeyError("typo")

    with pytest.raises(KeyError):
        train(small_state())
    assert restarts == []


def test_run_needs_a_state_and_a_function():
    with pytest.raises(TypeError, match="decorates a function"):
        run(3)
    with pytest.raises(TypeError, match="KerasState"):
        run(lambda s: s)(object())


def test_fit_in_one_process_uses_every_example_once_per_epoch():
    state = small_state()
    x = np.random.default_rng(0).random((45, 2)).astype("float32")
    data = kmp.elastic.ElasticData(x, x.sum(1), batch_size=8)
    history = fit(state, data, epochs=3, commit_every=2, record_examples=True, verbose=0)
    assert len(history) == 3 and state.epoch == 3 and state.samples_done == 0
    for epoch in range(3):
        assert sorted(state.examples[epoch]) == list(range(45))
    assert state.commits == 3 * (1 + 6 // 2)  # every 2 of 6 batches, and each epoch end
    assert int(state.model.optimizer.iterations.numpy()) == 18


def test_fit_resumes_at_the_committed_position():
    state = small_state()
    x = np.zeros((40, 2), "float32")
    data = kmp.elastic.ElasticData(x, x[:, 0], batch_size=8)
    state.epoch, state.samples_done = 1, 24
    fit(state, data, epochs=2, record_examples=True, verbose=0)
    order = epoch_order(40, seed=0, epoch=1)
    assert sorted(state.examples[1]) == sorted(int(i) for i in order[24:])
    assert int(state.model.optimizer.iterations.numpy()) == 2  # 16 examples left: 2 steps


def test_a_commit_on_the_last_step_leaves_only_the_epoch_end():
    state = small_state()
    x = np.zeros((16, 2), "float32")
    data = kmp.elastic.ElasticData(x, x[:, 0], batch_size=8)
    state.epoch, state.batch, state.samples_done = 0, 2, 16  # restored after the last step
    fit(state, data, epochs=2, verbose=0)
    assert state.epoch == 2 and len(state.history) == 2 and state.history[0] == {}
    assert int(state.model.optimizer.iterations.numpy()) == 2  # epoch 1 only


def test_fit_and_the_callback_check_their_arguments():
    state = small_state()
    data = kmp.elastic.ElasticData(np.zeros((4, 2)), np.zeros(4), batch_size=2)
    with pytest.raises(TypeError, match="ElasticData"):
        fit(state, np.zeros(3), epochs=1)
    with pytest.raises(ValueError, match="epochs"):
        fit(state, data, epochs=0)
    with pytest.raises(ValueError, match="commit_every"):
        fit(state, data, epochs=1, commit_every=0)
    with pytest.raises(TypeError, match="Keras callback"):
        fit(state, data, epochs=1, callbacks=[print])
    with pytest.raises(ValueError, match="plan"):
        CommitCallback(state, record_examples=True)
    with pytest.raises(TypeError, match="KerasState"):
        CommitCallback(object())


def test_an_elastic_launch_without_init_is_told_to_call_it(monkeypatch):
    # kmp.distributed starts no engine by itself (issue 28): an elastic worker that did not
    # call init() stops at the decorated call instead of training alone.
    import sys

    world_mod = sys.modules["kmp.distributed.world"]  # kmp.distributed.world is the function
    monkeypatch.setattr(world_mod, "_STATE", world_mod._State())
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    monkeypatch.setenv("HOROVOD_SIZE", "1")
    state = small_state()

    @run
    def train(s):
        pytest.fail("trained without an engine")

    with pytest.raises(RuntimeError, match=r"elastic job.*Call kmp\.distributed\.init\(\)"):
        train(state)
