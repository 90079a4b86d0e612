"""kmp.elastic.data: each epoch's examples dealt to the ranks running now, exactly once."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from kmp.elastic.data import PAD, ElasticData, epoch_order, plan_shard


def used(n, *, epoch, start, size, batch, seed=0):
    """Every id all ranks of one plan get, padding dropped."""
    ids = [plan_shard(n, epoch=epoch, start=start, rank=r, size=size, batch_size=batch, seed=seed)
           .ids for r in range(size)]  # fmt: skip
    flat = np.concatenate([i.reshape(-1) for i in ids])
    return [int(i) for i in flat if i != PAD], ids


@pytest.mark.parametrize("n,size,batch", [(1438, 3, 32), (101, 2, 16), (7, 4, 3), (5, 1, 8)])
def test_one_plan_covers_the_epoch_once(n, size, batch):
    ids, per_rank = used(n, epoch=2, start=0, size=size, batch=batch)
    assert sorted(ids) == list(range(n))
    steps = {p.shape[0] for p in per_rank}
    assert steps == {-(-n // (size * batch))}  # the same number of steps on every rank


@pytest.mark.parametrize("start", [0, 96, 480, 1437, 1438])
def test_a_resize_from_a_commit_neither_drops_nor_repeats(start):
    order = epoch_order(1438, seed=3, epoch=1)
    before = [int(i) for i in order[:start]]  # consumed by 3 ranks up to the commit
    after, _ = used(1438, epoch=1, start=start, size=2, batch=32, seed=3)
    counts = collections.Counter(before + after)
    assert set(counts) == set(range(1438)) and set(counts.values()) == {1}


def test_orders_are_fixed_by_seed_and_epoch():
    a = epoch_order(50, seed=1, epoch=0)
    assert np.array_equal(a, epoch_order(50, seed=1, epoch=0))
    assert not np.array_equal(a, epoch_order(50, seed=1, epoch=1))
    assert np.array_equal(epoch_order(5, seed=1, epoch=0, shuffle=False), np.arange(5))


def test_position_after_steps_is_capped_at_the_epoch():
    plan = plan_shard(101, epoch=0, start=32, rank=1, size=2, batch_size=16)
    assert plan.steps == 3 and plan.per_step == 32
    assert [plan.position_after(k) for k in range(4)] == [32, 64, 96, 101]


@pytest.mark.parametrize(
    "kw,exc",
    [
        ({"rank": 2, "size": 2}, ValueError),
        ({"start": 102}, ValueError),
        ({"batch_size": 0}, ValueError),
        ({"size": 1.5}, TypeError),
        ({"epoch": -1}, ValueError),
    ],
)
def test_bad_plans_are_refused(kw, exc):
    args = {"epoch": 0, "start": 0, "rank": 0, "size": 1, "batch_size": 4, **kw}
    with pytest.raises(exc):
        plan_shard(101, **args)


def test_empty_slots_carry_weight_zero():
    x = np.arange(10, dtype=np.float32).reshape(10, 1)
    data = ElasticData(x, np.arange(10), batch_size=4, shuffle=False)
    plan = data.plan(epoch=0, start=0, rank=1, size=2)  # steps of 8: rank 1 gets 4..7, then -
    batches = list(data.dataset(plan).as_numpy_iterator())
    assert [b[1].tolist() for b in batches] == [[4, 5, 6, 7], [0, 0, 0, 0]]
    assert [b[2].tolist() for b in batches] == [[1, 1, 1, 1], [0, 0, 0, 0]]


def test_elastic_data_checks_its_arrays():
    with pytest.raises(ValueError, match="one label per example"):
        ElasticData(np.zeros((3, 2)), np.zeros(2), batch_size=1)
    with pytest.raises(ValueError, match="at least one example"):
        ElasticData(np.zeros((0, 2)), np.zeros(0), batch_size=1)
    with pytest.raises(TypeError, match="transform"):
        ElasticData(np.zeros((3, 2)), np.zeros(3), batch_size=1, transform=3)


def test_from_tfds_reads_the_real_split(tmp_path):
    from kmp import datasets

    datasets.prepare("kmp_digits", tmp_path)
    data = ElasticData.from_tfds("kmp_digits", "train", batch_size=32, data_dir=tmp_path)
    assert data.num_examples == 1438
    assert data.features.shape[1:] == (8, 8, 1) and data.features.max() <= 1.0
    assert set(np.unique(data.labels)) == set(range(10))
