"""In-memory data sets dealt to the ranks: ``kmp_pytext`` (bytes) and ``mnist1d`` (signals).

:func:`load` is :func:`kmp.data.load` for data that lives in memory rather than in a
prepared TFDS folder, with the same rules::

    train = kmp.datasets.memory.load("kmp_pytext", "train", batch_size=16, seq_len=128)
    spec = kmp.datasets.memory.shard_spec("mnist1d", "train", batch_size=100)

1. **Shard.** The split's examples are cut into ``size`` contiguous parts (sizes differ by
   at most one, like ``tfds.even_splits``); rank ``r`` reads only the ``r``-th.
2. **Shuffle** the rank's part every epoch with ``numpy.random.default_rng`` seeded by
   :func:`kmp.sharding.epoch_seed` of ``(seed, epoch)``: each epoch its own order, the
   same order again after a restart.
3. **Batch** with ``drop_remainder`` and the same number of steps on every rank,
   ``(num_examples // size) // batch_size`` (:attr:`kmp.data.ShardSpec.steps_per_epoch`).
4. **Cast** float inputs to the policy's compute dtype (tokens stay int32), labels int32.

``batch_size=None`` yields the rank's whole part once, unshuffled and unbatched, for
evaluation. The names and their options live in :data:`NAMES`.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from kmp import sharding
from kmp._checks import check_int
from kmp.sharding import ShardSpec

__all__ = ["NAMES", "arrays", "load", "shard_spec"]

# name -> the options it takes (beyond the common ones) and what it is.
NAMES: dict[str, str] = {
    "kmp_pytext": "byte-level text (the stdlib's sources or text_dir); options seq_len, "
    "text_dir, max_bytes",
    "mnist1d": "MNIST-1D, 4,000 train / 1,000 test signals of 40 floats, 10 classes",
}
DEFAULT_SEQ_LEN = 128


def arrays(
    name: str,
    split: str,
    *,
    seq_len: int = DEFAULT_SEQ_LEN,
    text_dir: str | os.PathLike | None = None,
    max_bytes: int | None = None,
) -> tuple[np.ndarray, np.ndarray, int]:
    """Return ``(inputs, targets, num_classes)`` of one split, whole, in stored order.

    Args:
        name: One of :data:`NAMES`.
        split: ``"train"``, ``"validation"`` or ``"test"`` (the last two are the same data).
        seq_len: ``kmp_pytext`` only: bytes per sequence.
        text_dir: ``kmp_pytext`` only: a folder of text files (None: the stdlib's sources).
        max_bytes: ``kmp_pytext`` only: cap on the corpus (see :mod:`kmp.datasets.text`).

    Raises:
        ValueError: An unknown name or split, options the data set does not take, or
            text too short for one sequence.
    """
    if name == "kmp_pytext":
        from kmp.datasets import text

        corpus = text.read_corpus(text_dir, max_bytes)
        inputs, targets = text.windows(text.split_bytes(corpus.data, split), seq_len)
        return inputs, targets, text.VOCAB_SIZE
    if name == "mnist1d":
        if text_dir is not None or max_bytes is not None or seq_len != DEFAULT_SEQ_LEN:
            raise ValueError("mnist1d takes no seq_len, text_dir or max_bytes: leave them out.")
        from kmp.datasets import mnist1d

        x, y = mnist1d.load_arrays(split)
        return x, y, mnist1d.NUM_CLASSES
    raise ValueError(
        f"{name!r} is not an in-memory kmp data set; these are {', '.join(NAMES)} "
        "(TFDS data sets load through kmp.data.load)."
    )


def _spec(name: str, split: str, n: int, size: int, batch_size: int | None, shape, classes):
    if batch_size is not None:
        check_int("batch_size", batch_size, minimum=1)
    per_rank, steps, dropped = sharding.shard_counts(name, split, n, size, batch_size)
    return ShardSpec(name, split, n, size, batch_size, per_rank, steps, dropped, classes, shape)


def shard_spec(
    name: str, split: str = "train", *, batch_size: int | None, size: int | None = None, **options
) -> ShardSpec:
    """Describe how ``split`` is dealt to ``size`` ranks (see :func:`kmp.data.shard_spec`).

    ``image_shape`` is the shape of one input (``(seq_len,)`` or ``(40,)``) and
    ``num_classes`` the output classes (256 bytes, or 10 digits). ``options`` go to
    :func:`arrays`.
    """
    size = sharding.resolve_size(size)
    x, _, classes = arrays(name, split, **options)
    return _spec(name, split, len(x), size, batch_size, tuple(x.shape[1:]), classes)


def load(
    name: str,
    split: str = "train",
    *,
    batch_size: int | None,
    rank: int | None = None,
    size: int | None = None,
    shuffle: bool = True,
    seed: int = 0,
    epoch: int = 0,
    epochs: int = 1,
    steps_per_epoch: int | None = None,
    dtype: Any = None,
    **options,
) -> Any:
    """Return this rank's ``tf.data.Dataset`` of ``(inputs, targets)`` batches.

    Args:
        name: One of :data:`NAMES`.
        split: Split to read.
        batch_size: Examples per batch on this rank; None for the rank's part, unbatched.
        rank: This process's rank; ``kmp.distributed.rank()`` when None.
        size: Number of ranks; ``kmp.distributed.size()`` when None.
        shuffle: Shuffle every epoch (False: the stored order).
        seed: Base seed, ``0 <= seed < 2**31``; epoch ``e`` is shuffled by a fixed function of
            ``(seed, e)``.
        epoch: Number of the first epoch (``initial_epoch`` when resuming).
        epochs: How many epochs the data set yields (an int: the orders are made up front).
        steps_per_epoch: Batches per epoch, at most the spec's (the default).
        dtype: Dtype of float inputs; the current policy's compute dtype when None.
        **options: Data-set options (:func:`arrays`), e.g. ``seq_len``, ``text_dir``.

    Raises:
        ValueError: Bad arguments (the message says what to pass).
    """
    import tensorflow as tf

    rank, size = sharding.resolve_world(rank, size)
    sharding.check_seed(seed)
    check_int("epoch", epoch, minimum=0)
    check_int("epochs", epochs, minimum=1)
    x, y, classes = arrays(name, split, **options)
    sharding.compute_dtype(dtype)  # a bad dtype fails here, before any work
    spec = _spec(name, split, len(x), size, batch_size, tuple(x.shape[1:]), classes)
    part = np.array_split(np.arange(len(x)), size)[rank]
    if batch_size is None:
        ds = tf.data.Dataset.from_tensor_slices((x[part], y[part]))
        return ds.map(lambda a, b: (_cast(a, dtype), b))
    steps = spec.steps_per_epoch
    if steps_per_epoch is not None:
        check_int("steps_per_epoch", steps_per_epoch, minimum=1)
        if steps_per_epoch > steps:
            raise ValueError(
                f"steps_per_epoch={steps_per_epoch} is more than the {steps} full batches of "
                f"{batch_size} that each of {size} rank(s) gets from {split!r} of {name!r}."
            )
        steps = steps_per_epoch
    orders = []
    for e in range(epoch, epoch + epochs):
        order = part
        if shuffle:
            order = np.random.default_rng(sharding.epoch_seed(seed, e)).permutation(part)
        orders.append(order[: steps * batch_size])
    index = np.concatenate(orders).reshape(-1, batch_size)
    xs, ys = tf.constant(x), tf.constant(y)
    ds = tf.data.Dataset.from_tensor_slices(index)
    ds = ds.map(lambda i: (_cast(tf.gather(xs, i), dtype), tf.gather(ys, i)))
    return ds.prefetch(tf.data.AUTOTUNE)


def _cast(inputs: Any, dtype: Any) -> Any:
    import tensorflow as tf

    if not inputs.dtype.is_floating:
        return inputs  # byte tokens stay int32
    return tf.cast(inputs, sharding.compute_dtype(dtype))
