"""``kmp_digits``: scikit-learn's handwritten digits as a TFDS data set, made offline.

The 1,797 images of ``sklearn.datasets.load_digits`` are real 8x8 scans of
handwritten digits (UCI "Optical Recognition of Handwritten Digits"), shipped
inside the scikit-learn package. Their pixels are integers 0..16; they are
stored as uint8 images 0..255 (``round(v * 255 / 16)``, one-to-one, so nothing
is lost) so that the usual ``/ 255`` normalisation applies.

The split is fixed: per class, a permutation drawn from ``numpy``'s PCG64 with
seed 0 puts ``round(0.2 * n_class)`` images into ``test`` and the rest into
``train`` (1,438 train / 359 test). Each example keeps its scikit-learn row as
``index``.

Importing this module imports TensorFlow Datasets; use it through
:func:`kmp.datasets.prepare` or :func:`kmp.data.load`.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import numpy as np
import tensorflow_datasets as tfds

from kmp._imports import optional_import

__all__ = ["KmpDigits", "TEST_FRACTION", "SPLIT_SEED", "load_arrays", "split_indices"]

TEST_FRACTION = 0.2
SPLIT_SEED = 0


def split_indices(
    labels: np.ndarray, test_fraction: float = TEST_FRACTION, seed: int = SPLIT_SEED
) -> tuple[np.ndarray, np.ndarray]:
    """Return sorted ``(train, test)`` row indices of a stratified split.

    Args:
        labels: Integer class of each example.
        test_fraction: Share of each class that goes to ``test`` (rounded per class).
        seed: Seed of the per-class permutations (``numpy.random.default_rng``).

    Returns:
        Two disjoint sorted index arrays that together cover ``range(len(labels))``.
    """
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    train, test = [], []
    for cls in np.unique(labels):
        rows = rng.permutation(np.flatnonzero(labels == cls))
        n_test = round(test_fraction * len(rows))
        test.append(rows[:n_test])
        train.append(rows[n_test:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def load_arrays() -> tuple[np.ndarray, np.ndarray]:
    """Return the digits as ``(images uint8 [1797, 8, 8, 1] in 0..255, labels int64 [1797])``."""
    sk_datasets = optional_import("sklearn.datasets", feature="the kmp_digits data set")
    bunch = sk_datasets.load_digits()
    images = np.rint(bunch.images * (255.0 / 16.0)).astype(np.uint8)[..., None]
    return images, bunch.target.astype(np.int64)


class KmpDigits(tfds.core.GeneratorBasedBuilder):
    """Handwritten digits 0-9 (8x8 grayscale) from scikit-learn, prepared offline."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES: ClassVar[dict[str, str]] = {
        "1.0.0": "scikit-learn digits, stratified 80/20 split, seed 0."
    }
    # TFDS 4.9.10 finds a builder's source file through `importlib_resources`, a package
    # it only declares for Python < 3.9; naming the file here skips that lookup.
    code_path = Path(__file__)

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description=(
                "1,797 real 8x8 grayscale handwritten digits (10 classes) from "
                "sklearn.datasets.load_digits, pixels rescaled from 0..16 to 0..255, "
                f"with a fixed stratified split: {TEST_FRACTION:.0%} of each class in "
                f"'test' (seed {SPLIT_SEED}). 'index' is the scikit-learn row."
            ),
            features=tfds.features.FeaturesDict(
                {
                    "image": tfds.features.Image(shape=(8, 8, 1)),
                    "label": tfds.features.ClassLabel(num_classes=10),
                    "index": np.int64,
                }
            ),
            supervised_keys=("image", "label"),
            homepage="https://scikit-learn.org/stable/datasets/toy_dataset.html#digits-dataset",
            citation=(
                "E. Alpaydin, C. Kaynak. Optical Recognition of Handwritten Digits. "
                "UCI Machine Learning Repository, 1998."
            ),
        )

    def _split_generators(self, dl_manager):  # nothing to download
        images, labels = load_arrays()
        train, test = split_indices(labels)
        return {
            "train": self._generate_examples(images, labels, train),
            "test": self._generate_examples(images, labels, test),
        }

    def _generate_examples(self, images, labels, rows):
        for row in rows:
            row = int(row)
            yield row, {"image": images[row], "label": int(labels[row]), "index": row}
