"""kmp.callbacks.checkpoint: AtomicCheckpoint, atomic_save and latest_checkpoint."""

from __future__ import annotations

import os

import keras
import numpy as np
import pytest

from kmp import callbacks as kcb
from kmp.callbacks.checkpoint import FoundCheckpoint, atomic_save
from tests.callbacks._helpers import (
    BATCH,
    STEPS,
    Recorder,
    make_data,
    make_model,
    pretend_not_chief,
)


@pytest.fixture
def not_chief(monkeypatch):
    """Pretend to be rank 1 of 2."""
    pretend_not_chief(monkeypatch)


def test_atomic_checkpoint_keeps_newest_and_latest_finds_it(tmp_path):
    x, y = make_data()
    model = make_model(keras.optimizers.Adam(0.01))
    ckpt = kcb.AtomicCheckpoint(tmp_path / "ck", keep=2)
    assert kcb.latest_checkpoint(tmp_path / "ck") == FoundCheckpoint(None, 0)
    model.fit(x, y, batch_size=BATCH, epochs=4, callbacks=[ckpt], verbose=0)
    files = sorted(os.listdir(tmp_path / "ck"))
    assert files == ["ckpt-0003.keras", "ckpt-0004.keras"]
    latest = kcb.latest_checkpoint(tmp_path / "ck")
    assert latest == FoundCheckpoint(str(tmp_path / "ck" / "ckpt-0004.keras"), 4)
    assert ckpt.latest() == latest
    restored = keras.saving.load_model(latest.path)
    for a, b in zip(model.get_weights(), restored.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(restored.optimizer.iterations) == 4 * STEPS
    # Resume from it: epochs continue from 4, and pruning keeps the two newest.
    restored.fit(
        x, y, batch_size=BATCH, epochs=5, initial_epoch=latest.epoch, callbacks=[ckpt], verbose=0
    )
    assert sorted(os.listdir(tmp_path / "ck")) == ["ckpt-0004.keras", "ckpt-0005.keras"]


def test_atomic_checkpoint_leaves_no_partial_file(tmp_path, monkeypatch):
    x, y = make_data()
    model = make_model()
    ckpt = kcb.AtomicCheckpoint(tmp_path, keep=3)
    model.fit(x, y, batch_size=BATCH, epochs=1, callbacks=[ckpt], verbose=0)
    good = (tmp_path / "ckpt-0001.keras").read_bytes()

    def broken_save(self, filepath, *args, **kwargs):
        with open(filepath, "wb") as f:
            f.write(b"PK\x03\x04 half a zip")
        raise OSError("disk full")

    monkeypatch.setattr(keras.Model, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        model.fit(x, y, batch_size=BATCH, epochs=2, initial_epoch=1, callbacks=[ckpt], verbose=0)
    assert sorted(os.listdir(tmp_path)) == ["ckpt-0001.keras"]  # no temp, no partial epoch 2
    assert (tmp_path / "ckpt-0001.keras").read_bytes() == good
    assert kcb.latest_checkpoint(tmp_path).epoch == 1


def test_atomic_save_never_exposes_a_partial_file(tmp_path):
    target = tmp_path / "w.keras"
    target.write_bytes(b"old")

    def save(path):
        with open(path, "wb") as f:
            f.write(b"new-but-incomplete")
        assert target.read_bytes() == b"old"  # the final name is untouched while writing
        with open(path, "ab") as f:
            f.write(b"+rest")

    atomic_save(target, save)
    assert target.read_bytes() == b"new-but-incomplete+rest"
    assert os.listdir(tmp_path) == ["w.keras"]


def test_atomic_checkpoint_best_only_weights_and_templates(tmp_path):
    x, y = make_data()
    model = make_model(keras.optimizers.SGD(0.05))
    template = str(tmp_path / "m-{epoch:02d}-{loss:.4f}.weights.h5")
    ckpt = kcb.AtomicCheckpoint(
        template, save_weights_only=True, save_best_only=True, monitor="loss"
    )
    rec = Recorder()
    model.fit(x, y, batch_size=BATCH, epochs=3, callbacks=[rec, ckpt], verbose=0)
    losses = [e["loss"] for e in rec.epoch_logs]
    best = [i + 1 for i, v in enumerate(losses) if v == min(losses[: i + 1])]
    found = kcb.latest_checkpoint(tmp_path, os.path.basename(template))
    assert found.epoch == best[-1]
    assert len(os.listdir(tmp_path)) == len(best)
    model2 = make_model(seed=7)
    model2.load_weights(found.path)
    assert ckpt.last_saved == found.path


def test_atomic_checkpoint_writes_nothing_on_other_ranks(not_chief, tmp_path):
    x, y = make_data()
    make_model().fit(
        x,
        y,
        batch_size=BATCH,
        epochs=2,
        verbose=0,
        callbacks=[kcb.AtomicCheckpoint(tmp_path / "ck")],
    )
    assert not (tmp_path / "ck").exists()


def test_atomic_checkpoint_bad_input(tmp_path):
    with pytest.raises(ValueError, match=r"\.weights\.h5"):
        kcb.AtomicCheckpoint(tmp_path / "a-{epoch}.keras", save_weights_only=True)
    with pytest.raises(ValueError, match=r"\.keras"):
        kcb.AtomicCheckpoint(tmp_path / "a-{epoch}.h5")
    with pytest.raises(ValueError, match="keep"):
        kcb.AtomicCheckpoint(tmp_path, keep=0)
    with pytest.raises(ValueError, match=r"\{epoch\}"):
        kcb.AtomicCheckpoint(tmp_path / "best.keras", keep=2)
    with pytest.raises(ValueError, match="mode"):
        kcb.AtomicCheckpoint(tmp_path, mode="up")
    with pytest.raises(ValueError, match="save_freq"):
        kcb.AtomicCheckpoint(tmp_path, save_freq=0)
    with pytest.raises(ValueError, match=r"\{epoch\}"):
        kcb.latest_checkpoint(tmp_path, "best.keras")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"keep": "3"}, r"AtomicCheckpoint\(keep\).*None to keep all"),
        ({"keep": True}, r"AtomicCheckpoint\(keep\)"),
        ({"keep": 2.0}, r"AtomicCheckpoint\(keep\)"),
        ({"mode": None}, r"AtomicCheckpoint\(mode\).*'auto', 'min', 'max'"),
        ({"save_freq": 1.0}, r"AtomicCheckpoint\(save_freq\).*number of epochs"),
        ({"save_freq": "1"}, r"AtomicCheckpoint\(save_freq\)"),
        ({"verbose": "1"}, r"AtomicCheckpoint\(verbose\)"),
        ({"monitor": 3}, r"AtomicCheckpoint\(monitor\).*val_loss"),
        ({"save_best_only": "yes"}, r"AtomicCheckpoint\(save_best_only\).*True or False"),
        ({"save_weights_only": 1}, r"AtomicCheckpoint\(save_weights_only\)"),
    ],
)
def test_atomic_checkpoint_wrong_types(tmp_path, kwargs, message):
    with pytest.raises(TypeError, match=message):
        kcb.AtomicCheckpoint(tmp_path, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"keep": -1}, r"AtomicCheckpoint\(keep\).*positive integer"),
        ({"mode": "up"}, r"AtomicCheckpoint\(mode\).*'auto', 'min', 'max'.*'min' for losses"),
        ({"save_freq": -2}, r"AtomicCheckpoint\(save_freq\).*positive integer"),
        ({"verbose": 3}, r"AtomicCheckpoint\(verbose\)"),
    ],
)
def test_atomic_checkpoint_more_bad_values(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        kcb.AtomicCheckpoint(tmp_path, **kwargs)


def test_atomic_checkpoint_mode_is_case_insensitive_and_auto_resolves(tmp_path):
    assert kcb.AtomicCheckpoint(tmp_path, mode="MAX").mode == "max"
    assert kcb.AtomicCheckpoint(tmp_path, monitor="val_accuracy").mode == "max"
    assert kcb.AtomicCheckpoint(tmp_path, monitor="val_loss").mode == "min"
    ckpt = kcb.AtomicCheckpoint(tmp_path, keep=np.int64(2), save_freq=np.int32(3))
    assert (ckpt.keep, ckpt.save_freq) == (2, 3)
    assert type(ckpt.keep) is int and type(ckpt.save_freq) is int


def test_latest_checkpoint_ignores_temp_and_foreign_files(tmp_path):
    for name in [
        "ckpt-0002.keras",
        "ckpt-0010.weights.h5",
        ".tmp-abc-ckpt-0011.keras",
        "notes.txt",
        "ckpt-x.keras",
    ]:
        (tmp_path / name).write_bytes(b"x")
    assert kcb.latest_checkpoint(tmp_path) == FoundCheckpoint(
        str(tmp_path / "ckpt-0010.weights.h5"), 10
    )
    assert kcb.latest_checkpoint(tmp_path, "ckpt-{epoch:04d}.keras").epoch == 2
