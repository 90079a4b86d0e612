"""``kmp_synthetic_images``: SYNTHETIC 64x64 RGB images in 10 classes, made offline.

These are generated, not real photographs: they exist so that image models
built for ImageNet-like inputs (ResNet-50) can be trained for a few steps
here, through the same TFDS pipeline as real data, with no download. Each
class is a striped pattern with its own orientation, stripe frequency and
colour, plus per-image random phase and noise, so a model can learn it but
the numbers say nothing about real-image accuracy.

Examples are a pure function of (split, index) via ``numpy``'s PCG64, so
every preparation writes the same data: 512 ``train`` and 128 ``test``
images, classes balanced.

Importing this module imports TensorFlow Datasets; use it through
:func:`kmp.datasets.prepare` or :func:`kmp.data.load`.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import numpy as np
import tensorflow_datasets as tfds

__all__ = ["IMAGE_SIZE", "NUM_CLASSES", "SPLIT_SIZES", "KmpSyntheticImages", "make_example"]

IMAGE_SIZE = 64
NUM_CLASSES = 10
SPLIT_SIZES = {"train": 512, "test": 128}
_SPLIT_IDS = {"train": 0, "test": 1}


def make_example(split: str, index: int) -> tuple[np.ndarray, int]:
    """Return the ``(uint8 [64, 64, 3] image, label)`` at ``index`` of ``split``."""
    label = index % NUM_CLASSES
    rng = np.random.default_rng([_SPLIT_IDS[split], index])
    angle = np.pi * label / NUM_CLASSES
    freq = 2.0 + (label % 5)  # stripes across the image
    yy, xx = np.mgrid[0:IMAGE_SIZE, 0:IMAGE_SIZE] / IMAGE_SIZE
    phase = rng.uniform(0, 2 * np.pi)
    wave = np.sin(2 * np.pi * freq * (xx * np.cos(angle) + yy * np.sin(angle)) + phase)
    hue = np.array([np.cos(angle), np.cos(angle + 2.1), np.cos(angle + 4.2)])
    colour = 0.5 + 0.35 * hue  # a per-class RGB tint
    image = 0.5 + 0.3 * wave[..., None] * colour[None, None, :] + 0.1 * (colour - 0.5)
    image = image + rng.normal(0.0, 0.08, size=image.shape)
    return np.clip(np.rint(image * 255), 0, 255).astype(np.uint8), label


class KmpSyntheticImages(tfds.core.GeneratorBasedBuilder):
    """SYNTHETIC striped 64x64 RGB images, 10 classes, for small-scale image-model runs."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES: ClassVar[dict[str, str]] = {
        "1.0.0": "512 train / 128 test synthetic 64x64 RGB images."
    }
    # TFDS 4.9.10 finds a builder's source file through `importlib_resources`, a package
    # it only declares for Python < 3.9; naming the file here skips that lookup.
    code_path = Path(__file__)

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description=(
                "SYNTHETIC data, not real images: 64x64 RGB striped patterns, one "
                "orientation/frequency/colour per class (10 classes), random phase and "
                "noise per image. For smoke-testing image models offline."
            ),
            features=tfds.features.FeaturesDict(
                {
                    "image": tfds.features.Image(shape=(IMAGE_SIZE, IMAGE_SIZE, 3)),
                    "label": tfds.features.ClassLabel(num_classes=NUM_CLASSES),
                }
            ),
            supervised_keys=("image", "label"),
        )

    def _split_generators(self, dl_manager):  # nothing to download
        return {split: self._generate_examples(split) for split in SPLIT_SIZES}

    def _generate_examples(self, split):
        for index in range(SPLIT_SIZES[split]):
            image, label = make_example(split, index)
            yield index, {"image": image, "label": label}
