"""kmp.sharding: the rules kmp.data (TFDS) and kmp.datasets.memory share, checked once."""

from __future__ import annotations

import keras
import pytest

from kmp import data, sharding
from kmp.datasets import memory


def test_shard_counts_deal_full_batches_and_count_what_is_left_out():
    # 1,438 examples on 3 ranks of 32: 479 each, 14 full batches, 1438 - 3 * 14 * 32 left out.
    assert sharding.shard_counts("d", "train", 1438, 3, 32) == (479, 14, 94)
    assert sharding.shard_counts("d", "train", 1438, 3, None) == (479, None, 0)
    with pytest.raises(ValueError, match=r"Split 'train' of 'd' has 10 .*batch_size <= 5"):
        sharding.shard_counts("d", "train", 10, 2, 8)


def test_the_public_spelling_is_the_same_object():
    assert data.ShardSpec is sharding.ShardSpec


def test_resolve_world_checks_what_it_is_given_and_defaults_to_this_process():
    assert sharding.resolve_world(None, None) == (0, 1)  # no world started: one process
    assert sharding.resolve_world(1, 4) == (1, 4)
    assert (sharding.resolve_size(None), sharding.resolve_size(3)) == (1, 3)
    with pytest.raises(ValueError, match=r"rank must be in \[0, size\)"):
        sharding.resolve_world(4, 4)
    with pytest.raises(TypeError, match="rank"):
        sharding.resolve_world(1.0, 4)
    with pytest.raises(ValueError, match="size"):
        sharding.resolve_size(0)


def test_check_seed_bounds_and_epoch_seeds_are_fixed_and_in_range():
    assert sharding.check_seed(2**31 - 1) == 2**31 - 1
    with pytest.raises(ValueError, match=r"seed must be < 2\*\*31"):
        sharding.check_seed(2**31)
    with pytest.raises(TypeError, match="seed"):
        sharding.check_seed("7")
    seeds = [sharding.epoch_seed(2**31 - 1, e) for e in range(3)]
    assert seeds == [sharding.epoch_seed(2**31 - 1, e) for e in range(3)]  # the same again
    assert len(set(seeds)) == 3 and all(0 <= s < sharding.MAX_SEED for s in seeds)


def test_compute_dtype_follows_the_policy_unless_given():
    before = keras.config.dtype_policy()
    try:
        keras.config.set_dtype_policy("mixed_bfloat16")
        assert sharding.compute_dtype(None) == "bfloat16"
        assert sharding.compute_dtype("float16") == "float16"
    finally:
        keras.config.set_dtype_policy(before)
    with pytest.raises(ValueError, match="floating dtype"):
        sharding.compute_dtype("int32")


def test_both_data_sources_reject_the_same_bad_seed():
    for load in (
        lambda: memory.load("mnist1d", "train", batch_size=8, seed=2**31),
        lambda: data.load("kmp_digits", "train", batch_size=8, seed=2**31),
    ):
        with pytest.raises(ValueError, match=r"seed must be < 2\*\*31"):
            load()
