"""What a checkpoint holds beyond Keras's own file: RNG states, position and a manifest.

Keras's ``.keras`` file holds the model's config, its weights and, when compiled, its
optimizer (class, settings, every variable: iterations, moments, kmp's loss scale and
counters, Kahan buffers). It does not hold the state of the model's random-number
generators (the ``SeedGenerator`` of every ``Dropout``, ``GaussianNoise``, ... and Keras's
global one), so a resumed model draws other dropout masks than the uninterrupted one,
nor where training stood. :class:`TrainingState` is that rest, written by
:func:`kmp.saving.save_model` as one JSON entry (:data:`ENTRY`) inside the same
``.keras`` archive, so the model and its state are written, replaced and found together.

Decisions are pure functions here (:func:`world_change`); :mod:`kmp.saving` acts on them.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import keras
import numpy as np

__all__ = [
    "ENTRY",
    "FORMAT",
    "TrainingState",
    "WorldChange",
    "capture",
    "gather_seed_states",
    "loaded_state",
    "restore_rng",
    "seed_states",
    "world_change",
]

# The attribute kmp.load_model sets on a model it loads for training: the checkpoint's
# TrainingState, which AtomicCheckpoint reads (and clears) to resume inside an epoch.
LOADED_STATE = "_kmp_loaded_state"

# The archive entry that holds the state, and the version of its layout.
ENTRY = "kmp_state.json"
FORMAT = 1


@dataclasses.dataclass(frozen=True)
class TrainingState:
    """Where training stood, and what wrote the checkpoint.

    Attributes:
        epoch: Epochs completed (``fit(initial_epoch=...)`` to resume with).
        step: Batches of the next epoch already done (0 at an epoch's end).
        steps_per_epoch: Batches per epoch of the ``fit`` that wrote it (None: not
            known), checked before a resume skips ``step`` batches.
        iterations: The optimizer's step count when saved (None: not compiled).
        optimizer: The optimizer's registered class name (None: not compiled).
        seed_states: Per rank, the ``[seed, counter]`` state of every
            ``SeedGenerator`` of the model (``Dropout``, ...), in the order of
            ``model.variables``: each rank draws its own masks, and resumes its own.
        global_seed_state: The state of Keras's global ``SeedGenerator`` (the one
            unseeded ``keras.random`` calls draw from), None when none existed.
        data_seed: The seed the data pipeline was shuffled with, when given.
        world_size: Processes of the job that wrote it.
        engine: ``"horovod"``, ``"jax"`` or ``"none"``.
        policy: The global dtype policy's name.
        master_weights: kmp's optimizer's ``master_weights`` setting (None: not kmp's).
        rank_weights: Paths of the non-trainable weights saved per rank (their values
            are the archive's :data:`kmp.rank_weights.ENTRY`).
        kept_float32: Paths (:mod:`kmp.layer_walk`'s) of the layers ``kmp.keep_float32``
            kept, which :func:`kmp.load_model` keeps in float32 under any policy (empty
            in files written before kmp recorded them).
        versions: kmp, Keras and backend versions, and the backend's name.
        format: The layout version of this record.
    """

    epoch: int = 0
    step: int = 0
    steps_per_epoch: int | None = None
    iterations: int | None = None
    optimizer: str | None = None
    seed_states: tuple[tuple[tuple[int, int], ...], ...] = ()
    global_seed_state: tuple[int, int] | None = None
    data_seed: int | None = None
    world_size: int = 1
    engine: str = "none"
    policy: str = "float32"
    master_weights: str | None = None
    rank_weights: tuple[str, ...] = ()
    kept_float32: tuple[str, ...] = ()
    versions: dict[str, str] = dataclasses.field(default_factory=dict)
    format: int = FORMAT

    def to_json(self) -> str:
        """The record as JSON text."""
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> TrainingState:
        """Read a record written by :meth:`to_json`.

        Raises:
            ValueError: The text is not such a record, or a newer kmp wrote it.
        """
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"kmp's training state ({ENTRY}) is not JSON: {exc}") from exc
        if not isinstance(data, dict) or "format" not in data:
            raise ValueError(f"kmp's training state ({ENTRY}) has no 'format': {data!r:.200}")
        if data["format"] > FORMAT:
            writer = data.get("versions", {}).get("kmp")
            raise ValueError(
                f"This checkpoint's training state has format {data['format']}, newer than "
                f"this kmp reads ({FORMAT}); kmp {writer} wrote it. Upgrade kmp to resume from "
                "it, or read the weights alone: keras.saving.load_model(path, compile=False)."
            )
        known = {f.name for f in dataclasses.fields(cls)}
        data = {k: v for k, v in data.items() if k in known}
        data["seed_states"] = tuple(
            tuple(tuple(pair) for pair in rank) for rank in data.get("seed_states", ())
        )
        data["rank_weights"] = tuple(data.get("rank_weights", ()))
        data["kept_float32"] = tuple(data.get("kept_float32", ()))
        if data.get("global_seed_state") is not None:
            data["global_seed_state"] = tuple(data["global_seed_state"])
        return cls(**data)


def loaded_state(model: keras.Model) -> TrainingState | None:
    """Return the state ``kmp.load_model`` loaded ``model`` with, None when there is none."""
    return getattr(model, LOADED_STATE, None)


def seed_states(model: keras.Model) -> list[Any]:
    """The ``SeedGenerator`` state variables of ``model``, in ``model.variables`` order.

    Keras lists them in ``model.variables`` but not in ``model.weights`` (which is
    what its file saves): the difference is exactly the random state.
    """
    weights = {id(w) for w in model.weights}
    return [v for v in model.variables if id(v) not in weights]


def _global_seed_generator() -> Any:
    """Keras's global ``SeedGenerator`` if one was made, without making one."""
    from kmp._keras_internals import global_seed_generator

    return global_seed_generator()


def _pair(variable: Any) -> tuple[int, int]:
    value = np.asarray(keras.ops.convert_to_numpy(variable.value)).reshape(-1)
    return int(value[0]), int(value[1])


def gather_seed_states(model: keras.Model) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Every rank's seed-generator states, in rank order (a collective: call it on all ranks).

    Args:
        model: The model; the same architecture on every rank.

    Returns:
        One tuple of ``(seed, counter)`` pairs per rank.
    """
    from kmp import distributed

    mine = np.asarray([_pair(v) for v in seed_states(model)], dtype="int64").reshape(-1, 2)
    if distributed.size() == 1 or not len(mine):
        return (tuple(map(tuple, mine.tolist())),)
    every = np.asarray(keras.ops.convert_to_numpy(distributed.allgather(mine[None])))
    return tuple(tuple(tuple(int(x) for x in pair) for pair in rank) for rank in every)


def capture(
    model: keras.Model,
    *,
    epoch: int = 0,
    step: int = 0,
    steps_per_epoch: int | None = None,
    data_seed: int | None = None,
    rank_seed_states: tuple | None = None,
) -> TrainingState:
    """Read the training state of ``model`` (nothing is changed).

    Args:
        model: The model being saved.
        epoch: Epochs completed.
        step: Batches of the next epoch done.
        steps_per_epoch: Batches per epoch of the ``fit`` being saved from.
        data_seed: The data pipeline's shuffle seed, to check on resume.
        rank_seed_states: Every rank's seed-generator states
            (:func:`gather_seed_states`); None records this process's alone.

    Returns:
        The :class:`TrainingState`.
    """
    from kmp import distributed
    from kmp._version import __version__
    from kmp.float32_layers import kept_paths

    optimizer = getattr(model, "optimizer", None)
    iterations = name = master = None
    if optimizer is not None and getattr(model, "compiled", False):
        iterations = int(keras.ops.convert_to_numpy(optimizer.iterations))
        name = keras.saving.get_registered_name(type(optimizer))
        master = getattr(getattr(optimizer, "settings", None), "master_weights", None)
    generator = _global_seed_generator()
    world = distributed.world()
    return TrainingState(
        epoch=int(epoch),
        step=int(step),
        steps_per_epoch=None if steps_per_epoch is None else int(steps_per_epoch),
        iterations=iterations,
        optimizer=name,
        seed_states=(
            (tuple(_pair(v) for v in seed_states(model)),)
            if rank_seed_states is None
            else tuple(rank_seed_states)
        ),
        global_seed_state=None if generator is None else _pair(generator.state),
        data_seed=None if data_seed is None else int(data_seed),
        world_size=world.size,
        engine=world.engine,
        policy=keras.config.dtype_policy().name,
        master_weights=master,
        kept_float32=tuple(kept_paths(model)),
        versions={
            "kmp": __version__,
            "keras": keras.__version__,
            "backend": keras.backend.backend(),
        },
    )


def restore_rng(model: keras.Model, state: TrainingState, rank: int = 0) -> None:
    """Give ``model``'s seed generators (and Keras's global one) their saved states.

    Args:
        model: The loaded model.
        state: The saved state.
        rank: This process's rank: it takes that rank's saved states (a rank
            the writing job did not have takes rank ``rank % saved ranks``'s).

    Raises:
        ValueError: The model has another number of seed generators than the
            saved one (another architecture): nothing is changed.
    """
    variables = seed_states(model)
    saved = state.seed_states[rank % len(state.seed_states)] if state.seed_states else ()
    if len(variables) != len(saved):
        raise ValueError(
            f"The checkpoint holds the state of {len(saved)} random-number generator(s) "
            f"(Dropout and other random layers), but the loaded model has {len(variables)}, "
            "so its random draws cannot continue where they stopped. Load the checkpoint "
            "into the model it was written from."
        )
    for variable, pair in zip(variables, saved, strict=True):
        variable.assign(np.asarray(pair, dtype=variable.dtype))
    if state.global_seed_state is not None:
        from kmp._keras_internals import new_global_seed_generator

        generator = new_global_seed_generator()
        generator.state.assign(np.asarray(state.global_seed_state, dtype=generator.state.dtype))


@dataclasses.dataclass(frozen=True)
class WorldChange:
    """What changes when a checkpoint resumes on another number of processes.

    Attributes:
        saved: Processes of the job that wrote the checkpoint.
        current: Processes of this job.
        lr_factor: The new factor of a learning rate that ``scale_lr=True``
            scaled (the new world size), None when it stays.
        note: The message for the user.
    """

    saved: int
    current: int
    lr_factor: float | None
    note: str


def world_change(saved: int, current: int, *, scale_lr: bool) -> WorldChange | None:
    """Decide what a resume on another world size changes (None: the same size).

    A checkpoint resumes on any number of processes: the weights and the
    optimizer's state do not depend on it. What does: each process reads
    ``1/current`` of the data (another split, so the run is no longer
    bit-identical to one on ``saved`` processes), the global batch is ``current``
    times the per-process batch, and a learning rate that ``scale_lr=True``
    multiplied by the world size follows the new size (as an elastic job's does).

    Args:
        saved: Processes that wrote the checkpoint.
        current: Processes now.
        scale_lr: Whether kmp's optimizer scales the learning rate by the world size.

    Returns:
        The :class:`WorldChange`, or None when ``saved == current``.
    """
    if saved == current:
        return None
    lr = (
        f" The learning rate scaled by the world size (scale_lr=True) is now scaled by "
        f"{current} instead of {saved}."
        if scale_lr
        else " The learning rate is unchanged (scale_lr=False)."
    )
    note = (
        f"Resuming a checkpoint written by {saved} process(es) on {current}: weights and "
        f"optimizer state are restored as saved; each process now reads 1/{current} of the "
        f"data (another split, so the run will not match one that continued on {saved}), and "
        f"the global batch is {current}x the per-process batch instead of {saved}x.{lr}"
    )
    return WorldChange(saved, current, float(current) if scale_lr else None, note)
