"""``mnist1d``: MNIST-1D (Greydanus, "Scaling down deep learning", 2020), made on this machine.

MNIST-1D is 10 classes of 1-D signals of 40 floats: each digit's 12-point template is
padded, translated, scaled, sheared and given correlated and i.i.d. noise. The
``mnist1d`` package (``pip install mnist1d==0.0.2.post1``) generates it procedurally:
this module calls only ``mnist1d.data.make_dataset(mnist1d.data.get_dataset_args())``,
never ``get_dataset()``, which downloads a pickle. The package's default arguments
(5,000 signals, seed 42, ``train_split`` 0.8) give the paper's **4,000 train / 1,000
test** split, the same on every machine.

``make_dataset`` reseeds numpy's and Python's global random generators; their states
are put back afterwards, so loading the data does not change a caller's randomness.

Like ``kmp_pytext`` it lives in memory (a few hundred kB, generated in about a second)
and :mod:`kmp.datasets.memory` deals it to the ranks.
"""

from __future__ import annotations

import functools
import random

import numpy as np

from kmp._imports import optional_import

__all__ = ["NAME", "NUM_CLASSES", "SIGNAL_LENGTH", "load_arrays"]

NAME = "mnist1d"
NUM_CLASSES = 10
SIGNAL_LENGTH = 40
_SPLITS = {"train": ("x", "y"), "test": ("x_test", "y_test"), "validation": ("x_test", "y_test")}


@functools.lru_cache(maxsize=1)
def _generate() -> dict:
    data = optional_import("mnist1d.data", feature="the mnist1d data set")
    np_state, py_state = np.random.get_state(), random.getstate()
    try:
        return data.make_dataset(data.get_dataset_args())
    finally:
        np.random.set_state(np_state)
        random.setstate(py_state)


def load_arrays(split: str) -> tuple[np.ndarray, np.ndarray]:
    """Return ``(signals float32 [n, 40], labels int32 [n])`` of ``split``.

    Args:
        split: ``"train"`` (4,000) or ``"test"`` (1,000; ``"validation"`` is the same).

    Raises:
        ValueError: An unknown split.
        ImportError: The ``mnist1d`` package is missing (the message names the install).
    """
    if split not in _SPLITS:
        raise ValueError(f"{NAME} has the splits 'train' and 'test', not {split!r}.")
    x_key, y_key = _SPLITS[split]
    raw = _generate()
    return np.asarray(raw[x_key], np.float32), np.asarray(raw[y_key], np.int32)
