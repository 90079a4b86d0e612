"""kmp.distributed.buckets: the bucket plan, its checks, and where bucket_bytes goes."""

from __future__ import annotations

import keras
import pytest

import kmp
from kmp.distributed.buckets import check_bucket_bytes, plan_buckets


def test_one_bucket_without_a_size():
    assert plan_buckets([4, 8, 16], None) == [[0, 1, 2]]
    assert plan_buckets([], None) == [] and plan_buckets([], 10) == []


def test_buckets_are_filled_from_the_last_tensor():
    # The backward pass makes the last gradients first: they go in the first bucket.
    assert plan_buckets([1024, 128, 512, 16], 200) == [[2, 3], [0, 1]]
    assert plan_buckets([1024, 128, 512, 16], 1) == [[3], [2], [1], [0]]
    assert plan_buckets([10, 10, 10, 10, 10], 25) == [[2, 3, 4], [0, 1]]


def test_a_large_tensor_gets_its_own_bucket_and_the_rest_close_the_plan():
    assert plan_buckets([8, 100, 8], 50) == [[1, 2], [0]]
    assert plan_buckets([8, 8, 8], 1000) == [[0, 1, 2]]


def test_every_position_appears_once():
    sizes = [3, 0, 70, 5, 0, 41, 9]
    for size in (1, 10, 50, 100, None):
        flat = sorted(i for b in plan_buckets(sizes, size) for i in b)
        assert flat == list(range(len(sizes)))


@pytest.mark.parametrize("bad", ["4MB", 2.5, True])
def test_a_bucket_size_of_the_wrong_type_is_a_type_error(bad):
    with pytest.raises(TypeError, match="bucket_bytes"):
        check_bucket_bytes(bad)


@pytest.mark.parametrize("bad", [0, -1])
def test_a_bucket_size_below_one_is_a_value_error(bad):
    with pytest.raises(ValueError, match=r"bucket_bytes.*None for one bucket"):
        plan_buckets([1], bad)


def test_grouped_allreduce_checks_the_size_in_a_single_process():
    with pytest.raises(ValueError, match="bucket_bytes"):
        kmp.distributed.grouped_allreduce([1.0], bucket_bytes=0)
    assert kmp.distributed.grouped_allreduce([1.0, 2.0], bucket_bytes=4) == [1.0, 2.0]


def test_wrap_optimizer_checks_keeps_and_saves_bucket_bytes():
    with pytest.raises(TypeError, match="bucket_bytes"):
        kmp.wrap_optimizer(keras.optimizers.SGD(), bucket_bytes="4MB")
    with pytest.raises(ValueError, match="bucket_bytes"):
        kmp.wrap_optimizer(keras.optimizers.SGD(), bucket_bytes=0)
    opt = kmp.wrap_optimizer(keras.optimizers.SGD(), bucket_bytes=2**20)
    assert opt.settings.bucket_bytes == 2**20
    again = type(opt).from_config(opt.get_config())
    assert again.settings.bucket_bytes == 2**20
    one = kmp.wrap_optimizer(keras.optimizers.SGD(), bucket_bytes=None)
    assert one.settings.bucket_bytes is None
    with pytest.raises(ValueError, match="bucket_bytes=None"):
        kmp.wrap_optimizer(opt, bucket_bytes=None)
    assert kmp.wrap_optimizer(opt, bucket_bytes=2**20) is opt


def test_default_is_the_documented_one():
    from kmp.distributed.buckets import DEFAULT_BUCKET_BYTES

    assert kmp.wrap_optimizer(keras.optimizers.SGD()).settings.bucket_bytes == DEFAULT_BUCKET_BYTES


def test_tf1_optimizer_checks_bucket_bytes_before_touching_the_optimizer():
    import tensorflow as tf

    base = tf.compat.v1.train.GradientDescentOptimizer(0.1)
    with pytest.raises(ValueError, match="bucket_bytes"):
        kmp.compat.v1.distributed_optimizer(base, bucket_bytes=0, scale_lr=True)
    assert base._learning_rate == 0.1
    opt = kmp.compat.v1.distributed_optimizer(base, bucket_bytes=64)
    assert opt.settings.bucket_bytes == 64


def test_buckets_that_cannot_overlap_are_explained():
    from kmp.distributed.buckets import overlap_warning

    message = overlap_warning(3, 1)
    assert "3 buckets" in message and "set_inter_op_parallelism_threads(2)" in message
    assert overlap_warning(1, 1) is None  # one bucket: nothing to overlap
    assert overlap_warning(3, 2) is None and overlap_warning(3, 0) is None  # 0: TF's default
