"""tf.data input pipelines from TensorFlow Datasets for multi-rank mixed-precision training.

:func:`load` returns the batches one rank trains on::

    import kmp
    kmp.distributed.init()
    kmp.enable()                                    # e.g. mixed_bfloat16
    train = kmp.data.load("kmp_digits", "train", batch_size=32, epochs=None)
    spec = kmp.data.shard_spec("kmp_digits", "train", batch_size=32)
    model.fit(train, epochs=10, steps_per_epoch=spec.steps_per_epoch)

What it does, in order:

1. **Shard.** The split is cut into ``size`` contiguous sub-splits with
   ``tfds.even_splits`` and rank ``r`` reads only the ``r``-th, so no example
   is read by two ranks and every example belongs to exactly one rank (sizes
   differ by at most one).
2. **Shuffle** the rank's shard (still encoded, so the buffer is cheap) with a
   seed derived from ``(seed, epoch)``: each epoch has its own order, and the
   same ``(seed, epoch)`` always gives the same order, also after a restart.
3. **Decode, normalise, cast** on the host: images to ``[0, 1]``, optionally
   resized, then cast to the compute dtype of the current Keras policy
   (e.g. bfloat16), so the model is fed in the dtype it computes in; labels
   to int32.
4. **Batch** with ``drop_remainder=True`` and stop every rank after the same
   number of steps, ``(num_examples // size) // batch_size``, so that no rank
   waits in a collective for a peer that has run out of data.
5. **Prefetch** with ``tf.data.AUTOTUNE``.

What is dropped: per epoch, ``num_examples - size * steps * batch_size``
examples of the split are not used (:attr:`ShardSpec.dropped_per_epoch`):
up to ``size - 1`` left over by the even split plus, on each rank, the tail
that does not fill a batch. Because the shards are reshuffled every epoch, the
batch tails are different examples each epoch; the even-split remainder (the
last examples of the larger shards) is read but trimmed by the step limit
when it falls at the end of the shuffled order.

Data sets are read from ``data_dir`` (default ``$KMP_DATA_DIR`` or
``~/.cache/kmp/tensorflow_datasets``). kmp's own data sets (``kmp_digits``,
``kmp_synthetic_images``, see :mod:`kmp.datasets`) are prepared there on
first use without network; any other TFDS image-classification data set must
already be prepared there, unless ``download=True``.
"""

from __future__ import annotations

import os
from typing import Any

from kmp._checks import check_int, is_int
from kmp._imports import optional_import
from kmp.sharding import (
    ShardSpec,
    check_seed,
    compute_dtype,
    epoch_seed,
    resolve_size,
    resolve_world,
    shard_counts,
)

__all__ = ["ShardSpec", "available", "load", "shard_spec"]

_DEFAULT_SHUFFLE_BUFFER = 10_000


# --------------------------------------------------------------------- builders


def _tfds() -> Any:
    return optional_import("tensorflow_datasets", feature="kmp.data")


def available(data_dir: str | os.PathLike | None = None) -> list[str]:
    """Names :func:`load` can read from ``data_dir`` without downloading.

    These are kmp's own data sets (prepared on demand) plus every TFDS data set
    already prepared in ``data_dir``.
    """
    from kmp import datasets

    return sorted(set(datasets.BUILDERS) | set(datasets.prepared_names(data_dir)))


def open_builder(
    name: str, data_dir: str | os.PathLike | None = None, *, download: bool = False
) -> Any:
    """Return a prepared TFDS builder for ``name`` in ``data_dir``.

    kmp's own data sets are prepared on first use (no network). Any other
    data set must be prepared in ``data_dir`` already, or ``download=True``
    lets TFDS download and prepare it.

    Args:
        name: TFDS name, optionally with config/version (``"mnist"``,
            ``"kmp_digits"``, ``"cifar10:3.0.2"``).
        data_dir: TFDS data directory; ``$KMP_DATA_DIR`` or the kmp cache when None.
        download: Let TFDS download and prepare a data set that is missing.

    Returns:
        The ``tfds`` builder, ready for ``as_dataset``.

    Raises:
        ValueError: The name is unknown (the message lists what is available
            locally), or the data set is not prepared in ``data_dir`` and
            ``download`` is False (the message says how to prepare it).
    """
    from kmp import datasets

    if not isinstance(name, str):
        raise TypeError(f"Data set name must be a string such as 'kmp_digits', got {name!r}.")
    if not name.strip():
        raise ValueError(f"Data set name must be a non-empty string, got {name!r}.")
    root = datasets.resolve_data_dir(data_dir)
    if name in datasets.BUILDERS:
        return datasets.prepare(name, root)
    tfds = _tfds()
    try:
        builder = tfds.builder(name, data_dir=str(root))
    except tfds.core.registered.DatasetNotFoundError:
        local = available(root)
        raise ValueError(
            f"Unknown data set {name!r}: it is neither a TFDS data set nor prepared in "
            f"{root}. Available here without download: {', '.join(local)}. "
            "Check the name, or pass data_dir= where the data set is prepared."
        ) from None
    if (_path(builder.data_path) / "dataset_info.json").is_file():
        return builder
    if not download:
        raise ValueError(
            f"Data set {name!r} is not prepared in {root} (no {_path(builder.data_path)}"
            "/dataset_info.json). Prepare it on a machine with internet with "
            f"`tfds build {name} --data_dir {root}` and copy that folder here, pass "
            f"data_dir= (or set $KMP_DATA_DIR) to where it is prepared, or call "
            f"kmp.data.load(..., download=True). Available here: {', '.join(available(root))}."
        )
    builder.download_and_prepare()
    return builder


def _path(p: Any) -> Any:
    from pathlib import Path

    return Path(os.fspath(p))


def _image_label_keys(builder: Any, name: str) -> tuple[str, str]:
    tfds = _tfds()
    keys = builder.info.supervised_keys or ("image", "label")
    features = builder.info.features
    if not (
        isinstance(keys, tuple)
        and len(keys) == 2
        and all(isinstance(k, str) for k in keys)
        and keys[0] in features
        and keys[1] in features
        and isinstance(features[keys[0]], tfds.features.Image)
        and isinstance(features[keys[1]], tfds.features.ClassLabel)
    ):
        raise ValueError(
            f"Data set {name!r} is not an image-classification data set that kmp.data can "
            f"read: it needs an Image feature and a ClassLabel feature (supervised keys "
            f"{keys!r}; features {sorted(features.keys())})."
        )
    return keys[0], keys[1]


def _num_examples(builder: Any, split: str, name: str) -> int:
    try:
        return int(builder.info.splits[split].num_examples)
    except (KeyError, ValueError) as exc:
        raise ValueError(
            f"Data set {name!r} has no split {split!r} ({exc}). Its splits: "
            f"{', '.join(builder.info.splits.keys())} (sub-splits like 'train[:50%]' work too)."
        ) from None


# -------------------------------------------------------------------- checking


def _image_hw(image_size: Any) -> tuple[int, int] | None:
    if image_size is None:
        return None
    hint = "Pass a positive int or (height, width)."
    if is_int(image_size):
        image_size = (image_size, image_size)
    if not isinstance(image_size, tuple | list):
        raise TypeError(
            f"image_size must be a positive int or (height, width), got {image_size!r}."
        )
    if len(image_size) != 2:
        raise ValueError(f"image_size must be (height, width): two sizes, got {image_size!r}.")
    h, w = (check_int("image_size", v, minimum=1, hint=hint) for v in image_size)
    return h, w


# ------------------------------------------------------------------ public API


def shard_spec(
    name: str,
    split: str = "train",
    *,
    batch_size: int | None,
    size: int | None = None,
    data_dir: str | os.PathLike | None = None,
    download: bool = False,
) -> ShardSpec:
    """Describe how ``split`` is divided among ``size`` ranks in batches of ``batch_size``.

    Args:
        name: Data set name (see :func:`load`).
        split: Split name.
        batch_size: Batch size per rank, or None for unbatched.
        size: Number of ranks; ``kmp.distributed.size()`` when None.
        data_dir: TFDS data directory (see :func:`load`).
        download: Let TFDS download a missing data set.

    Returns:
        The :class:`ShardSpec`.

    Raises:
        ValueError: Bad arguments, or too few examples for one batch per rank.
    """
    size = resolve_size(size)
    if batch_size is not None:
        check_int("batch_size", batch_size, minimum=1)
    builder = open_builder(name, data_dir, download=download)
    image_key, label_key = _image_label_keys(builder, name)
    n = _num_examples(builder, split, name)
    per_rank, steps, dropped = shard_counts(name, split, n, size, batch_size)
    features = builder.info.features
    return ShardSpec(
        name=name,
        split=split,
        num_examples=n,
        size=size,
        batch_size=batch_size,
        examples_per_rank=per_rank,
        steps_per_epoch=steps,
        dropped_per_epoch=dropped,
        num_classes=int(features[label_key].num_classes),
        image_shape=tuple(features[image_key].shape),
    )


def load(
    name: str,
    split: str = "train",
    *,
    batch_size: int | None,
    data_dir: str | os.PathLike | None = None,
    rank: int | None = None,
    size: int | None = None,
    shuffle: bool = True,
    seed: int = 0,
    epoch: int = 0,
    epochs: int | None = 1,
    steps_per_epoch: int | None = None,
    dtype: Any = None,
    image_size: int | tuple[int, int] | None = None,
    normalize: bool = True,
    shuffle_buffer: int = _DEFAULT_SHUFFLE_BUFFER,
    cache: bool = False,
    with_ids: bool = False,
    download: bool = False,
    skip_batches: int = 0,
) -> Any:
    """Return this rank's ``tf.data.Dataset`` of ``(images, labels)`` batches.

    See the module docstring for what the pipeline does and what it drops.

    Args:
        name: TFDS data set name (e.g. ``"kmp_digits"``, ``"kmp_synthetic_images"``,
            ``"mnist"``). Must be an image-classification data set (an Image and
            a ClassLabel feature).
        split: Split to read, e.g. ``"train"``, ``"test"``, ``"train[:80%]"``.
        batch_size: Examples per batch on this rank. None yields single
            examples: the whole shard, unbatched and untrimmed (for inspection).
        data_dir: TFDS data directory; ``$KMP_DATA_DIR`` or
            ``~/.cache/kmp/tensorflow_datasets`` when None.
        rank: This process's rank; ``kmp.distributed.rank()`` when None.
        size: Number of ranks; ``kmp.distributed.size()`` when None.
        shuffle: Shuffle each epoch (False: the stored order).
        seed: Base seed, ``0 <= seed < 2**31``; epoch ``e`` is shuffled with a
            seed that is a fixed function of ``(seed, e)`` (TensorFlow combines
            it with its global seed, e.g. from ``keras.utils.set_random_seed``,
            so keep that the same too when resuming).
        epoch: Number of the first epoch (pass ``initial_epoch`` when resuming,
            so the resumed epochs get their own orders rather than epoch 0's).
        epochs: How many epochs the dataset yields; None repeats forever.
            Every epoch yields exactly ``steps_per_epoch`` batches. With a
            number, epoch ``e`` is shuffled by ``(seed, e)`` alone, so a run
            resumed at ``epoch=k`` sees exactly the epochs an uninterrupted run
            sees from ``k`` on. With None, the orders after the first follow
            from ``(seed, epoch)`` but not epoch by epoch.
        steps_per_epoch: Batches per epoch, at most :attr:`ShardSpec.steps_per_epoch`
            (the default): fewer makes short epochs, each still a fresh
            shuffle of the whole shard.
        dtype: Dtype of the images; the current Keras policy's compute dtype
            when None (bfloat16 under ``mixed_bfloat16``).
        image_size: Resize images to this size (int or ``(height, width)``).
        normalize: Scale pixel values from ``0..255`` to ``[0, 1]``.
        shuffle_buffer: Maximum shuffle buffer (encoded examples); the shard is
            shuffled completely when it is smaller.
        cache: Keep the rank's decoded shard (uint8 images) in memory after the
            first epoch; for data sets that fit in memory.
        with_ids: Also yield each example's ``tfds_id`` string (for checks).
        download: Let TFDS download and prepare a missing data set.
        skip_batches: For a resume inside an epoch (a step checkpoint's
            ``latest_checkpoint(...).step``, with ``epoch=...epoch``): the first
            epoch's first ``skip_batches`` batches are empty placeholders (0
            examples), their examples read and shuffled as stored but never
            decoded; the epoch keeps its number of batches, so Keras counts it as
            before, and :class:`~kmp.callbacks.AtomicCheckpoint` drops them. Needs
            ``batch_size`` and a number of ``epochs``. Where images have no fixed
            size (no ``image_size``), the batches are decoded as usual instead.

    Returns:
        A ``tf.data.Dataset`` of ``(images, labels)`` (or ``(images, labels, ids)``).

    Raises:
        ValueError: Unknown data set (the message lists what is available),
            data set not prepared (the message says how to prepare it), a bad
            split, rank, size, batch size, dtype or image size.
    """
    import tensorflow as tf

    tfds = _tfds()
    rank, size = resolve_world(rank, size)
    check_seed(seed)
    check_int("epoch", epoch, minimum=0)
    if epochs is not None:
        check_int("epochs", epochs, minimum=1)
    check_int("shuffle_buffer", shuffle_buffer, minimum=1)
    out_dtype = compute_dtype(dtype)
    hw = _image_hw(image_size)
    spec = shard_spec(
        name, split, batch_size=batch_size, size=size, data_dir=data_dir, download=download
    )
    steps = spec.steps_per_epoch
    if steps_per_epoch is not None:
        if batch_size is None:
            raise ValueError("steps_per_epoch needs a batch_size (it counts batches).")
        check_int("steps_per_epoch", steps_per_epoch, minimum=1)
        if steps_per_epoch > spec.steps_per_epoch:
            raise ValueError(
                f"steps_per_epoch={steps_per_epoch} is more than the "
                f"{spec.steps_per_epoch} full batches of {batch_size} that each of "
                f"{size} rank(s) gets from {split!r} of {name!r}; use at most that."
            )
        steps = steps_per_epoch
    check_int("skip_batches", skip_batches, minimum=0)
    if skip_batches and (batch_size is None or epochs is None or skip_batches >= steps):
        raise ValueError(
            f"skip_batches={skip_batches} needs a batch_size, a number of epochs (not None: "
            f"the first epoch is then the one resumed) and fewer than the epoch's {steps} "
            "batches; pass the checkpoint's step (kmp.callbacks.latest_checkpoint(...).step)."
        )
    builder = open_builder(name, data_dir, download=download)
    image_key, label_key = _image_label_keys(builder, name)
    image_feature = builder.info.features[image_key]

    sub_split = tfds.even_splits(split, n=size)[rank]
    base = builder.as_dataset(
        split=sub_split,
        shuffle_files=False,
        decoders={image_key: tfds.decode.SkipDecoding()},
        read_config=tfds.ReadConfig(add_tfds_id=with_ids, try_autocache=False),
    )
    shard_len = spec.num_examples // size + (1 if rank < spec.num_examples % size else 0)
    buffer = max(1, min(shuffle_buffer, shard_len))

    def decode(example: dict) -> dict:
        return {**example, image_key: image_feature.decode_example(example[image_key])}

    def convert(example: dict) -> tuple:
        image = tf.cast(example[image_key], tf.float32)
        if hw is not None:
            image = tf.image.resize(image, hw)
        if normalize:
            image = image / 255.0
        out = (tf.cast(image, out_dtype), tf.cast(example[label_key], tf.int32))
        return (*out, example["tfds_id"]) if with_ids else out

    if cache:  # decode once, keep the decoded shard in memory, shuffle decoded examples
        base = base.map(decode, num_parallel_calls=tf.data.AUTOTUNE).cache()

    def one_epoch(epoch_seed: int, reshuffle: bool = False, skip: int = 0) -> Any:
        ds = base
        if shuffle:
            ds = ds.shuffle(buffer, seed=epoch_seed, reshuffle_each_iteration=reshuffle)
        ds = ds.skip(skip * batch_size) if skip else ds  # read in order, never decoded
        if not cache:  # shuffled while encoded (a cheap buffer), decoded after
            ds = ds.map(decode, num_parallel_calls=tf.data.AUTOTUNE)
        if batch_size is not None:  # convert whole batches: fewer, larger ops
            ds = ds.batch(batch_size, drop_remainder=True).take(steps - skip)
        ds = ds.map(convert, num_parallel_calls=tf.data.AUTOTUNE)
        return _placeholders(ds.element_spec, skip).concatenate(ds) if skip else ds

    # Seeds are Python ints: TensorFlow's seed handling breaks on tensor seeds when the
    # global seed is 0 (keras.utils.set_random_seed(0)), so epochs are chained in Python.
    if epochs is None:
        ds = one_epoch(epoch_seed(seed, epoch), reshuffle=True).repeat()
    else:
        ds = one_epoch(epoch_seed(seed, epoch))
        if skip_batches and all(t.shape[1:].is_fully_defined() for t in ds.element_spec):
            ds = one_epoch(epoch_seed(seed, epoch), skip=skip_batches)  # fixed image sizes
        for e in range(epoch + 1, epoch + epochs):
            ds = ds.concatenate(one_epoch(epoch_seed(seed, e)))
    if epochs is not None:
        per_epoch = steps if batch_size is not None else shard_len
        ds = ds.apply(tf.data.experimental.assert_cardinality(per_epoch * epochs))
    return ds.prefetch(tf.data.AUTOTUNE)


def _placeholders(element_spec: Any, count: int) -> Any:
    """``count`` empty batches (0 examples) of ``element_spec``'s dtypes and example shapes."""
    import tensorflow as tf

    empty = tuple(
        tf.reshape(tf.constant([], dtype=t.dtype), [0, *t.shape[1:]]) for t in element_spec
    )
    return tf.data.Dataset.from_tensors(empty).repeat(count)
