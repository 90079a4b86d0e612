"""MetricAverage: epoch-end metrics averaged over all ranks."""

from __future__ import annotations

import zlib
from typing import Any

import keras
import numpy as np

from kmp import distributed
from kmp.callbacks._ranks import to_float, world_size

__all__ = ["MetricAverage"]


class MetricAverage(keras.callbacks.Callback):
    """Average the epoch-end metrics over all ranks.

    Each rank computes its metrics on its own shard of the data; at the end of
    every epoch this replaces every numeric entry of ``logs`` (``loss``,
    ``val_loss``, ...) with its mean over the ranks (one allreduce), so that
    every rank, and the chief's logs, report global metrics. Put it before any
    callback that reads the epoch logs. Batch-level logs stay per rank.

    All ranks must log the same metric names; a mismatch raises on every rank
    instead of hanging.
    """

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        """Replace the numeric entries of ``logs`` with their mean over ranks."""
        if not logs or world_size() == 1:
            return
        keys = sorted(k for k, v in logs.items() if _is_number(v))
        signature = zlib.crc32("\0".join(keys).encode())
        local = np.array([len(keys), signature], dtype=np.int64)
        gathered = np.asarray(distributed.allgather(local)).reshape(-1, 2)
        if not (gathered == gathered[0]).all():
            raise ValueError(
                f"MetricAverage: the ranks log different metrics at the end of epoch {epoch + 1} "
                f"(this rank: {keys}). Give every rank the same callbacks, metrics and "
                "validation data so that their logs have the same keys."
            )
        if not keys:
            return
        values = np.array([to_float(logs[k]) for k in keys], dtype=np.float64)
        averaged = np.asarray(distributed.allreduce(values, op="average"), dtype=np.float64)
        for k, v in zip(keys, averaged.tolist(), strict=True):
            logs[k] = v

    def get_config(self) -> dict[str, Any]:
        """Return the constructor arguments (none)."""
        return {}


def _is_number(value: Any) -> bool:
    """True for a numeric scalar log entry (a bool, a string or None is none)."""
    if isinstance(value, bool | str | bytes) or value is None:
        return False
    try:
        return np.asarray(value).size == 1 and np.issubdtype(np.asarray(value).dtype, np.number)
    except Exception:  # anything that is not array-like is not a metric
        return False
