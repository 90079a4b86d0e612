"""kmp.callbacks.metrics: MetricAverage (two real ranks: test_cb_defaults)."""

from __future__ import annotations

import numpy as np
import pytest

import kmp.distributed
from kmp import callbacks as kcb


def test_metric_average_is_identity_in_one_process():
    logs = {"loss": 0.5, "val_loss": 0.25, "note": "text"}
    kcb.MetricAverage().on_epoch_end(0, logs)
    assert logs == {"loss": 0.5, "val_loss": 0.25, "note": "text"}


@pytest.fixture
def two_ranks(monkeypatch):
    """A world of two whose other rank logs ``other`` (the same keys unless changed)."""
    world = {"other": None}

    def allgather(local):
        other = local if world["other"] is None else world["other"]
        return np.concatenate([np.asarray(local), np.asarray(other)])

    monkeypatch.setattr(kmp.distributed, "size", lambda: 2)
    monkeypatch.setattr(kmp.distributed, "allgather", allgather)
    monkeypatch.setattr(kmp.distributed, "allreduce", lambda v, op: (np.asarray(v) + 1.0) / 2)
    return world


def test_metric_average_replaces_numbers_with_the_mean(two_ranks):
    logs = {"loss": 3.0, "val_loss": np.float32(5.0), "note": "text", "flag": True}
    kcb.MetricAverage().on_epoch_end(0, logs)  # the other rank logs 1.0 for every metric
    assert logs == {"loss": 2.0, "val_loss": 3.0, "note": "text", "flag": True}


def test_metric_average_refuses_different_metric_names(two_ranks):
    two_ranks["other"] = np.array([1, 12345], dtype=np.int64)
    with pytest.raises(ValueError, match=r"different metrics at the end of epoch 3"):
        kcb.MetricAverage().on_epoch_end(2, {"loss": 1.0})
