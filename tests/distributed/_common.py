"""Helpers for worker scripts started under horovodrun by the tests."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_result(rank: int, payload: dict) -> None:
    """Write this rank's result where the test (tests/_support.py:run_workers) reads it."""
    out = Path(os.environ["KMP_TEST_OUT"])
    tmp = out / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps(payload))
    tmp.replace(out / f"rank{rank}.json")


def rank_spread(weights: list) -> float:
    """Max |rank0 - rank1| over all ``weights`` (arrays), through one real allgather."""
    import numpy as np
    import tensorflow as tf

    import kmp.distributed as dist

    flat = np.concatenate([np.ravel(np.asarray(w, "float64")) for w in weights])
    g = dist.allgather(tf.constant(flat)[None]).numpy()
    return float(np.max(np.abs(g[0] - g[1])))
