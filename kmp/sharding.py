"""How a split is dealt to ranks: the arithmetic and checks every kmp data source shares.

:mod:`kmp.data` (TensorFlow Datasets) and :mod:`kmp.datasets.memory` (data sets
held in memory) deal examples to ranks by the same rules, which live here:
:func:`shard_counts` (examples per rank, the full batches every rank runs, what
is left out), :class:`ShardSpec` (their record), :func:`resolve_world` and
:func:`resolve_size` (the rank and size, given or this process's), :func:`check_seed` and
:func:`epoch_seed` (the base seed and each epoch's shuffle seed), and
:func:`compute_dtype` (the dtype inputs are cast to). ``kmp.data.ShardSpec`` is
the public spelling.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kmp._checks import check_int
from kmp._names import LOW_FLOATS

__all__ = [
    "MAX_SEED",
    "ShardSpec",
    "check_seed",
    "compute_dtype",
    "epoch_seed",
    "resolve_size",
    "resolve_world",
    "shard_counts",
]

MAX_SEED = 2**31  # seeds and the per-epoch seeds made from them stay below this


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """How one split is divided among ranks and batches.

    Attributes:
        name: Data set name.
        split: Split name (any TFDS split expression).
        num_examples: Examples in the split.
        size: Number of ranks.
        batch_size: Examples per batch on each rank (None: unbatched).
        examples_per_rank: Examples each rank is guaranteed, ``num_examples // size``.
        steps_per_epoch: Batches each rank runs per epoch (every rank the same);
            None when unbatched.
        dropped_per_epoch: Examples of the split that no rank trains on in one
            epoch (0 when unbatched).
        num_classes: Number of label classes.
        image_shape: Shape of one image as stored, e.g. ``(8, 8, 1)``.
    """

    name: str
    split: str
    num_examples: int
    size: int
    batch_size: int | None
    examples_per_rank: int
    steps_per_epoch: int | None
    dropped_per_epoch: int
    num_classes: int
    image_shape: tuple[int | None, ...]

    def to_dict(self) -> dict:
        """Return a JSON-ready dict."""
        return dataclasses.asdict(self)


def shard_counts(
    name: str, split: str, num_examples: int, size: int, batch_size: int | None
) -> tuple[int, int | None, int]:
    """How ``num_examples`` are dealt to ``size`` ranks: the arithmetic of every data set.

    Returns:
        ``(examples per rank, full batches per rank and epoch (None: unbatched), examples
        left out per epoch)``.

    Raises:
        ValueError: Too few examples for one full batch per rank (``name`` and ``split``
            name the data in the message).
    """
    per_rank = num_examples // size
    if batch_size is None:
        return per_rank, None, 0
    steps = per_rank // batch_size
    if steps == 0:
        raise ValueError(
            f"Split {split!r} of {name!r} has {num_examples} examples: with {size} rank(s) "
            f"and batch_size={batch_size} per rank there is not one full batch per rank. "
            f"Use batch_size <= {max(per_rank, 1)}, fewer ranks or more data."
        )
    return per_rank, steps, num_examples - size * steps * batch_size


def resolve_world(rank: int | None, size: int | None) -> tuple[int, int]:
    """``(rank, size)``: the given ones, checked, or this process's in ``kmp.distributed``.

    Raises:
        TypeError: A rank or size that is not an int.
        ValueError: ``size < 1``, ``rank < 0`` or ``rank >= size``.
    """
    if rank is None or size is None:
        try:
            from kmp import distributed
        except ImportError:  # the distributed module is optional for plain input pipelines
            default_rank, default_size = 0, 1
        else:
            default_rank, default_size = distributed.rank(), distributed.size()
        rank = default_rank if rank is None else rank
        size = default_size if size is None else size
    check_int("size (number of ranks)", size, minimum=1)
    check_int("rank", rank, minimum=0)
    if rank >= size:
        raise ValueError(f"rank must be in [0, size): got rank={rank} with size={size}.")
    return rank, size


def resolve_size(size: int | None) -> int:
    """The number of ranks: ``size``, checked, or this process's world size when None."""
    return resolve_world(None if size is None else 0, size)[1]


def compute_dtype(dtype: Any) -> str:
    """The floating dtype inputs are cast to: ``dtype``, or the Keras policy's compute dtype.

    Raises:
        ValueError: ``dtype`` is not a floating dtype.
    """
    import keras

    if dtype is None:
        return keras.config.dtype_policy().compute_dtype
    name = keras.backend.standardize_dtype(dtype)
    if name not in (*LOW_FLOATS, "float32", "float64"):
        raise ValueError(
            f"dtype must be a floating dtype (float16, bfloat16, float32, float64), got "
            f"{dtype!r}. Leave it None to follow the current Keras policy."
        )
    return name


def epoch_seed(seed: int, epoch: int) -> int:
    """The shuffle seed of one epoch: a fixed function of (seed, epoch)."""
    return (seed * 1_000_003 + epoch) % MAX_SEED


def check_seed(seed: Any) -> int:
    """Return the base seed of the shuffles if it is an int in ``[0, 2**31)``.

    Raises:
        TypeError: ``seed`` is not an int.
        ValueError: It is negative or ``>= 2**31``.
    """
    check_int("seed", seed, minimum=0)
    if seed >= MAX_SEED:
        raise ValueError(f"seed must be < 2**31, got {seed}.")
    return seed
