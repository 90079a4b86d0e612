"""kmp.data: per-rank shards, per-epoch shuffling, dtype casting, bad input."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import keras
import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from kmp import data, datasets
from tests._support import requires_horovod, run_workers


class TinyTestImages(tfds.core.GeneratorBasedBuilder):
    """A non-kmp image-classification data set: 10 RGB 4x4 images, 3 classes."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES: ClassVar[dict[str, str]] = {"1.0.0": "test"}

    def _info(self):
        return tfds.core.DatasetInfo(
            builder=self,
            features=tfds.features.FeaturesDict(
                {
                    "picture": tfds.features.Image(shape=(4, 4, 3)),
                    "kind": tfds.features.ClassLabel(num_classes=3),
                }
            ),
            supervised_keys=("picture", "kind"),
        )

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples()}

    def _generate_examples(self):
        for i in range(10):
            yield i, {"picture": np.full((4, 4, 3), 20 * i, np.uint8), "kind": i % 3}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tfds")
    datasets.prepare("kmp_digits", root)
    return root


def _ids(ds) -> list[bytes]:
    return [bytes(i) for batch in ds for i in np.atleast_1d(batch[2].numpy())]


@pytest.mark.parametrize("size", [1, 2, 3])
def test_shards_are_disjoint_and_cover_the_split(data_dir, size):
    shards = [
        _ids(
            data.load(
                "kmp_digits",
                "train",
                batch_size=None,
                rank=r,
                size=size,
                data_dir=data_dir,
                with_ids=True,
            )
        )
        for r in range(size)
    ]
    flat = [i for shard in shards for i in shard]
    assert len(flat) == len(set(flat)) == 1438  # disjoint, and together the whole split
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    for shard in shards:
        assert len(shard) == len(set(shard))


@pytest.mark.parametrize("size", [2, 3])
def test_batched_ranks_run_the_same_steps_and_drop_what_the_spec_says(data_dir, size):
    batch = 64
    spec = data.shard_spec("kmp_digits", "train", batch_size=batch, size=size, data_dir=data_dir)
    assert spec.steps_per_epoch == (1438 // size) // batch
    seen = []
    for r in range(size):
        ds = data.load(
            "kmp_digits",
            "train",
            batch_size=batch,
            rank=r,
            size=size,
            data_dir=data_dir,
            with_ids=True,
        )
        batches = list(ds)
        assert len(batches) == spec.steps_per_epoch == int(ds.cardinality())
        assert all(b[0].shape[0] == batch for b in batches)
        seen += [bytes(i) for b in batches for i in b[2].numpy()]
    assert len(seen) == len(set(seen))  # no example twice in one epoch
    assert 1438 - len(seen) == spec.dropped_per_epoch


def test_each_epoch_has_its_own_reproducible_order(data_dir):
    def order(**kw):
        ds = data.load(
            "kmp_digits",
            "train",
            batch_size=None,
            rank=0,
            size=2,
            data_dir=data_dir,
            with_ids=True,
            **kw,
        )
        return _ids(ds)

    e0, e1 = order(epoch=0), order(epoch=1)
    assert e0 == order(epoch=0)  # same (seed, epoch): same order
    assert e0 != e1 and sorted(e0) == sorted(e1)  # another epoch: same shard, new order
    assert order(epoch=0, seed=1) != e0
    assert order(shuffle=False) == sorted(e0, key=order(shuffle=False).index)
    # A stream of epochs 0..2 is epoch 0, then 1, then 2, so a resumed run that starts at
    # epoch 1 sees exactly what an uninterrupted run sees from its second epoch on.
    stream = order(epoch=0, epochs=3)
    assert stream == e0 + e1 + order(epoch=2)
    assert order(epoch=1, epochs=2) == stream[len(e0) :]


@pytest.mark.parametrize("cache", [False, True])
def test_skipped_batches_of_a_resumed_epoch_are_empty_and_the_rest_unchanged(data_dir, cache):
    """A resume inside an epoch: the first batches are placeholders with no examples (never
    decoded), the epoch keeps its number of batches, and every later batch is the one the
    uninterrupted stream has there."""
    args = dict(batch_size=16, rank=0, size=2, data_dir=data_dir, with_ids=True, cache=cache)
    whole = list(data.load("kmp_digits", "train", epoch=1, epochs=2, **args))
    resumed = list(data.load("kmp_digits", "train", epoch=1, epochs=2, skip_batches=3, **args))
    assert len(resumed) == len(whole)
    assert [int(b[0].shape[0]) for b in resumed[:4]] == [0, 0, 0, 16]
    assert all(b[1].shape == (0,) and b[2].shape == (0,) for b in resumed[:3])
    for got, want in zip(resumed[3:], whole[3:], strict=True):
        assert np.array_equal(got[2].numpy(), want[2].numpy())  # the same examples
        assert np.array_equal(got[0].numpy(), want[0].numpy())  # decoded the same way


def test_skip_batches_needs_a_batched_finite_stream_shorter_than_the_epoch(data_dir):
    args = dict(rank=0, size=1, data_dir=data_dir)
    for kwargs in ({"batch_size": None}, {"batch_size": 8, "epochs": None}):
        with pytest.raises(ValueError, match="skip_batches=2 needs a batch_size, a number"):
            data.load("kmp_digits", "train", skip_batches=2, **{**args, **kwargs})
    with pytest.raises(ValueError, match="fewer than the epoch's 4 batches"):
        data.load("kmp_digits", "train", batch_size=8, steps_per_epoch=4, skip_batches=4, **args)


def test_cache_and_global_seed_zero_keep_the_orders(data_dir):
    def order(**kw):
        ds = data.load(
            "kmp_digits",
            "train",
            batch_size=None,
            rank=1,
            size=2,
            data_dir=data_dir,
            with_ids=True,
            epoch=3,
            **kw,
        )
        return _ids(ds)

    plain = order()
    assert order(cache=True) == plain
    # keras.utils.set_random_seed(0) sets TensorFlow's global seed to 0; TF's own
    # handling of tensor-valued shuffle seeds breaks on exactly that value.
    keras.utils.set_random_seed(0)
    try:
        stream = order(epochs=2)
        assert len(stream) == 2 * len(plain)
    finally:
        tf.random.set_seed(None)


def test_repeating_forever_and_cardinality(data_dir):
    ds = data.load(
        "kmp_digits", "train", batch_size=100, rank=0, size=1, data_dir=data_dir, epochs=None
    )
    assert int(ds.cardinality()) < 0  # not finite (unknown or infinite)
    assert len(list(ds.take(40))) == 40  # 14 steps per epoch, so this crosses two epochs
    ds = data.load(
        "kmp_digits", "train", batch_size=100, rank=0, size=1, data_dir=data_dir, epochs=3
    )
    assert int(ds.cardinality()) == 3 * 14 == len(list(ds))


@pytest.mark.parametrize(
    ("policy", "expected"),
    [("float32", tf.float32), ("mixed_bfloat16", tf.bfloat16), ("mixed_float16", tf.float16)],
)
def test_images_follow_the_policy_compute_dtype(data_dir, policy, expected):
    keras.config.set_dtype_policy(policy)
    images, labels = next(
        iter(data.load("kmp_digits", "test", batch_size=8, rank=0, size=1, data_dir=data_dir))
    )
    assert images.dtype == expected and images.shape == (8, 8, 8, 1)
    assert labels.dtype == tf.int32
    values = images.numpy().astype(np.float32)
    assert values.min() >= 0.0 and values.max() <= 1.0 and values.max() > 0.5


def test_explicit_dtype_resize_and_raw_pixels(data_dir):
    keras.config.set_dtype_policy("mixed_bfloat16")
    images, _ = next(
        iter(
            data.load(
                "kmp_digits",
                "test",
                batch_size=4,
                rank=0,
                size=1,
                data_dir=data_dir,
                dtype="float32",
                image_size=16,
            )
        )
    )
    assert images.dtype == tf.float32 and images.shape == (4, 16, 16, 1)
    raw, _ = next(
        iter(
            data.load(
                "kmp_digits",
                "test",
                batch_size=4,
                rank=0,
                size=1,
                data_dir=data_dir,
                normalize=False,
                shuffle=False,
            )
        )
    )
    assert raw.numpy().max() == 255.0  # unnormalised pixels keep 0..255


def test_any_tfds_image_classification_set_in_a_data_dir(tmp_path):
    TinyTestImages(data_dir=str(tmp_path)).download_and_prepare()
    assert "tiny_test_images" in data.available(tmp_path)
    spec = data.shard_spec("tiny_test_images", batch_size=2, size=2, data_dir=tmp_path)
    assert (spec.num_classes, spec.image_shape, spec.steps_per_epoch) == (3, (4, 4, 3), 2)
    assert spec.dropped_per_epoch == 2
    images, labels = next(
        iter(
            data.load(
                "tiny_test_images", batch_size=2, rank=1, size=2, data_dir=tmp_path, dtype="float32"
            )
        )
    )
    assert images.shape == (2, 4, 4, 3) and labels.dtype == tf.int32


def test_unknown_name_lists_what_is_available(data_dir):
    with pytest.raises(ValueError, match=r"Unknown data set 'no_such_set'.*kmp_digits"):
        data.load("no_such_set", batch_size=8, rank=0, size=1, data_dir=data_dir)


def test_data_dir_without_the_data_says_how_to_prepare(tmp_path):
    TinyTestImages  # noqa: B018 - registered with TFDS by the class statement above
    with pytest.raises(ValueError, match=r"not prepared in .*tfds build tiny_test_images"):
        data.load("tiny_test_images", batch_size=2, rank=0, size=1, data_dir=tmp_path)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"split": "validation"}, r"no split 'validation'.*train, test"),
        ({"batch_size": 2000}, r"not one full batch"),
        ({"batch_size": 0}, r"`batch_size` must be a positive integer; got 0"),
        ({"rank": 2, "size": 2}, r"rank must be in \[0, size\)"),
        ({"size": 0}, r"`size \(number of ranks\)` must be"),
        ({"dtype": "int32"}, r"dtype must be a floating dtype"),
        ({"image_size": (8, 0)}, r"`image_size` must be a positive integer"),
        ({"image_size": (8,)}, r"image_size must be \(height, width\): two sizes"),
        ({"seed": -1}, r"`seed` must be an integer >= 0"),
        ({"epochs": 0}, r"`epochs` must be"),
    ],
)
def test_bad_arguments_are_clear_errors(data_dir, kwargs, message):
    args = {"split": "train", "batch_size": 8, "rank": 0, "size": 1, **kwargs}
    with pytest.raises(ValueError, match=message):
        data.load("kmp_digits", data_dir=data_dir, **args)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch_size": 8.0}, r"`batch_size` must be a positive integer; got 8.0"),
        ({"image_size": "8"}, r"image_size must be a positive int or \(height, width\)"),
        ({"rank": "0"}, r"`rank` must be an integer >= 0"),
    ],
)
def test_wrong_types_are_type_errors(data_dir, kwargs, message):
    args = {"split": "train", "batch_size": 8, "rank": 0, "size": 1, **kwargs}
    with pytest.raises(TypeError, match=message):
        data.load("kmp_digits", data_dir=data_dir, **args)
    with pytest.raises(TypeError, match="Data set name must be a string"):
        data.load(3, data_dir=data_dir, split="train", batch_size=8)


def test_not_an_image_classification_set(tmp_path, monkeypatch):
    builder = datasets.prepare("kmp_digits", tmp_path)
    info = builder.info
    monkeypatch.setattr(type(info), "supervised_keys", property(lambda self: ("index", "label")))
    with pytest.raises(ValueError, match="not an image-classification data set"):
        data.shard_spec("kmp_digits", batch_size=8, size=1, data_dir=tmp_path)


@pytest.mark.distributed
@requires_horovod
def test_real_two_rank_job_reads_disjoint_shards(data_dir):
    """Under horovodrun, rank and size come from kmp.distributed; shards still cover the split."""
    results = run_workers("worker_data_shards.py", str(data_dir), np=2, timeout=240)
    assert [r["rank"] for r in results] == [0, 1] and {r["size"] for r in results} == {2}
    ids = [set(r["ids"]) for r in results]
    assert ids[0].isdisjoint(ids[1]) and len(ids[0] | ids[1]) == 1438
    assert results[0]["steps"] == results[1]["steps"] == (1438 // 2) // 32
    assert {r["dtype"] for r in results} == {"bfloat16"}
