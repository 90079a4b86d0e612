"""kmp.callbacks.defaults: default_callbacks, config round trips, and two real ranks."""

from __future__ import annotations

import keras
import pytest

from kmp import callbacks as kcb
from tests._support import requires_horovod, run_workers
from tests.callbacks._helpers import BATCH, make_data, make_model


def test_default_callbacks_order_and_types(tmp_path):
    early = keras.callbacks.EarlyStopping(patience=2)
    cbs = kcb.default_callbacks(
        warmup_epochs=2,
        checkpoint_dir=tmp_path / "ck",
        tensorboard_dir=tmp_path / "tb",
        csv_path=tmp_path / "log.csv",
        extra=[early],
    )
    types = [type(c) for c in cbs]
    assert types[:4] == [
        kcb.BroadcastInitialState,
        kcb.MetricAverage,
        kcb.LossScaleMonitor,
        kcb.LearningRateWarmup,
    ]
    assert cbs[4] is early
    assert isinstance(cbs[5], kcb.AtomicCheckpoint)
    assert isinstance(cbs[6].callback, keras.callbacks.TensorBoard)
    assert isinstance(cbs[7].callback, keras.callbacks.CSVLogger)
    assert [type(c) for c in kcb.default_callbacks()] == [
        kcb.BroadcastInitialState,
        kcb.MetricAverage,
        kcb.LossScaleMonitor,
    ]
    with pytest.raises(TypeError, match="extra"):
        kcb.default_callbacks(extra=["EarlyStopping"])


@pytest.mark.parametrize("flag", ["broadcast", "average_metrics", "loss_scale_monitor"])
def test_default_callbacks_flags_must_be_bools(flag):
    with pytest.raises(TypeError, match=rf"default_callbacks\({flag}\).*True or False"):
        kcb.default_callbacks(**{flag: "yes"})
    assert len(kcb.default_callbacks(**{flag: False})) == 2


def test_default_callbacks_passes_bad_arguments_on_to_the_callbacks(tmp_path):
    with pytest.raises(ValueError, match=r"LearningRateWarmup\(warmup_epochs\)"):
        kcb.default_callbacks(warmup_epochs=0)
    with pytest.raises(TypeError, match=r"AtomicCheckpoint\(keep\)"):
        kcb.default_callbacks(checkpoint_dir=tmp_path, keep="3")
    with pytest.raises(ValueError, match=r"AtomicCheckpoint\(keep\)"):
        kcb.default_callbacks(checkpoint_dir=tmp_path, keep=0)


def test_default_callbacks_train_end_to_end(tmp_path):
    x, y = make_data()
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05))
    model = make_model(opt)
    cbs = kcb.default_callbacks(
        warmup_epochs=1,
        target_lr=0.05,
        checkpoint_dir=tmp_path / "ck",
        csv_path=tmp_path / "log.csv",
        verbose=0,
    )
    hist = model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=2,
        validation_data=(x, y),
        callbacks=cbs,
        verbose=kcb.verbosity(0),
    )
    assert {"loss", "val_loss", "loss_scale", "skipped_steps", "learning_rate"} <= set(hist.history)
    header = (tmp_path / "log.csv").read_text().splitlines()[0]
    assert "loss_scale" in header and "val_loss" in header
    assert kcb.latest_checkpoint(tmp_path / "ck").epoch == 2


def test_get_config_round_trips(tmp_path):
    for cb in [
        kcb.BroadcastInitialState(root=0),
        kcb.MetricAverage(),
        kcb.LearningRateWarmup(3, target_lr=0.1, steps_per_epoch=10),
        kcb.LossScaleMonitor(verbose=0, batch_logs=False),
        kcb.AtomicCheckpoint(tmp_path, keep=2),
    ]:
        clone = type(cb)(**cb.get_config())
        assert clone.get_config() == cb.get_config()


# --------------------------------------------------------------------------- two real processes


@requires_horovod
@pytest.mark.distributed
@pytest.mark.slow
def test_callbacks_across_two_processes(tmp_path):
    """One horovodrun job: broadcast, metric averaging, warm-up, monitor, chief-only writing."""
    results = run_workers("worker_cb_all.py", out_dir=tmp_path, timeout=240)
    r0, r1 = results
    # Ranks built different weights and optimizer state, and were identical after the broadcast.
    assert r0["diff_before"] > 0 and r0["opt_diff_before"] > 0
    assert r0["diff_after"] == 0.0 and r1["diff_after"] == 0.0
    assert r0["opt_diff_after"] == 0.0 and r1["opt_diff_after"] == 0.0
    assert r0["n_opt_vars"] >= 5  # iterations, learning rate, Adam moments (2 per variable)
    # Metric averaging: the raw per-rank metrics differ, the averaged ones are their mean.
    for epoch in range(len(r0["raw"])):
        raw0, raw1 = r0["raw"][epoch], r1["raw"][epoch]
        avg0, avg1 = r0["avg"][epoch], r1["avg"][epoch]
        assert raw0["loss"] != raw1["loss"]
        assert avg0 == avg1
        for key in ("loss", "val_loss", "mae"):
            assert avg0[key] == pytest.approx((raw0[key] + raw1[key]) / 2, rel=1e-12, abs=0)
    assert r0["history_loss"] == r1["history_loss"] == [a["loss"] for a in r0["avg"]]
    # Rank 1 started with loss scale 4096, rank 0 with 1024: the broadcast made it 1024 everywhere.
    assert [a["loss_scale"] for a in r1["avg"]] == [1024.0] * 3
    # Warm-up from 0.01 / 2 to 0.01 over the first epoch (4 batches), on both ranks.
    expected_lrs = [0.005 + 0.005 * b / 4 for b in range(4)] + [0.01] * 8
    for r in results:
        assert r["lrs"] == pytest.approx(expected_lrs, rel=1e-6)
    # Only the chief wrote checkpoints and logs.
    assert r0["ckpt_files"] == ["ckpt-0002.keras", "ckpt-0003.keras"]
    assert r1["ckpt_files"] == []
    assert r0["csv_exists"] and not r1["csv_exists"]
    assert r0["verbosity"] == "auto" and r1["verbosity"] == 0
    # The chief's CSV log holds the averaged metrics.
    assert r0["csv_last_loss"] == pytest.approx(r0["avg"][-1]["loss"], rel=1e-9)
    # A multi-rank Horovod fit: a plain optimizer is refused (it would not average), and a
    # step compiled with XLA is compiled again without it, the ranks identical after.
    for r in results:
        assert "does not average the gradients" in r["plain_refused"]
        assert r["jit_warned"] and not r["jit_after"] and r["jit_diff"] == 0.0
