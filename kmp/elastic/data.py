"""Elastic input: each epoch's examples dealt to however many ranks run now.

An elastic job's rank count changes mid-epoch, so the shard of a rank cannot be
fixed at the start, as :mod:`kmp.data` fixes it. Here every epoch has one order
of the whole split, the same on every rank (a fixed function of
``(seed, epoch)``). The run's position in it, ``samples_done``, is part of the
committed state (:class:`kmp.elastic.KerasState`). After a reset the examples
left, ``order[samples_done:]``, are dealt again to the new ranks, so from the
commit point on no example of the epoch is dropped or seen twice.

Each step consumes ``size * batch_size`` examples of the order: rank ``r``
takes the ``r``-th block of ``batch_size``. The last step of an epoch may have
fewer examples than slots; the empty slots hold a stand-in example with
sample weight 0, so that every rank still runs the same number of steps (a
rank that ran one step fewer would leave the others waiting in the allreduce).

:func:`plan_shard` is the pure decision. :class:`ElasticData` holds the split
in host memory and builds the ``tf.data`` pipeline of one plan.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from kmp._checks import check_bool, check_int

__all__ = ["ElasticData", "ShardPlan", "epoch_order", "plan_shard"]

PAD = -1  # the id of an empty slot in ShardPlan.ids


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """What one rank trains on from a point of an epoch to its end.

    Attributes:
        epoch: The epoch.
        start: Examples of the epoch consumed before this plan (``samples_done``).
        rank: The rank the plan is for.
        size: The number of ranks sharing the rest of the epoch.
        batch_size: Examples per rank per step.
        num_examples: Examples in the epoch (the whole split).
        ids: ``(steps, batch_size)`` indices into the split, :data:`PAD` for an
            empty slot of the last step.
    """

    epoch: int
    start: int
    rank: int
    size: int
    batch_size: int
    num_examples: int
    ids: np.ndarray

    @property
    def steps(self) -> int:
        """Steps left in the epoch (the same on every rank)."""
        return int(self.ids.shape[0])

    @property
    def per_step(self) -> int:
        """Examples all ranks consume together per step."""
        return self.size * self.batch_size

    def position_after(self, steps: int) -> int:
        """``samples_done`` after ``steps`` steps of this plan."""
        return min(self.start + steps * self.per_step, self.num_examples)


def epoch_order(num_examples: int, *, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The order of the split in ``epoch``: a fixed function of ``(seed, epoch)``."""
    if not shuffle:
        return np.arange(num_examples, dtype=np.int64)
    return np.random.default_rng([seed, epoch]).permutation(num_examples).astype(np.int64)


def plan_shard(
    num_examples: int,
    *,
    epoch: int,
    start: int,
    rank: int,
    size: int,
    batch_size: int,
    seed: int = 0,
    shuffle: bool = True,
) -> ShardPlan:
    """Deal the rest of ``epoch``, from example ``start`` of its order, to ``size`` ranks.

    Args:
        num_examples: Examples in the split (> 0).
        epoch: The epoch (>= 0).
        start: Examples of the epoch already consumed, ``0 <= start <= num_examples``.
        rank: This rank, ``0 <= rank < size``.
        size: The ranks running now (>= 1).
        batch_size: Examples per rank per step (>= 1).
        seed: The base seed of the orders.
        shuffle: A new order each epoch (False: the stored order).

    Returns:
        The :class:`ShardPlan`.

    Raises:
        TypeError: An argument is not an int (``shuffle`` not a bool).
        ValueError: An argument is out of range.
    """
    num_examples = check_int("num_examples", num_examples, minimum=1)
    epoch = check_int("epoch", epoch, minimum=0)
    size = check_int("size", size, minimum=1)
    rank = check_int("rank", rank, minimum=0, maximum=size - 1)
    batch_size = check_int("batch_size", batch_size, minimum=1)
    start = check_int("start", start, minimum=0, maximum=num_examples)
    seed = check_int("seed", seed, minimum=0)
    check_bool("shuffle", shuffle)
    rest = epoch_order(num_examples, seed=seed, epoch=epoch, shuffle=shuffle)[start:]
    per_step = size * batch_size
    steps = math.ceil(rest.size / per_step)
    padded = np.full(steps * per_step, PAD, dtype=np.int64)
    padded[: rest.size] = rest
    ids = padded.reshape(steps, size, batch_size)[:, rank, :]
    return ShardPlan(epoch, start, rank, size, batch_size, num_examples, np.ascontiguousarray(ids))


class ElasticData:
    """A split held in host memory, dealt to the ranks of an elastic job epoch by epoch.

    Args:
        features: Input array, first axis the examples.
        labels: Target array, same first axis.
        batch_size: Examples per rank per step.
        seed: Base seed of the epochs' orders.
        shuffle: A new order each epoch.
        transform: Optional ``transform(dataset, plan) -> dataset`` applied to
            each plan's batched dataset (to add augmentation, or a test's fault).

    Raises:
        TypeError: A wrong type (``transform`` not callable, a non-int size).
        ValueError: Empty arrays or arrays of different lengths.
    """

    def __init__(
        self,
        features: Any,
        labels: Any,
        *,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        transform: Callable[[Any, ShardPlan], Any] | None = None,
    ):
        features, labels = np.asarray(features), np.asarray(labels)
        if features.ndim == 0 or features.shape[0] == 0:
            raise ValueError("ElasticData needs at least one example (features is empty).")
        if labels.shape[:1] != features.shape[:1]:
            raise ValueError(
                f"features has {features.shape[0]} examples but labels has "
                f"{labels.shape[0] if labels.ndim else 0}; give one label per example."
            )
        if transform is not None and not callable(transform):
            raise TypeError(f"transform must be callable(dataset, plan), got {transform!r}.")
        self.features, self.labels = features, labels
        self.batch_size = check_int("batch_size", batch_size, minimum=1)
        self.seed = check_int("seed", seed, minimum=0)
        self.shuffle = check_bool("shuffle", shuffle)
        self.transform = transform

    @classmethod
    def from_tfds(
        cls,
        name: str,
        split: str = "train",
        *,
        batch_size: int,
        data_dir: str | os.PathLike | None = None,
        image_size: int | tuple[int, int] | None = None,
        dtype: Any = None,
        **kwargs: Any,
    ) -> ElasticData:
        """Read a TFDS image split (as :func:`kmp.data.load` does) into host memory.

        Every rank reads the whole split in its stored order, so the split must
        fit in host memory; larger data needs its own ``plan -> dataset`` code
        (use :func:`plan_shard` for the indices).

        Args:
            name: TFDS data-set name, e.g. ``"kmp_digits"``.
            split: Split to read.
            batch_size: Examples per rank per step.
            data_dir: TFDS data directory.
            image_size: Resize images to this size.
            dtype: Image dtype (default: the policy's compute dtype).
            **kwargs: ``seed``, ``shuffle``, ``transform`` for :class:`ElasticData`.
        """
        from kmp import data as _data

        ds = _data.load(
            name,
            split,
            batch_size=None,
            data_dir=data_dir,
            rank=0,
            size=1,
            shuffle=False,
            image_size=image_size,
            dtype=dtype,
        )
        images, labels = [], []
        for x, y in ds.batch(1024).as_numpy_iterator():
            images.append(x)
            labels.append(y)
        return cls(np.concatenate(images), np.concatenate(labels), batch_size=batch_size, **kwargs)

    @property
    def num_examples(self) -> int:
        """Examples per epoch."""
        return int(self.features.shape[0])

    def plan(self, *, epoch: int, start: int, rank: int, size: int) -> ShardPlan:
        """The :class:`ShardPlan` of ``rank`` from ``start`` of ``epoch`` at ``size`` ranks."""
        return plan_shard(
            self.num_examples,
            epoch=epoch,
            start=start,
            rank=rank,
            size=size,
            batch_size=self.batch_size,
            seed=self.seed,
            shuffle=self.shuffle,
        )

    def dataset(self, plan: ShardPlan) -> Any:
        """The ``tf.data`` pipeline of ``plan``: ``(features, labels, sample_weight)`` batches.

        Empty slots carry example 0 with weight 0: they change neither the loss
        sum nor the metrics.
        """
        import tensorflow as tf

        flat = plan.ids.reshape(-1)
        real = flat != PAD
        picked = np.where(real, flat, 0)
        weights = real.astype(np.float32)
        ds = tf.data.Dataset.from_tensor_slices(
            (self.features[picked], self.labels[picked], weights)
        ).batch(plan.batch_size)
        if self.transform is not None:
            ds = self.transform(ds, plan)
        return ds.prefetch(tf.data.AUTOTUNE)
