"""Non-trainable weights that differ between ranks, for a checkpoint that only rank 0 writes.

Under Horovod each rank computes ``BatchNormalization``'s moving statistics (and any
other non-trainable weight a layer updates in its ``call``) from its own batches, so the
ranks hold different values: a checkpoint written by rank 0 alone would give every rank
rank 0's. :func:`gather` finds the non-trainable weights that differ (one checksum per
weight is compared first, so a frozen backbone, the same on every rank, is never sent)
and collects every rank's values of those; :func:`restore` gives each rank its own back
and marks them (:func:`rank_local`), so that ``BroadcastInitialState`` does not overwrite
them with rank 0's when training resumes.
They travel as the ``.npz`` entry :data:`ENTRY` of the ``.keras`` archive
(:func:`kmp.saving.save_model`). Under the JAX engine the distribution keeps one value
for all processes, so nothing differs and nothing is gathered.
"""

from __future__ import annotations

import dataclasses
import io

import keras
import numpy as np

__all__ = ["ENTRY", "RankWeights", "gather", "rank_local", "restore"]

ENTRY = "kmp_rank_weights.npz"
# The attribute by which a loaded model remembers which variables it holds per rank.
_MARK = "_kmp_rank_local_paths"


def rank_local(model: keras.Model) -> frozenset[str]:
    """Paths of the variables :func:`restore` gave each rank its own value of.

    ``BroadcastInitialState`` leaves them out: broadcasting rank 0's value would
    undo the restore (every other variable of a loaded model is the same on all ranks).
    """
    return getattr(model, _MARK, frozenset())


@dataclasses.dataclass(frozen=True)
class RankWeights:
    """Every rank's values of the non-trainable weights that differ between ranks.

    Attributes:
        indices: Positions in ``model.non_trainable_weights``.
        paths: Their variable paths (for messages and the manifest).
        values: One row per rank: the weights at ``indices``, flattened, as float32.
    """

    indices: tuple[int, ...]
    paths: tuple[str, ...]
    values: np.ndarray

    def to_bytes(self) -> bytes:
        """The ``.npz`` bytes of the archive entry."""
        out = io.BytesIO()
        np.savez(
            out,
            indices=np.asarray(self.indices, "int64"),
            paths=np.asarray(self.paths),
            values=self.values,
        )
        return out.getvalue()

    @classmethod
    def from_bytes(cls, blob: bytes) -> RankWeights:
        """Read :meth:`to_bytes`'s output."""
        with np.load(io.BytesIO(blob)) as data:
            return cls(
                tuple(int(i) for i in data["indices"]),
                tuple(str(p) for p in data["paths"]),
                np.asarray(data["values"]),
            )


def _host(variable: keras.Variable) -> np.ndarray:
    return np.asarray(keras.ops.convert_to_numpy(variable.value), "float32").reshape(-1)


def gather(model: keras.Model) -> RankWeights | None:
    """Every rank's non-trainable weights that differ between ranks (a collective).

    Call it on every rank at the same point (``AtomicCheckpoint`` does, at the end of
    an epoch). One allgather of two checksums per non-trainable weight, then one of
    the differing weights.

    Returns:
        The :class:`RankWeights`, or None in a world of one or when no weight differs.
    """
    from kmp import distributed

    weights = model.non_trainable_weights
    if distributed.size() == 1 or not weights:
        return None
    host = [_host(w) for w in weights]
    sums = np.asarray([[v.sum(dtype="float64"), (v.astype("float64") ** 2).sum()] for v in host])
    every = np.asarray(keras.ops.convert_to_numpy(distributed.allgather(sums[None])))
    differ = [i for i in range(len(weights)) if not np.all(every[:, i] == every[0, i])]
    if not differ:
        return None
    mine = np.concatenate([host[i] for i in differ])
    values = np.asarray(keras.ops.convert_to_numpy(distributed.allgather(mine[None])), "float32")
    return RankWeights(tuple(differ), tuple(weights[i].path for i in differ), values)


def restore(model: keras.Model, saved: RankWeights, rank: int) -> None:
    """Give this rank its own saved values (rank ``rank % saved ranks``'s in a larger world).

    Raises:
        ValueError: The model's non-trainable weights do not match the saved ones.
    """
    weights = model.non_trainable_weights
    if max(saved.indices, default=-1) >= len(weights):
        raise ValueError(
            f"The checkpoint holds per-rank values of {len(saved.indices)} non-trainable "
            f"weight(s) ({', '.join(saved.paths[:3])}, ...), but the loaded model has only "
            f"{len(weights)} non-trainable weights. Load it into the model it was written from."
        )
    row = saved.values[rank % len(saved.values)]
    start = 0
    for i in saved.indices:
        variable = weights[i]
        size = int(np.prod(variable.shape))
        if start + size > row.size:
            raise ValueError(
                f"The checkpoint's per-rank value of {variable.path} does not fit its shape "
                f"{tuple(variable.shape)}: load it into the model it was written from."
            )
        value = row[start : start + size].reshape(variable.shape)
        variable.assign(value.astype(keras.backend.standardize_dtype(variable.dtype)))
        start += size
    object.__setattr__(model, _MARK, frozenset(weights[i].path for i in saved.indices))
