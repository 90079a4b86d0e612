"""kmp.callbacks.chief_only: ChiefOnly and chief_only."""

from __future__ import annotations

import keras
import pytest

import kmp.distributed
from kmp import callbacks as kcb
from tests.callbacks._helpers import BATCH, STEPS, make_data, make_model, pretend_not_chief


@pytest.fixture
def not_chief(monkeypatch):
    """Pretend to be rank 1 of 2."""
    pretend_not_chief(monkeypatch)


class _Counter(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def set_model(self, model):
        self.calls.append("set_model")
        super().set_model(model)

    def on_train_begin(self, logs=None):
        self.calls.append("train_begin")

    def on_epoch_end(self, epoch, logs=None):
        self.calls.append("epoch_end")

    def on_train_batch_end(self, batch, logs=None):
        self.calls.append("batch_end")


def test_chief_only_forwards_on_chief():
    x, y = make_data()
    inner = _Counter()
    make_model().fit(x, y, batch_size=BATCH, epochs=2, callbacks=[kcb.chief_only(inner)], verbose=0)
    assert inner.calls.count("epoch_end") == 2
    assert inner.calls.count("batch_end") == 2 * STEPS
    assert inner.calls[:2] == ["set_model", "train_begin"]


def test_chief_only_silent_on_other_ranks(not_chief, tmp_path):
    x, y = make_data()
    inner = _Counter()
    csv = tmp_path / "log.csv"
    model = make_model()
    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=2,
        verbose=0,
        callbacks=[kcb.chief_only(inner), kcb.ChiefOnly(keras.callbacks.CSVLogger(str(csv)))],
    )
    assert inner.calls == []
    assert not csv.exists()


def test_chief_only_progbar_is_recognised_by_keras(capsys, monkeypatch):
    x, y = make_data()
    model = make_model()
    cb = kcb.chief_only(keras.callbacks.ProgbarLogger())
    assert isinstance(cb, keras.callbacks.ProgbarLogger)
    assert isinstance(cb, kcb.ChiefOnly)
    model.fit(x, y, batch_size=BATCH, epochs=2, callbacks=[cb], verbose=1)
    assert capsys.readouterr().out.count("Epoch 1/2") == 1  # one bar, not two
    monkeypatch.setattr(kmp.distributed, "is_chief", lambda: False)
    model.fit(x, y, batch_size=BATCH, epochs=2, callbacks=[cb], verbose=1)
    assert "Epoch 1/2" not in capsys.readouterr().out  # Keras added no bar of its own


def test_chief_only_bad_input():
    with pytest.raises(TypeError, match="Callback instance"):
        kcb.chief_only(lambda logs: None)
    with pytest.raises(TypeError, match="not an instance"):
        kcb.ChiefOnly(keras.callbacks.CSVLogger)
    with pytest.raises(TypeError, match="History"):
        kcb.chief_only(keras.callbacks.History())


def test_chief_only_class_refuses_a_progbar_directly():
    with pytest.raises(TypeError, match=r"kmp\.callbacks\.chief_only\(.*verbosity\(\)"):
        kcb.ChiefOnly(keras.callbacks.ProgbarLogger())


def test_chief_only_plain_callbacks_are_plain_chief_only():
    cb = kcb.chief_only(keras.callbacks.CSVLogger("log.csv"))
    assert type(cb) is kcb.ChiefOnly
    assert not isinstance(cb, keras.callbacks.ProgbarLogger)
    assert repr(cb).startswith("ChiefOnly(<keras")
    assert cb.async_safe  # CSVLogger keeps the default batch-end hooks
    assert not kcb.chief_only(keras.callbacks.ProgbarLogger()).async_safe
